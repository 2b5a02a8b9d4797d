"""``SamplingParams``: how the engine decodes one request (vLLM / OpenAI names), validated once.

Source: vLLM ``SamplingParams`` (field names, defaults, ``stop`` normalization);
value ranges come from ``kvgen.sampling.ops.PARAM_RULES`` so the engine and
``generate()`` accept the same values.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from kvgen.fields import config_field
from kvgen.sampling.ops import validate_param

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them would overflow.
SAMPLING_EPS = 1e-5
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM ``RequestOutputKind``)."""

    CUMULATIVE = "cumulative"  # all text / tokens so far, every step
    DELTA = "delta"  # only what is new since the previous output (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


_f = config_field


@dataclass
class SamplingParams:
    """Per-request decoding settings. Counts are in tokens.

    After construction ``stop`` is a ``list[str]``, ``stop_token_ids`` a ``list[int]`` and
    ``top_k`` is 0 when disabled (-1 is accepted as vLLM's spelling of "off").
    Raises ``ValueError`` naming the field and the value: ``top_p must be in (0, 1], got 1.5``.
    """

    n: int = _f(1, "completions returned for the prompt")
    best_of: int | None = _f(None, "completions generated (>= n); the n most likely are returned")
    temperature: float = _f(1.0, "softmax temperature; 0 = greedy")
    top_p: float = _f(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    top_k: int = _f(0, "keep the k most likely tokens; 0 or -1 = off")
    min_p: float = _f(0.0, "drop tokens below min_p * the top probability; 0 = off")
    repetition_penalty: float = _f(1.0, "divide logits of seen tokens (prompt and output); 1 = off")
    presence_penalty: float = _f(0.0, "subtract from logits of generated tokens, in [-2, 2]")
    frequency_penalty: float = _f(0.0, "subtract count * this from logits of generated tokens, in [-2, 2]")
    seed: int | None = _f(None, "seed of this request's own torch.Generator")
    stop: str | list[str] | None = _f(None, "strings that end generation (not included in the text)")
    stop_token_ids: list[int] | None = _f(None, "token ids that end generation")
    include_stop_str_in_output: bool = _f(False, "keep the matched stop string / stop token in the text")
    ignore_eos: bool = _f(False, "keep generating after EOS")
    max_tokens: int | None = _f(16, "maximum new tokens; None = up to the model's context length")
    min_tokens: int = _f(0, "EOS and stop_token_ids are suppressed until this many new tokens exist")
    logprobs: int | None = _f(None, "return the sampled token's logprob and this many top alternatives")
    logit_bias: dict[int, float] | None = _f(None, "token id -> bias in [-100, 100] added to its logit (OpenAI logit_bias)")
    skip_special_tokens: bool = _f(True, "leave special tokens out of the text")
    output_kind: RequestOutputKind = _f(RequestOutputKind.CUMULATIVE, "cumulative, delta or final-only outputs")

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_floats()
        if self.top_k == -1:
            self.top_k = 0
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def _check_counts(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        validate_param("min_tokens", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.seed is not None:
            _check_int("seed", self.seed, _SEED_RANGE[0])
            if self.seed >= _SEED_RANGE[1]:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k < -1:
            raise ValueError(f"top_k must be >= 0, or -1 (off), got {self.top_k}")
        _check_int("top_k", self.top_k, -1)

    def _check_floats(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        names = ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in names:
            value = getattr(self, name)
            if isinstance(value, float) and math.isinf(value):
                raise ValueError(f"{name} must be finite, got {value}")
            validate_param(name, value)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature below ``SAMPLING_EPS`` (top_k/top_p/min_p then have no effect)."""
        return self.temperature < SAMPLING_EPS


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _stop_list(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def _token_id_list(ids: Any) -> list[int]:
    ids = [] if ids is None else ids
    if not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    return list(ids)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """``{token id >= 0: finite bias in [-100, 100]}`` (OpenAI's range), or None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    for token_id, value in bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token_id}")
    return {token_id: float(value) for token_id, value in bias.items()} or None
