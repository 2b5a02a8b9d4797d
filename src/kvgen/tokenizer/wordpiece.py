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


# Proper prefixes of the patterns: text ending in one may still change when the next token comes.
_CLEAN_UP_PREFIXES = tuple(sorted({old[:n] for old, _ in CLEAN_UP_REPLACEMENTS for n in range(1, len(old))}))


def may_change_on_clean_up(text: str) -> bool:
    """Whether ``clean_up_tokenization(text + more)`` could change the end of ``text``.

    True when ``text`` ends in the start of a replaced pattern (" '", " n'", ...): an
    incremental detokenizer holds such text back.
    """
    return text.endswith(_CLEAN_UP_PREFIXES)


def wordpiece_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` over BertTokenizer's defaults. Raises ``ModelFormatError`` for ``do_basic_tokenize: false``."""
    merged = {**BERT_DEFAULTS, **config}
    if not merged["do_basic_tokenize"]:
        raise ModelFormatError("tokenizer_config.json sets do_basic_tokenize=false; kvgen's WordPiece needs it true")
    return merged


def _vocab_id(vocab: dict[str, int], token: str, key: str, path: Path) -> int:
    if token not in vocab:
        raise ModelFormatError(f"{key}={token!r} is not in {path}")
    return vocab[token]


def wordpiece_backend(vocab_path: Path, config: dict[str, Any], tokens: dict[str, str]) -> BackendTokenizer:
    """The WordPiece backend of ``vocab_path`` (one token per line, id = line number).

    ``config``: the tokenizer config over ``BERT_DEFAULTS`` (see :func:`wordpiece_config`);
    ``tokens``: the ``unk_token``, ``cls_token`` and ``sep_token`` strings. Raises
    ``ModelFormatError`` if the file cannot be read or lacks the unk, cls or sep token.
    """
    try:
        vocab: dict[str, int] = models.WordPiece.read_file(str(vocab_path))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception for unreadable files
        raise ModelFormatError(f"cannot read {vocab_path}: {e}") from None
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
