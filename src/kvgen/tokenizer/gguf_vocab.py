"""Rebuilding a ``tokenizers`` backend from GGUF metadata: llama.cpp's "gpt2" tokenizer model (byte-level BPE)
and its "llama" model (SentencePiece BPE: Llama 2, TinyLlama, Mistral v0.1-0.3).

Source: llama.cpp ``llama-vocab.cpp`` (token types, pre-tokenizer names), the models' own tokenizer.json
files for the split patterns, and transformers 4.55 ``GGUFLlamaConverter`` (SentencePiece merges from scores).
"""

from __future__ import annotations

import enum
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from kvgen.config import check_token_id_range
from kvgen.errors import ModelFormatError
from kvgen.tokenizer.byte_level import ByteLevelVariant, build_byte_level_bpe
from kvgen.tokenizer.special_tokens import SpecialTokenIds


class GGUFTokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# ``tokenizer.ggml.pre`` -> variant; names and groups as in llama.cpp's llama-vocab.cpp.
GGUF_PRE_TOKENIZERS: dict[str, ByteLevelVariant] = {
    "default": ByteLevelVariant.GPT2,
    "gpt2": ByteLevelVariant.GPT2,
    "gpt-2": ByteLevelVariant.GPT2,
    "smollm": ByteLevelVariant.DIGITS,
    "starcoder": ByteLevelVariant.DIGITS,
    "refact": ByteLevelVariant.DIGITS,
    "llama-bpe": ByteLevelVariant.LLAMA3,
    "llama3": ByteLevelVariant.LLAMA3,
    "llama-v3": ByteLevelVariant.LLAMA3,
    "smaug-bpe": ByteLevelVariant.LLAMA3,  # SmolLM3's; llama.cpp: "same as llama3"
    "dbrx": ByteLevelVariant.LLAMA3,
    "qwen2": ByteLevelVariant.QWEN2,
    "deepseek-r1-qwen": ByteLevelVariant.QWEN2,  # DeepSeek-R1-Distill-Qwen: Qwen2's tokenizer
    # llama.cpp's other names for the same split rules (its LLAMA3, GPT2 and digit-first groups)
    "falcon3": ByteLevelVariant.LLAMA3,
    "falcon-h1": ByteLevelVariant.LLAMA3,
    "pixtral": ByteLevelVariant.LLAMA3,
    "midm-2.0": ByteLevelVariant.LLAMA3,
    "lfm2": ByteLevelVariant.LLAMA3,
    "phi-2": ByteLevelVariant.GPT2,
    "mpt": ByteLevelVariant.GPT2,
    "olmo": ByteLevelVariant.GPT2,
    "jais": ByteLevelVariant.GPT2,
    "gigachat": ByteLevelVariant.GPT2,
    "exaone4": ByteLevelVariant.GPT2,
    "command-r": ByteLevelVariant.DIGITS,
    "codeshell": ByteLevelVariant.DIGITS,
    "exaone": ByteLevelVariant.DIGITS,
    "minerva-7b": ByteLevelVariant.DIGITS,
    "gpt-4o": ByteLevelVariant.GPT4O,  # gpt-oss, Phi-4 (LLAMA_VOCAB_PRE_TYPE_GPT4O, as "llama4", "kanana2", "talkie")
    "llama4": ByteLevelVariant.GPT4O,
    "kanana2": ByteLevelVariant.GPT4O,
    "talkie": ByteLevelVariant.GPT4O,
}


# Pre-tokenizers after which llama.cpp adds BOS when a file has no tokenizer.ggml.add_bos_token (its LLAMA3 group).
_BOS_BY_DEFAULT_PRE_TOKENIZERS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                            "midm-2.0", "lfm2"})


def gguf_adds_bos_by_default(meta: dict[str, Any]) -> bool:
    """Whether llama.cpp prepends BOS to a file without ``tokenizer.ggml.add_bos_token``: for SentencePiece ("llama")
    vocabularies (Llama 2, Mistral files converted before the key existed) and the Llama 3 pre-tokenizers.

    Source: llama.cpp ``llama-vocab.cpp`` (``llama_vocab::impl::load``: ``add_bos`` before the key is read).
    """
    model = meta.get("tokenizer.ggml.model")
    return model == "llama" or (model == "gpt2" and meta.get("tokenizer.ggml.pre") in _BOS_BY_DEFAULT_PRE_TOKENIZERS)


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"GGUF metadata has no {key}")
    return meta[key]


def _merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if (bad := next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)) is not None:
        raise ModelFormatError(f"tokenizer.ggml.merges[{bad}] must be two tokens and a space, got {merges[bad]!r}")
    return pairs  # type: ignore[return-value]  # every pair has two items (checked)


def _vocab(meta: dict[str, Any]) -> tuple[list[str], list[int]]:
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [GGUFTokenType.NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ModelFormatError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    if len(set(tokens)) != len(tokens):
        raise ModelFormatError(f"tokenizer.ggml.tokens has {len(tokens) - len(set(tokens))} duplicate tokens")
    return tokens, token_types


def gguf_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """The byte-level BPE (or SentencePiece BPE) of GGUF metadata, without BOS/EOS post-processing.

    CONTROL and UNKNOWN tokens become special added tokens; USER_DEFINED ones added tokens kept by decode
    (as llama.cpp). Raises ``ModelFormatError`` for a tokenizer model other than "gpt2" / "llama", an
    unknown ``tokenizer.ggml.pre``, or malformed tokens, types, merges or scores.
    """
    model = _require(meta, "tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece_backend(meta)
    if model != "gpt2":
        raise ModelFormatError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r}; kvgen reads "
                               "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ModelFormatError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {sorted(GGUF_PRE_TOKENIZERS)}"
        )
    tokens, token_types = _vocab(meta)
    merges = _merges(_require(meta, "tokenizer.ggml.merges"))
    backend = build_byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, GGUF_PRE_TOKENIZERS[pre])
    _add_typed_tokens(backend, tokens, token_types)
    return backend


def _add_typed_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """CONTROL and UNKNOWN tokens as special added tokens (matched in text, dropped by ``skip_special_tokens``:
    llama.cpp parses and hides both, transformers' "<unk>" is a special token); USER_DEFINED ones as added tokens
    kept by decode."""
    typed = list(zip(tokens, token_types, strict=True))
    special_types = (GGUFTokenType.CONTROL, GGUFTokenType.UNKNOWN)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k in special_types])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed
                        if k == GGUFTokenType.USER_DEFINED])


def gguf_raw_token_texts(meta: dict[str, Any], backend: BackendTokenizer) -> dict[int, str]:
    """Id -> text decode gives these ids instead of what the backend's decoder makes of them: "" for UNUSED tokens
    (the "[PAD151665]" rows a converter pads a vocabulary with; llama.cpp prints nothing for them), and, in a
    byte-level ("gpt2") vocabulary, the text of the added tokens (CONTROL, UNKNOWN, USER_DEFINED) that its byte-level
    decoder would garble: llama.cpp's converter stores them as plain text ("café", not "cafÃ©") and llama.cpp prints
    them as they are, while the decoder reads each of their characters as a byte ("é" as 0xE9). Usually empty.

    Source: llama.cpp ``llama_vocab::impl::token_to_piece`` (added-token text copied as is, nothing for other types),
    ``convert_hf_to_gguf.py`` (added tokens pre-normalized to text, UNUSED "[PAD{i}]" padding).
    """
    types = meta.get("tokenizer.ggml.token_type", [])
    unused = {i: "" for i, token_type in enumerate(types) if token_type == GGUFTokenType.UNUSED}
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return unused
    added = backend.get_added_tokens_decoder()
    return unused | {i: t.content for i, t in added.items()
                     if backend.decode([i], skip_special_tokens=False) != t.content}


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores: every split of a token into two tokens, the merges of a
    higher-scoring token first (transformers' ``GGUFTokenizerSkeleton`` order, ties kept in vocabulary order)."""
    score = dict(zip(tokens, scores, strict=True))
    merges: list[tuple[str, str, float]] = []
    for token, token_score in score.items():
        pairs = [(token[:i], token[i:], token_score) for i in range(1, len(token)) if token[:i] in score and token[i:] in score]
        merges += sorted(pairs, key=lambda p: (score[p[0]], score[p[1]]), reverse=True)
    merges.sort(key=lambda m: m[2], reverse=True)  # stable
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """SentencePiece BPE (llama.cpp's "llama" model): spaces as "▁" with one prepended (unless
    ``tokenizer.ggml.add_space_prefix`` is false), merges ranked by ``tokenizer.ggml.scores``, unknown bytes as
    ``<0xNN>`` tokens. Raises ``ModelFormatError`` for missing or mismatched scores."""
    tokens, token_types = _vocab(meta)
    scores = _require(meta, "tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise ModelFormatError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab, _sentencepiece_merges(tokens, [float(s) for s in scores]),
                                          unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip: list[decoders.Decoder] = [decoders.Strip(content=" ", left=1)] if prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    _add_typed_tokens(backend, tokens, token_types)
    return backend


def gguf_special_ids(meta: dict[str, Any], vocab_size: int) -> SpecialTokenIds:
    """BOS, EOS (+ end-of-turn, end-of-message), pad and unk ids of GGUF metadata.

    Raises ``ModelFormatError`` for an id outside ``[0, vocab_size)``.
    """
    keys = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id", "unknown_token_id")
    ids = {k: meta.get(f"tokenizer.ggml.{k}") for k in keys}
    for key, token_id in ids.items():
        check_token_id_range(f"tokenizer.ggml.{key}", [] if token_id is None else [token_id], vocab_size)
    eos = (ids["eos_token_id"], ids["eot_token_id"], ids["eom_token_id"])
    eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    return SpecialTokenIds(ids["bos_token_id"], eos_ids, ids["padding_token_id"], ids["unknown_token_id"])
