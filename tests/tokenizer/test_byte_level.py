"""kvgen.tokenizer.byte_level: pre-tokenizer splits against llama.cpp's rules."""

from __future__ import annotations

import regex
from tokenizer_cases import HARD_STRINGS, TRAIN_TEXT
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvgen.tokenizer import GGUF_PRE_TOKENIZERS, build_byte_level_bpe


def _llama_cpp_digit_split(text: str) -> list[str]:
    """llama.cpp's SMOLLM pre-tokenizer: "\\p{N}" isolates each digit, then the GPT-2 regex per piece."""
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    # llama.cpp keeps the text between matches as pieces of its own.
    return [w for p in pieces for w in regex.split(f"({gpt2})", p) if w]


def test_digit_variant_splits_like_llama_cpp() -> None:
    pre_tokenizer = build_byte_level_bpe({}, [], GGUF_PRE_TOKENIZERS["smollm"]).pre_tokenizer
    byte_chars = bytes_to_unicode()
    for text in HARD_STRINGS + TRAIN_TEXT:
        expected = ["".join(byte_chars[b] for b in w.encode()) for w in _llama_cpp_digit_split(text)]
        words = [w for w, _ in pre_tokenizer.pre_tokenize_str(text)]
        assert words == expected, text
