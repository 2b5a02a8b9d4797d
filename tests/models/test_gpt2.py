"""Our GPT-2 vs transformers' GPT2LMHeadModel: random weights saved with save_pretrained."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import left_pad

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.runner import positions_from_mask
from kvgen.models import AttentionMetadata, build_model
from kvgen.weights.hf_loader import load_hf_directory

# "124M" is GPT-2 small (transformers' GPT2Config defaults): a real-size check, slow.
CONFIGS = ["tiny", pytest.param("124M", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=CONFIGS)
def gpt2_pair(request, tmp_path_factory, tiny_model):
    if request.param == "tiny":
        ref = tiny_model("gpt2", vocab_size=211).ref
    else:
        torch.manual_seed(1234)
        ref = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    path = tmp_path_factory.mktemp(f"gpt2-{request.param}")
    ref.save_pretrained(path)
    config, state_dict = load_hf_directory(path)
    return ref, build_model(config, state_dict), request.param


def test_gpt2_logits_match_transformers_on_left_padded_batch(gpt2_pair):
    ref, ours, _ = gpt2_pair
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 4, 6)]
    ids, mask = left_pad(rows, pad_id=0)
    pos = positions_from_mask(mask)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours.compute_logits(ours(ids, pos, None, AttentionMetadata(mask)))
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


def test_gpt2_greedy_20_tokens_identical_to_transformers(gpt2_pair):
    ref, ours, _ = gpt2_pair
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 3)]
    ids, mask = left_pad(rows, pad_id=0)
    out = generate(ours, ids, mask, GenerationConfig(max_new_tokens=20, eos_token_id=[], pad_token_id=0))
    with torch.inference_mode():
        expected = ref.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.sequences.tolist() == expected.tolist()
