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


def _assert_padded_logits_match(ref, ours, rows: list[list[int]], tol: float) -> None:
    """Logits [B, T, V] of a left-padded batch of ``rows``: ours equal transformers' at the real positions."""
    ids, mask = left_pad(rows, pad_id=0)
    pos = positions_from_mask(mask)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours.compute_logits(ours(ids, pos, None, AttentionMetadata(mask)))
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=tol, atol=tol)


def test_gpt2_logits_match_transformers_on_left_padded_batch(gpt2_pair):
    ref, ours, _ = gpt2_pair
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, ref.config.vocab_size, (n,), generator=g).tolist() for n in (9, 4, 6)]
    _assert_padded_logits_match(ref, ours, rows, 1e-4)


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


@pytest.mark.parametrize("scale_attn_weights", [True, False])
def test_gpt2_scale_attn_by_inverse_layer_idx_matches_transformers(tiny_model, tmp_path, scale_attn_weights):
    """scale_attn_by_inverse_layer_idx divides layer i's scores by i + 1 (after D^-0.5 when scale_attn_weights):
    logits on a padded batch equal transformers' eager attention's (its SDPA path drops the setting)."""
    ref = tiny_model("gpt2", vocab_size=97, std=0.5, scale_attn_by_inverse_layer_idx=True,
                     scale_attn_weights=scale_attn_weights, attn_implementation="eager").ref
    ref.save_pretrained(tmp_path)
    ours = build_model(*load_hf_directory(tmp_path))
    _assert_padded_logits_match(ref, ours, [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]], 1e-5)


def test_untied_gpt2_uses_its_own_lm_head(tiny_model, tmp_path):
    """tie_word_embeddings false: the checkpoint's lm_head.weight (not wte) gives the logits, as in transformers
    (kvgen refused the checkpoint: 'unexpected lm_head.weight')."""
    ref = tiny_model("gpt2", tie=False, vocab_size=97).ref
    ref.save_pretrained(tmp_path)
    ours = build_model(*load_hf_directory(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        expected = ref(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(5)[None]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_head", [64, 16])  # head_dim 1 and 3: any size, as GPT-2 has no RoPE
def test_gpt2_with_a_head_dim_below_2_or_odd_matches_transformers(tmp_path, n_head):
    """A GPT-2 whose heads are 1 or 3 wide loads and gives transformers' logits (kvgen refused it with a RoPE
    error, 'partial_rotary_factor must give an even rotary dimension', for a model without RoPE)."""
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=97, n_embd=64 if n_head == 64 else 48, n_layer=2, n_head=n_head,
                                        n_positions=16)
    ref = transformers.GPT2LMHeadModel(hf_config).eval()
    ref.save_pretrained(tmp_path)
    ours = build_model(*load_hf_directory(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    with torch.inference_mode():
        expected = ref(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(5).expand(2, 5)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_fast", "gelu_accurate", "gelu_python", "quick_gelu", "silu",
                                        "swish", "gelu", "relu"])
def test_gpt2_activation_functions_match_transformers(tiny_model, tmp_path, activation):
    """Every activation_function kvgen takes gives transformers' logits (gelu_fast, gelu_accurate, gelu_python,
    quick_gelu, silu and swish were refused as unsupported)."""
    ref = tiny_model("gpt2", vocab_size=97, std=0.5, activation_function=activation).ref
    ref.save_pretrained(tmp_path)
    ours = build_model(*load_hf_directory(tmp_path))
    _assert_padded_logits_match(ref, ours, [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]], 1e-5)
