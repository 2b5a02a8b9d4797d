"""WordPiece tokenizers from a BERT-style ``vocab.txt`` (GPT-2 checkpoints paired with ``BertTokenizer``).

Chinese GPT-2 checkpoints (``GPT2LMHeadModel`` + ``BertTokenizer``, e.g.
uer/gpt2-chinese-cluecorpussmall) ship ``vocab.txt`` and a ``tokenizer_config.json`` naming
``BertTokenizer``, with no ``tokenizer.json``. The backend is built with ``tokenizers`` the way
transformers' ``BertTokenizerFast`` is: ``BertNormalizer`` (clean text, Chinese-character
splitting, lower-casing, accent stripping), ``BertPreTokenizer``, ``WordPiece``,
``[CLS] ... [SEP]`` around a sequence encoded with special tokens, and a ``##``-merging decoder.
Like ``BertTokenizerFast``, it ignores ``never_split`` (special tokens are never split anyway).
Source: transformers 4.55 ``BertTokenizer`` (defaults, decode) and ``BertTokenizerFast``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from kvgen.errors import ModelFormatError

VOCAB_FILE = "vocab.txt"
WORDPIECE_TOKENIZER_CLASSES = ("BertTokenizer", "BertTokenizerFast")

# BertTokenizer's constructor defaults; tokenizer_config.json / special_tokens_map.json override them.
BERT_DEFAULTS: dict[str, Any] = {
    "do_lower_case": True,
    "do_basic_tokenize": True,
    "tokenize_chinese_chars": True,
    "strip_accents": None,
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
    "clean_up_tokenization_spaces": True,
}

# transformers' ``clean_up_tokenization``, applied in this order to the whole decoded string.
CLEAN_UP_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    """Remove the spaces a space-joining decoder leaves before punctuation and English contractions.

    Source: transformers ``PreTrainedTokenizerBase.clean_up_tokenization`` (same replacements, same order).
    """
    for old, new in CLEAN_UP_REPLACEMENTS:
        text = text.replace(old, new)
    return text


class _StreamingReplace:
    """``str.replace(old, new)`` over text that arrives in pieces; holds back a possible match start."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new, self.held = old, new, ""

    def feed(self, text: str) -> str:
        buf, out, start = self.held + text, [], 0
        while (found := buf.find(self.old, start)) >= 0:  # leftmost, non-overlapping, as str.replace
            out += [buf[start:found], self.new]
            start = found + len(self.old)
        rest = buf[start:]
        keep = next((k for k in range(min(len(rest), len(self.old) - 1), 0, -1) if rest.endswith(self.old[:k])), 0)
        self.held = rest[len(rest) - keep :]
        out.append(rest[: len(rest) - keep])
        return "".join(out)

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class StreamingCleanUp:
    """:func:`clean_up_tokenization` of a text that arrives in pieces.

    ``"".join(feed(p) for p in pieces) + flush()`` equals ``clean_up_tokenization("".join(pieces))``
    for any split: each replacement runs as a stage that holds back the end of its input
    while it may still start a match.
    """

    def __init__(self) -> None:
        self._stages = [_StreamingReplace(old, new) for old, new in CLEAN_UP_REPLACEMENTS]

    def feed(self, text: str) -> str:
        """Clean ``text`` (the next piece); returns the cleaned text that can no longer change."""
        for stage in self._stages:
            text = stage.feed(text)
        return text

    def flush(self) -> str:
        """Everything held back, cleaned as the end of the text."""
        text = ""
        for stage in self._stages:
            text = stage.feed(text) + stage.flush()
        return text


def wordpiece_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` over BertTokenizer's defaults. Raises ``ModelFormatError`` for ``do_basic_tokenize: false`` and for a
    ``strip_accents`` other than true, false or null (the normalizer takes no other value)."""
    merged = {**BERT_DEFAULTS, **config}
    if not merged["do_basic_tokenize"]:
        raise ModelFormatError("tokenizer_config.json sets do_basic_tokenize=false; kvgen's WordPiece needs it true")
    if merged["strip_accents"] is not None and not isinstance(merged["strip_accents"], bool):
        raise ModelFormatError(f"tokenizer_config.json strip_accents must be true, false or null, "
                               f"got {merged['strip_accents']!r}")
    return merged


def _vocab_id(vocab: dict[str, int], token: str, key: str, path: Path) -> int:
    if token not in vocab:
        raise ModelFormatError(f"{key}={token!r} is not in {path}")
    return vocab[token]


def read_vocab(vocab_path: Path) -> dict[str, int]:
    """``vocab.txt`` as transformers' ``load_vocab``: token -> id (line number), only the line break taken off a line,
    so a token keeps its trailing spaces (``tokenizers``' ``WordPiece.read_file`` trims them, and "hello " took the id
    of "hello"); a repeated token gets its later line's id. Raises ``ModelFormatError`` if the file cannot be read."""
    try:
        with open(vocab_path, encoding="utf-8") as reader:
            lines = reader.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"cannot read {vocab_path}: {e}") from None
    return {line.rstrip("\n"): index for index, line in enumerate(lines)}


def wordpiece_backend(vocab_path: Path, config: dict[str, Any], tokens: dict[str, str]) -> BackendTokenizer:
    """The WordPiece backend of ``vocab_path`` (one token per line, id = line number).

    ``config``: the tokenizer config over ``BERT_DEFAULTS`` (see :func:`wordpiece_config`);
    ``tokens``: the ``unk_token``, ``cls_token`` and ``sep_token`` strings. Raises
    ``ModelFormatError`` if the file cannot be read or lacks the unk, cls or sep token.
    """
    vocab = read_vocab(vocab_path)
    unk, cls, sep = tokens["unk_token"], tokens["cls_token"], tokens["sep_token"]
    _vocab_id(vocab, unk, "unk_token", vocab_path)
    backend = BackendTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(config["tokenize_chinese_chars"]),
        strip_accents=config["strip_accents"],
        lowercase=bool(config["do_lower_case"]),
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = _vocab_id(vocab, cls, "cls_token", vocab_path), _vocab_id(vocab, sep, "sep_token", vocab_path)
    backend.post_processor = processors.BertProcessing(sep=(sep, sep_id), cls=(cls, cls_id))
    # The clean-up runs on the whole string (Tokenizer.decode), as transformers does; the
    # decoder's own clean-up works token by token and misses " ' " between two tokens.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return backend
