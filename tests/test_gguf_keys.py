"""kvgen.gguf_keys: GGUF metadata values of the wrong type are refused naming their key, by both readers of the
metadata (ModelConfig.from_gguf_metadata and Tokenizer.from_gguf), before any of them is used."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError
from kvgen.gguf_keys import check_gguf_value_types
from kvgen.tokenizer import Tokenizer

LLAMA = {"general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 256,
         "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
         "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
         "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 4}
TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": ["a", "b", "ab", "<e>"],
             "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.merges": ["a b"],
             "tokenizer.ggml.bos_token_id": 3, "tokenizer.ggml.eos_token_id": 3}


def test_valid_metadata_is_read() -> None:
    config = ModelConfig.from_gguf_metadata(LLAMA | TOKENIZER)
    assert (config.num_hidden_layers, config.head_dim, config.eos_token_ids) == (2, 16, [3])
    assert Tokenizer.from_gguf(LLAMA | TOKENIZER).encode("ab", add_special_tokens=False) == [2]


@pytest.mark.parametrize(("key", "value", "what"), [
    ("llama.block_count", "two", "an integer"),
    ("llama.block_count", [2], "an integer"),
    ("llama.block_count", True, "an integer"),
    ("llama.context_length", 256.7, "an integer"),
    ("llama.context_length", "256", "an integer"),
    ("llama.embedding_length", float("nan"), "an integer"),
    ("llama.attention.head_count", [4, 4], "an integer"),
    ("llama.rope.freq_base", "1e4", "a number"),
    ("llama.rope.scaling.type", ["linear"], "a string"),
    ("tokenizer.ggml.bos_token_id", "1", "an integer"),
    ("general.architecture", "llama", None),  # control: valid
])
def test_config_keys_of_the_wrong_type_are_named(key: str, value: Any, what: str | None) -> None:
    meta = LLAMA | TOKENIZER | {key: value}
    if what is None:
        assert ModelConfig.from_gguf_metadata(meta).num_hidden_layers == 2
        return
    with pytest.raises(ModelFormatError, match=rf"GGUF metadata {re.escape(key)} must be {what}, got "):
        ModelConfig.from_gguf_metadata(meta)


@pytest.mark.parametrize(("key", "value", "what"), [
    ("tokenizer.ggml.eos_token_id", "2", "an integer"),
    ("tokenizer.ggml.eos_token_id", [2, 3], "an integer"),
    ("tokenizer.ggml.unknown_token_id", "x", "an integer"),
    ("tokenizer.ggml.merges", [1, 2], "an array of strings"),
    ("tokenizer.ggml.tokens", [0, 1, 2, 3], "an array of strings"),
    ("tokenizer.ggml.tokens", "abc", "an array of strings"),
    ("tokenizer.ggml.pre", ["smollm"], "a string"),
    ("tokenizer.ggml.model", 7, "a string"),
    ("tokenizer.ggml.token_type", ["1", "1", "1", "3"], "an array of integers"),
    ("tokenizer.ggml.add_bos_token", "false", "a boolean"),
    ("tokenizer.chat_template", 5, "a string"),
])
def test_tokenizer_keys_of_the_wrong_type_are_named(key: str, value: Any, what: str) -> None:
    with pytest.raises(ModelFormatError, match=rf"GGUF metadata {re.escape(key)} must be {what}, got "):
        Tokenizer.from_gguf(TOKENIZER | {key: value})


def test_keys_kvgen_does_not_read_are_not_checked() -> None:
    check_gguf_value_types(LLAMA | {"llama.some_future_key": ["x"], "general.license": 5,
                                    "qwen2.block_count": "another architecture's key"})


def test_a_long_value_is_shortened_in_the_message() -> None:
    with pytest.raises(ModelFormatError, match=r"got \[0, 1, 2, .*\.\.\.$"):
        check_gguf_value_types({"tokenizer.ggml.tokens": list(range(10_000))})


def test_a_zero_head_count_is_refused_before_it_divides() -> None:
    with pytest.raises(ModelFormatError, match=r"llama.attention.head_count must be positive, got 0"):
        ModelConfig.from_gguf_metadata(LLAMA | {"llama.attention.head_count": 0})
