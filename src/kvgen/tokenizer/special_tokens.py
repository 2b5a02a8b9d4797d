"""Token ids with a role (BOS, EOS, pad, unk), the post-processor that adds them, id range checks."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import dataclass

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from kvgen.config import check_token_id_range
from kvgen.errors import ModelFormatError


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of the tokens with a role; ``eos_token_ids[0]`` is the primary EOS."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    unk_token_id: int | None = None


def integer_ids(token_ids: Any) -> list[int]:
    """Token ids as Python ints: one int, a sequence of ints (numpy's too), or an integer tensor / array of any
    shape (what transformers' ``decode`` takes). Raises ``ValueError`` for anything else (a str read as digits,
    floats, bools)."""
    if isinstance(token_ids, numbers.Integral) and not isinstance(token_ids, bool):
        return [int(token_ids)]
    if hasattr(token_ids, "tolist") and hasattr(token_ids, "dtype"):
        if "int" not in str(token_ids.dtype):
            raise ValueError(f"token ids must be integers, got a tensor of {token_ids.dtype}")
        token_ids = token_ids.reshape(-1).tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
        raise ValueError(f"token ids must be a list of ints or an int tensor, got {type(token_ids).__name__}")
    if bad := [i for i in token_ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)]:
        raise ValueError(f"token ids must be ints, got {bad[0]!r}")
    return [int(i) for i in token_ids]


def check_token_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first id outside ``[0, vocab_size)``."""
    check_token_id_range("token id", token_ids, vocab_size, ValueError)


def add_bos_eos(backend: BackendTokenizer, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool) -> None:
    """Install a post-processor adding BOS and/or EOS when ``encode(add_special_tokens=True)``.

    Raises ``ModelFormatError`` when asked to add a token that has no id.
    """
    if add_bos and bos is None:
        raise ModelFormatError("tokenizer asks to add a BOS token but has no bos token id")
    if add_eos and eos is None:
        raise ModelFormatError("tokenizer asks to add an EOS token but has no eos token id")
    bos_ids = [bos] if bos is not None and add_bos else []
    eos_ids = [eos] if eos is not None and add_eos else []
    if not bos_ids and not eos_ids:
        return
    name = backend.id_to_token
    single = [name(i) for i in bos_ids] + ["$A"] + [name(i) for i in eos_ids]
    special = [(name(i), i) for i in dict.fromkeys(bos_ids + eos_ids)]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
