"""Fixtures of the tokenizer tests: the default GGUF's metadata, kvgen's and transformers' tokenizers on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizer_cases import train_byte_level
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers
from transformers import LlamaTokenizerFast

from kvgen.default_model import find_default_gguf
from kvgen.errors import ModelNotFoundError
from kvgen.tokenizer import Tokenizer
from kvgen.weights.gguf_file import gguf_metadata, open_gguf


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return find_default_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def meta(gguf_path: Path) -> dict:
    return gguf_metadata(open_gguf(gguf_path))


@pytest.fixture(scope="session")
def ours(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf(meta)


@pytest.fixture(scope="session")
def ref(gguf_path: Path) -> LlamaTokenizerFast:
    """transformers' tokenizer for the default GGUF.

    AutoTokenizer resolves this file to LlamaTokenizerFast (asserted below); naming the class
    skips AutoTokenizer's extra parse of the whole GGUF, about half of the load time.
    """
    return LlamaTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def ref_smollm(ref: LlamaTokenizerFast) -> BackendTokenizer:
    """transformers' tokenizer with SmolLM2's own tokenizer.json pre-tokenizer, Digits -> ByteLevel.

    transformers' GGUF loader drops the digit split that ``tokenizer.ggml.pre = "smollm"`` asks
    for; ASCII digits never merge in this vocabulary, but other numerals ("١٢٣") do.
    """
    backend = BackendTokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.fixture(scope="session")
def trained() -> BackendTokenizer:
    return train_byte_level()
