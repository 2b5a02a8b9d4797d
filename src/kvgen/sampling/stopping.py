"""Stopping criteria: max new tokens, EOS ids, stop strings, wall time.

Each criterion is a callable ``(token_ids [B, T] long, logits [B, V] | None) -> is_done
[B] bool`` with a ``finish_reason``; ``StoppingCriteriaList`` ORs them and names the
reason per row. ``find_stop_string`` and ``partial_stop_suffix_len`` are the pure
string helpers an engine's detokenizer uses for stop strings and streaming hold-back.

Source: ``transformers`` 4.55 ``generation/stopping_criteria.py`` (roles and names);
OpenAI ``finish_reason`` values.
"""

import time
from collections.abc import Callable, Sequence

import torch

FINISH_STOP = "stop"  # an EOS id
FINISH_STOP_STRING = "stop_string"
FINISH_LENGTH = "length"
FINISH_TIME = "time"
# When several criteria fire on the same step, the earlier reason wins.
FINISH_REASON_PRIORITY: tuple[str, ...] = (FINISH_STOP, FINISH_STOP_STRING, FINISH_LENGTH, FINISH_TIME)


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class StoppingCriteria:
    """Base class: ``(token_ids [B, T], logits [B, V] | None) -> [B] bool``."""

    finish_reason: str = FINISH_STOP

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class MaxNewTokensCriteria(StoppingCriteria):
    """Done once ``T - prompt_length >= max_new_tokens``. Raises ValueError for bad counts."""

    finish_reason = FINISH_LENGTH

    def __init__(self, max_new_tokens: int, prompt_length: int):
        _check_count("max_new_tokens", max_new_tokens, 1)
        _check_count("prompt_length", prompt_length, 0)
        self.max_new_tokens = max_new_tokens
        self.prompt_length = prompt_length

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        is_done = token_ids.shape[1] - self.prompt_length >= self.max_new_tokens
        return torch.full((token_ids.shape[0],), is_done, dtype=torch.bool, device=token_ids.device)  # [B]


class EosTokenCriteria(StoppingCriteria):
    """Done when a row's last id is any of the EOS ids. Raises ValueError for an empty list."""

    finish_reason = FINISH_STOP

    def __init__(self, eos_token_id: int | Sequence[int]):
        ids = [eos_token_id] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]
        if not ids:
            raise ValueError(f"eos_token_id must name at least one id, got {eos_token_id!r}")
        self.eos_token_ids = ids

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        eos = torch.tensor(self.eos_token_ids, dtype=token_ids.dtype, device=token_ids.device)
        return torch.isin(token_ids[:, -1], eos)  # [B]


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

    An engine holds back that many trailing characters while streaming, since they may
    still become a stop string. Returns 0 when no suffix can.
    """
    longest = 0
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:size]):
                longest = size
                break
    return longest


class StopStringCriteria(StoppingCriteria):
    """Done when a row's generated text contains a stop string, wherever token boundaries fall.

    ``decode`` maps the ids after ``prompt_length`` to text; after each call ``matches[i]``
    holds row i's ``(position, stop_string)`` in that text, or None. Unlike HF, a match
    anywhere in the generated text counts, so several tokens may be appended per call.
    Raises ValueError for an empty or blank stop list.
    """

    finish_reason = FINISH_STOP_STRING

    def __init__(self, stop_strings: str | Sequence[str], decode: Callable[[list[int]], str], prompt_length: int):
        stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop_strings must be a non-empty list of non-empty strings, got {stop_strings!r}")
        _check_count("prompt_length", prompt_length, 0)
        self.stop_strings = stops
        self.decode = decode
        self.prompt_length = prompt_length
        self.matches: list[tuple[int, str] | None] = []

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        generated = token_ids[:, self.prompt_length :].tolist()  # B lists of T - prompt_length ids
        self.matches = [find_stop_string(self.decode(ids), self.stop_strings) for ids in generated]
        return torch.tensor([m is not None for m in self.matches], dtype=torch.bool, device=token_ids.device)


class MaxTimeCriteria(StoppingCriteria):
    """Done for every row once more than ``max_time`` seconds passed since ``start_time``.

    ``clock`` defaults to ``time.monotonic`` (and so does ``start_time``: now).
    Raises ValueError for max_time <= 0.
    """

    finish_reason = FINISH_TIME

    def __init__(
        self, max_time: float, start_time: float | None = None, clock: Callable[[], float] = time.monotonic
    ):
        if isinstance(max_time, bool) or not isinstance(max_time, (int, float)) or not max_time > 0:
            raise ValueError(f"max_time must be > 0 seconds, got {max_time!r}")
        self.max_time = float(max_time)
        self.clock = clock
        self.start_time = clock() if start_time is None else start_time

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        is_done = self.clock() - self.start_time > self.max_time
        return torch.full((token_ids.shape[0],), is_done, dtype=torch.bool, device=token_ids.device)  # [B]


def pick_finish_reasons(flags: dict[str, torch.Tensor]) -> list[str | None]:
    """Per row, the highest-priority reason whose ``[B] bool`` flag is set, else None."""
    if not flags:
        return []
    rows = {reason: flag.tolist() for reason, flag in flags.items()}
    num_rows = len(next(iter(rows.values())))
    ordered = [r for r in FINISH_REASON_PRIORITY if r in rows] + [r for r in rows if r not in FINISH_REASON_PRIORITY]
    return [next((r for r in ordered if rows[r][i]), None) for i in range(num_rows)]


class StoppingCriteriaList(list[StoppingCriteria]):
    """Criteria OR-ed together; an empty list never stops."""

    def check(
        self, token_ids: torch.Tensor, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[str | None]]:
        """Evaluate each criterion once. Returns (is_done [B] bool, finish reason per row or None)."""
        is_done = torch.zeros(token_ids.shape[0], dtype=torch.bool, device=token_ids.device)  # [B]
        flags: dict[str, torch.Tensor] = {}
        for criteria in self:
            hit = criteria(token_ids, logits)  # [B]
            is_done = is_done | hit
            reason = criteria.finish_reason
            flags[reason] = flags[reason] | hit if reason in flags else hit
        reasons = pick_finish_reasons(flags) if flags else [None] * token_ids.shape[0]
        return is_done, reasons

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        return self.check(token_ids, logits)[0]
