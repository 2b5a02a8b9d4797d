"""The one stopping module: EOS ids, stop token ids, ``min_tokens``, max new tokens, context
length, stop strings (with streaming hold-back), wall time, and one finish-reason vocabulary.

``generate()`` and every strategy use ``StopChecker`` (batched over rows: finish codes
``[N]``); the engine's scheduler uses ``TokenStops.check`` per request and its
detokenizer ``StopStrings`` on the decoded text. ``FinishReason`` is mapped at the
edges: ``GenerateOutput.finish_reasons`` shows ``.value`` ("stop", "stop_string",
"time", "length"), the engine and the server OpenAI's ``to_openai()`` ("stop",
"length", "abort").

Source: transformers 4.55 ``generation/stopping_criteria.py`` (EOS, max length, stop
strings anywhere in the generated text, max time); vLLM v1 ``Scheduler`` /
``check_stop`` and ``detokenizer.py`` (stop token ids, ``min_tokens``, stop strings,
hold-back); OpenAI ``finish_reason`` values.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvgen.fields import check_int


class FinishReason(enum.Enum):
    """Why a sequence ended; ``.value`` is what ``generate()`` reports."""

    STOP = "stop"  # an EOS id or a stop token id
    STOP_STRING = "stop_string"  # a stop string in the decoded text
    TIME = "time"  # generate(): max_time seconds passed
    LENGTH = "length"  # max new tokens, or the context length
    ABORT = "abort"  # engine: aborted by the caller, or it can never fit the KV cache

    def to_openai(self) -> str:
        """OpenAI ``finish_reason``: "stop", "length", or vLLM's "abort"."""
        return _OPENAI[self]


_OPENAI = {
    FinishReason.STOP: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.TIME: "length",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}
# When several stops fire on the same token, the earlier wins. Finish code i + 1 stands for PRIORITY[i].
PRIORITY: tuple[FinishReason, ...] = (FinishReason.STOP, FinishReason.STOP_STRING, FinishReason.TIME, FinishReason.LENGTH)


def reason_of(code: int) -> FinishReason | None:
    """The reason a finish code stands for (0 = still running)."""
    return PRIORITY[code - 1] if code > 0 else None


def code_of(reason: FinishReason) -> int:
    return PRIORITY.index(reason) + 1


@dataclass(frozen=True)
class TokenStops:
    """Stops decided by token ids and counts alone (no text). Counts are in tokens.

    EOS and stop token ids stop only once ``min_new_tokens`` tokens exist (vLLM
    ``min_tokens``); ``generate()`` passes 0, since its processor already keeps EOS
    out before then, as HF's ``EosTokenCriteria`` has no minimum.
    """

    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    max_new_tokens: int | None = None
    max_total_tokens: int | None = None  # the engine's max_model_len (prompt + output)

    def check(self, token_id: int, num_new: int, num_total: int) -> tuple[FinishReason, int | None] | None:
        """After appending ``token_id`` (the ``num_new``-th new token, ``num_total`` in all):
        (reason, the stop token id when one matched, else None), or None to go on."""
        if num_new >= self.min_new_tokens:
            if token_id in self.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in self.stop_token_ids:
                return FinishReason.STOP, token_id
        if self.max_new_tokens is not None and num_new >= self.max_new_tokens:
            return FinishReason.LENGTH, None
        if self.max_total_tokens is not None and num_total >= self.max_total_tokens:
            return FinishReason.LENGTH, None
        return None


def find_stop_string(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in ``text`` as ``(position, stop_string)``.

    Among matches at the same position the shortest wins (it completes first when
    streaming). Returns None when nothing matches. Raises ValueError for an empty string.
    """
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            raise ValueError("stop strings must be non-empty, got ''")
        pos = text.find(s)
        if pos >= 0 and (best is None or (pos, len(s)) < (best[0], len(best[1]))):
            best = (pos, s)
    return best


def partial_stop_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    A stream holds back that many trailing characters, since they may still become a
    stop string. Returns 0 when no suffix can.
    """
    longest = 0
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:size]):
                longest = size
                break
    return longest


@dataclass(frozen=True)
class StopStrings:
    """Stop strings matched on decoded text wherever token boundaries fall.

    Raises ValueError for an empty list or an empty string.
    """

    stops: tuple[str, ...]
    include_in_output: bool = False

    def __post_init__(self) -> None:
        if not self.stops or any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"stop_strings must be a non-empty list of non-empty strings, got {list(self.stops)!r}")

    @property
    def max_length(self) -> int:
        """Characters of the longest stop string."""
        return max(map(len, self.stops))

    def match_new(self, text: str, old_len: int) -> tuple[int, str] | None:
        """A match that ends past ``old_len`` (the text before was searched already, or, within vLLM's
        ``min_tokens``, must not be): (where the text is cut: before the stop string, or after it when included,
        the stop string). As ``find_stop_string``, the earliest wins. Source: vLLM ``check_stop_strings``."""
        matches = [(position, len(s), s) for s in self.stops
                   if (position := text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if not matches:
            return None
        position, _, stop = min(matches)
        return position + (len(stop) if self.include_in_output else 0), stop

    def num_streamable(self, text: str) -> int:
        """Characters of a running stream's ``text`` safe to show (the rest may grow into a stop string)."""
        return len(text) - partial_stop_suffix_len(text, self.stops)

    def rows_hit(self, generated: list[list[int]], decode: Callable[[list[int]], str]) -> list[bool]:
        """Per row of ids: does a stop string end in the text of its last token? As HF
        ``StopStringCriteria``, a match must overlap the final token, so a row that runs on past a match (group
        and constrained beam search stop only when every beam matches at once) is not stopped by it later."""
        hits = []
        for ids in generated:
            text = decode(ids)
            before = len(decode(ids[:-1])) if len(ids) > 1 else 0  # text of the earlier tokens, in characters
            hits.append(any(s in text[max(0, before - len(s) + 1):] for s in self.stops))
        return hits


@dataclass
class StopChecker:
    """``generate()``'s stops for every row at once; ``check`` gives finish codes (see ``PRIORITY``).

    ``decode`` is needed with ``stop_strings``; ``max_time`` is in seconds from
    ``start_time`` (default: now) on ``clock`` (default ``time.monotonic``).
    """

    tokens: TokenStops
    prompt_length: int
    stop_strings: StopStrings | None = None
    decode: Callable[[list[int]], str] | None = None
    max_time: float | None = None
    clock: Callable[[], float] = time.monotonic
    start_time: float | None = None

    def __post_init__(self) -> None:
        check_int("prompt_length", self.prompt_length, 0)
        if self.stop_strings is not None and self.decode is None:
            raise ValueError("stop_strings need a decode function (pass generate(..., tokenizer=tok))")
        if self.start_time is None:
            self.start_time = self.clock()

    def check(self, sequences: torch.Tensor) -> torch.Tensor:
        """sequences: [N, S] long, prompt then new tokens. Returns [N] long codes, 0 = go on.

        Priority: EOS / stop token ids, stop strings, time, length (``PRIORITY``).
        """
        return torch.tensor(self.check_rows(sequences), dtype=torch.long)  # [N]

    def check_rows(self, sequences: torch.Tensor) -> list[int]:
        """``check`` as a list of N codes. The rows are judged in Python on the last column (and, with stop strings,
        the prompt's tail and the new ids): a decode step then reads one tensor instead of running a dozen small
        ops, each slow just after the forward has streamed the weights through the caches."""
        num_new = sequences.shape[1] - self.prompt_length
        stop_ids = self.tokens.eos_token_ids + self.tokens.stop_token_ids
        codes = [0] * sequences.shape[0]
        if stop_ids and num_new >= max(self.tokens.min_new_tokens, 1):
            codes = [code_of(FinishReason.STOP) if token in stop_ids else 0 for token in sequences[:, -1].tolist()]
        if self.stop_strings is not None and self.decode is not None and num_new > 0:
            # HF StopStringCriteria reads the prompt too: a stop string may begin there and end in a new token
            start = max(0, self.prompt_length - self.stop_strings.max_length)
            rows = sequences[:, start:].tolist()  # N lists: the prompt's last tokens, then the new ids
            hits = self.stop_strings.rows_hit(rows, self.decode)
            codes = [code or (code_of(FinishReason.STOP_STRING) if hit else 0) for code, hit in zip(codes, hits)]
        if self.max_time is not None and self.clock() - (self.start_time or 0.0) > self.max_time:
            codes = [code or code_of(FinishReason.TIME) for code in codes]
        limit = self.tokens.max_new_tokens
        if limit is not None and num_new >= limit:
            codes = [code or code_of(FinishReason.LENGTH) for code in codes]
        return codes
