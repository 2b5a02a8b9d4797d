"""kvgen.loader: a GPT-2 checkpoint paired with a BertTokenizer vocab.txt, loaded and generated end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model
from tokenizer_cases import WORDPIECE_VOCAB, write_wordpiece_dir
from transformers import BertTokenizer, GPT2LMHeadModel

import kvgen
from kvgen.generation import GenerationConfig


@pytest.fixture(scope="module")
def gpt2_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight GPT-2 saved with a vocab.txt and a tokenizer_config naming BertTokenizer."""
    directory = tmp_path_factory.mktemp("gpt2_bert")
    ref = make_tiny_model("gpt2", vocab_size=len(WORDPIECE_VOCAB), max_position_embeddings=64,
                          bos_token_id=None, eos_token_id=None).ref  # GPT2Config's 50256 is outside this vocabulary
    ref.save_pretrained(directory, safe_serialization=True)
    return write_wordpiece_dir(directory, WORDPIECE_VOCAB, do_lower_case=True)


def test_gpt2_with_bert_tokenizer_generates_like_transformers(gpt2_bert_dir: Path) -> None:
    assert not (gpt2_bert_dir / "tokenizer.json").exists()
    assert json.loads((gpt2_bert_dir / "config.json").read_text())["model_type"] == "gpt2"
    model, tokenizer = kvgen.load_model(gpt2_bert_dir)
    ref_tokenizer = BertTokenizer(str(gpt2_bert_dir / "vocab.txt"), do_lower_case=True)
    ref_model = GPT2LMHeadModel.from_pretrained(gpt2_bert_dir).eval()
    for text in ("你好，世界！Hello", "The WEATHER is fine, 天气很不错"):
        ids = tokenizer.encode(text)
        assert ids == ref_tokenizer.encode(text)
        input_ids = torch.tensor([ids])
        out = kvgen.generate(model, input_ids, None, GenerationConfig(max_new_tokens=12, pad_token_id=0))
        with torch.inference_mode():
            expected = ref_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                do_sample=False, pad_token_id=ref_tokenizer.pad_token_id,
            )
        assert out.sequences.tolist() == expected.tolist()
        new_ids = expected[0, len(ids) :].tolist()
        for skip in (True, False):
            assert tokenizer.decode(new_ids, skip_special_tokens=skip) == ref_tokenizer.decode(
                new_ids, skip_special_tokens=skip
            )
    assert tokenizer.eos_token_ids == [ref_tokenizer.sep_token_id]


def test_engine_on_gpt2_with_bert_tokenizer_matches_generate(gpt2_bert_dir: Path) -> None:
    """The engine's streamed text (IncrementalDetokenizer with clean-up) equals BertTokenizer's decode."""
    model, tokenizer = kvgen.load_model(gpt2_bert_dir)
    ref_tokenizer = BertTokenizer(str(gpt2_bert_dir / "vocab.txt"), do_lower_case=True)
    ids = tokenizer.encode("it's fine, 你好", add_special_tokens=False)
    llm = kvgen.LLM(model, tokenizer)
    params = kvgen.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    completion = output.outputs[0]
    reference = kvgen.generate(model, torch.tensor([ids]), None, GenerationConfig(max_new_tokens=12, pad_token_id=0))
    assert completion.token_ids == reference.sequences[0, len(ids) :].tolist()
    expected = ref_tokenizer.decode(ids + completion.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head = ref_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert completion.text == BertTokenizer.clean_up_tokenization(expected[len(head) :])
