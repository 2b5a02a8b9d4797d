"""``SamplingParams``: how the engine decodes one request (vLLM / OpenAI names), validated once.

Source: vLLM ``SamplingParams`` (field names, defaults, ``stop`` normalization);
value ranges come from ``kvgen.sampling.params.PARAM_RULES`` (the table shared
with ``GenerationConfig`` and the CLI, defaults side by side there) so the engine
and ``generate()`` accept the same values.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import math
from dataclasses import dataclass
from typing import Any

from kvgen.config import checked_token_ids
from kvgen.engine.structured_outputs import StructuredOutputsParams
from kvgen.fields import as_bool, config_field
from kvgen.sampling.params import INT32_MAX, PARAM_RULES, SAMPLING_EPS, check_param

__all__ = ["SAMPLING_EPS", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

logger = logging.getLogger(__name__)
# The lowest temperature a request samples at: a positive one below it is raised to it (vLLM's _MAX_TEMP).
MIN_SAMPLING_TEMPERATURE = 1e-2


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM ``RequestOutputKind``)."""

    CUMULATIVE = "cumulative"  # all text / tokens so far, every step
    DELTA = "delta"  # only what is new since the previous output (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


_f = config_field
_ALL_OF_VOCAB = ("logprobs", "prompt_logprobs")  # -1: every token's logprob (the engine needs max_logprobs=-1)


@dataclass
class SamplingParams:
    """Per-request decoding settings. Counts are in tokens.

    After construction ``stop`` is a ``list[str]``; ``stop_token_ids`` a ``list[int]`` and ``bad_words`` a
    ``list[str]``, both without repeats (the first kept, as vLLM's ``list(dict.fromkeys(...))``);
    ``top_k`` is 0 when disabled (-1 is accepted as vLLM's spelling of "off"), ``seed`` -1 is None and ``logprobs`` /
    ``prompt_logprobs`` True is 1 (False 0), and a greedy request (temperature 0) has ``top_p`` 1, ``top_k`` 0 and
    ``min_p`` 0, as vLLM.
    Raises ``ValueError`` naming the field and the value: ``top_p must be in (0, 1], got 1.5``.
    """

    n: int = _f(1, "completions returned for the prompt")
    best_of: int | None = _f(None, "completions generated (>= n); the n most likely are returned")
    temperature: float = _f(1.0, "softmax temperature; 0 = greedy; one in (0, 0.01) is raised to 0.01 (as vLLM)")
    top_p: float = _f(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    top_k: int = _f(0, "keep the k most likely tokens; 0 or -1 = off")
    min_p: float = _f(0.0, "drop tokens below min_p * the top probability; 0 = off")
    repetition_penalty: float = _f(1.0, "divide logits of seen tokens (prompt and output); 1 = off")
    presence_penalty: float = _f(0.0, "subtract from logits of generated tokens, in [-2, 2]")
    frequency_penalty: float = _f(0.0, "subtract count * this from logits of generated tokens, in [-2, 2]")
    seed: int | None = _f(None, "seed of this request's own torch.Generator; -1 = none (vLLM's spelling)")
    stop: str | list[str] | None = _f(None, "strings that end generation (not included in the text)")
    stop_token_ids: list[int] | None = _f(None, "token ids that end generation")
    include_stop_str_in_output: bool = _f(False, "keep the matched stop string / stop token in the text")
    ignore_eos: bool = _f(False, "keep generating after EOS")
    max_tokens: int | None = _f(16, "maximum new tokens; None = up to the model's context length")
    min_tokens: int = _f(0, "EOS (even with ignore_eos) and stop_token_ids are suppressed until this many new "
                            "tokens exist, and stop strings are not searched in their text (as vLLM)")
    logprobs: int | None = _f(None, "return the sampled token's logprob and this many top alternatives; -1: all "
                                    "(needs the engine's max_logprobs=-1, as vLLM)")
    prompt_logprobs: int | None = _f(None, "return each prompt token's logprob (the first has none) and this many top "
                                           "alternatives (-1: all); the request then skips the prefix cache")
    truncate_prompt_tokens: int | None = _f(None, "keep only the prompt's last k tokens (left truncation); -1: the "
                                                  "model's context length")
    logit_bias: dict[int, float] | None = _f(None, "token id -> bias in [-100, 100] added to its logit (OpenAI logit_bias)")
    allowed_token_ids: list[int] | None = _f(None, "only these token ids may be generated")
    bad_words: list[str] | None = _f(None, "words that may not be generated (each as tokenized with and without a "
                                           "leading space; the last token of a word is banned after the others)")
    # bad_words as token id sequences: filled by the engine from its tokenizer (vLLM's _bad_words_token_ids)
    bad_words_token_ids: list[list[int]] | None = _f(None, "bad_words tokenized (set by the engine)", cli=False)
    skip_special_tokens: bool = _f(True, "leave special tokens out of the text")
    spaces_between_special_tokens: bool = _f(True, "accepted as vLLM's; no effect: the text is decoded as a fast "
                                                   "(Rust) tokenizer decodes, where vLLM ignores it too")
    detokenize: bool = _f(True, "decode the output into text (False: token ids only, empty text, no stop strings)")
    output_kind: RequestOutputKind = _f(RequestOutputKind.CUMULATIVE, "cumulative, delta or final-only outputs")
    structured_outputs: StructuredOutputsParams | None = _f(
        None, "constrain the output to a JSON schema, a regex, a choice or a grammar (finishes with 'stop' once complete)")
    extra_args: dict[str, Any] | None = _f(None, "anything else, for code that reads it (vLLM's: plugins, custom "
                                                 "samplers); kvgen's sampling does not", cli=False)

    def __post_init__(self) -> None:
        if type(self.top_k) is int and self.top_k == -1:
            self.top_k = 0  # vLLM's spelling of "off"
        if type(self.seed) is int and self.seed == -1:
            self.seed = None  # vLLM's spelling of "no seed": a fresh random one, not the fixed seed -1
        for name in _ALL_OF_VOCAB:  # vLLM: logprobs=True is 1 (False stays False there, which counts as 0)
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        for f in dataclasses.fields(self):  # ranges: the table shared with GenerationConfig and the CLI
            value = getattr(self, f.name)
            if f.name in _ALL_OF_VOCAB and type(value) is int and value == -1:  # vLLM: the whole vocabulary
                continue
            if f.name in PARAM_RULES and (value is not None or "None" not in str(f.type)):  # None where typed so
                check_param(f.name, value)
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE:  # vLLM: logits / T would overflow
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors; "
                           "raised to %s (as vLLM)", self.temperature, MIN_SAMPLING_TEMPERATURE,
                           MIN_SAMPLING_TEMPERATURE)
            self.temperature = MIN_SAMPLING_TEMPERATURE
        if self.temperature < SAMPLING_EPS:  # greedy: the filters are off, as vLLM sets them (after their checks)
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = list(dict.fromkeys(_token_id_list(self.stop_token_ids)))  # vLLM drops repeats
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words_token_ids is not None:
            ids = self.bad_words_token_ids
            if not isinstance(ids, (list, tuple)) or not all(isinstance(w, (list, tuple)) and w for w in ids):
                raise ValueError(f"bad_words_token_ids must be a list of non-empty token id lists, got {ids!r}")
            self.bad_words_token_ids = [checked_token_ids("bad_words_token_ids", list(w)) for w in ids]
        words = [] if self.bad_words is None else [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        self.bad_words = list(dict.fromkeys(words))  # as vLLM: None is [], repeats dropped
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            setattr(self, name, as_bool(name, getattr(self, name)))
        if not self.detokenize and self.stop:
            raise ValueError(f"detokenize=False conflicts with stop={self.stop!r}: stop strings are matched on text")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {self.extra_args!r}")

    @staticmethod
    def from_optional(n: int | None = 1, presence_penalty: float | None = 0.0, frequency_penalty: float | None = 0.0,
                      repetition_penalty: float | None = 1.0, temperature: float | None = 1.0,
                      top_p: float | None = 1.0, logit_bias: dict[int, float] | dict[str, float] | None = None,
                      **kwargs: Any) -> SamplingParams:
        """vLLM's ``SamplingParams.from_optional``: None for n, the penalties, temperature or top_p means the default;
        ``logit_bias`` keys may be decimal strings (``int(key)``) and its values are clamped to [-100, 100]. Other
        keyword arguments are fields. Raises ``ValueError`` naming ``logit_bias`` for a key that is no integer, or as
        the constructor."""
        bias = None if logit_bias is None else _int_keyed_clamped_bias(logit_bias)
        return SamplingParams(
            n=1 if n is None else n, presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            temperature=1.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p,
            logit_bias=bias, **kwargs)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``SamplingParams.clone``): lists and dicts of the copy are its own."""
        return copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature below ``SAMPLING_EPS``, i.e. 0 once validated (top_k/top_p/min_p then have
        no effect)."""
        return self.temperature < SAMPLING_EPS


def _stop_list(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def _token_id_list(ids: Any, name: str = "stop_token_ids") -> list[int]:
    return checked_token_ids(name, [] if ids is None else ids)


def _int_keyed_clamped_bias(bias: Any) -> Any:
    """``from_optional``'s logit_bias: keys through ``int()``, numbers clamped to [-100, 100] (vLLM's); anything else
    is left for ``_logit_bias`` to refuse."""
    if not isinstance(bias, dict):
        return bias
    bad_keys = []
    for key in bias:
        try:
            int(key)
        except (TypeError, ValueError):
            bad_keys.append(key)
    if bad_keys:
        raise ValueError(f"logit_bias contains key(s) that cannot be converted to integer token ids: {bad_keys!r}")
    return {int(k): min(100.0, max(-100.0, v)) if isinstance(v, (int, float)) and not isinstance(v, bool)
            and not (isinstance(v, float) and math.isnan(v)) else v  # NaN is left to be refused (max() made it -100)
            for k, v in bias.items()}


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


def check_truncate_prompt_tokens(k: int | None) -> None:
    """``ValueError`` unless ``truncate_prompt_tokens`` is None, -1 or an int in [1, 2**31 - 1] (as vLLM's ``ge=-1``
    field, 0 refused)."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 1 <= k <= INT32_MAX)):
        raise ValueError(f"truncate_prompt_tokens must be -1 or an int in [1, {INT32_MAX}], got {k!r}")


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` ids (-1: ``max_model_len``; None: all), as vLLM truncates."""
    if truncate_prompt_tokens is None:
        return token_ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return token_ids[-keep:]
