"""Byte-level BPE backends (GPT-2, SmolLM, Llama 3, Qwen2, GPT-4o pre-tokenizers) built with ``tokenizers``."""

from __future__ import annotations

import enum
from collections.abc import Callable

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer


class ByteLevelVariant(enum.Enum):
    """How a byte-level BPE normalizes and splits text before merging."""

    GPT2 = "gpt2"  # GPT-2 regex
    DIGITS = "digits"  # every digit alone, then the GPT-2 regex (SmolLM, StarCoder)
    LLAMA3 = "llama3"  # Llama 3 regex; a word that is in the vocabulary skips merging
    QWEN2 = "qwen2"  # NFC, then the Qwen2 regex
    GPT4O = "gpt4o"  # the o200k regex (GPT-4o, gpt-oss, Phi-4, Llama 4)


# Split patterns of the models' own tokenizer.json files (Meta Llama 3, Qwen2, gpt-oss).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k_base: CamelCase splits before an upper-case letter that follows lower-case ones, contractions stay
# on their word, digits go in threes, a punctuation run keeps its trailing newlines and slashes. llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_GPT4O quotes it as its "original regex" (its engine runs an ASCII-only rewrite of the case
# classes); the Split pattern of gpt-oss's tokenizer.json.
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_PRE_TOKENIZERS: dict[ByteLevelVariant, Callable[[], pre_tokenizers.PreTokenizer]] = {
    ByteLevelVariant.GPT2: _gpt2_byte_level,
    ByteLevelVariant.DIGITS: lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_byte_level()]
    ),
    ByteLevelVariant.LLAMA3: lambda: _split_then_byte_level(LLAMA3_PATTERN),
    ByteLevelVariant.QWEN2: lambda: _split_then_byte_level(QWEN2_PATTERN),
    ByteLevelVariant.GPT4O: lambda: _split_then_byte_level(GPT4O_PATTERN),
}


def build_byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], variant: ByteLevelVariant
) -> BackendTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` (no prefix space, no post-processor).

    Source: the tokenizer.json files of GPT-2, SmolLM2, Llama 3, Qwen2 and gpt-oss, as transformers'
    GPT2Converter, TikTokenConverter (``ignore_merges``) and Qwen2Converter (NFC) build them. GPT-4o merges as
    llama.cpp does for ``tokenizer.ggml.pre = "gpt-4o"`` (no ``ignore_merges``, unlike its Llama 3 rules).
    """
    model = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=variant is ByteLevelVariant.LLAMA3)
    backend = BackendTokenizer(model)
    if variant is ByteLevelVariant.QWEN2:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _PRE_TOKENIZERS[variant]()
    backend.decoder = decoders.ByteLevel()
    return backend
