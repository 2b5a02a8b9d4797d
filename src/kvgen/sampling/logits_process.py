"""Hugging Face-style logits processors over ``kvgen.sampling.ops``, applied in one declared order.

Each processor is a small pure callable ``(token_ids [B, T] long, logits [B, V] float)
-> logits [B, V]`` holding one setting for the whole batch; it validates that setting
when built and never edits its inputs. ``build_logits_processors`` turns any object
with Hugging Face ``GenerationConfig`` attribute names into a ``LogitsProcessorList``
ordered by ``kvgen.sampling.pipeline.GENERATE_ORDER``.

Source: ``transformers`` 4.55 ``generation/logits_process.py`` (semantics) and
``GenerationMixin._get_logits_processor`` (order, ``min_tokens_to_keep`` for beams).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from kvgen.config import checked_token_ids, token_id_list
from kvgen.sampling import ops
from kvgen.sampling.params import PARAM_RULES
from kvgen.sampling.pipeline import GENERATE_FIRST_WARPER, GENERATE_ORDER, split_order
from kvgen.sampling.synthid import (
    SynthIDTextWatermarkingConfig,
    SynthIDTextWatermarkLogitsProcessor,
)
from kvgen.sampling.watermark import WatermarkingConfig, WatermarkLogitsProcessor


class LogitsProcessor:
    """Base class: ``(token_ids [B, T] long, logits [B, V] float) -> logits [B, V]``."""

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class LogitsProcessorList(list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]):
    """Processors applied left to right; calling it returns the last one's logits [B, V]."""

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        for processor in self:
            logits = processor(token_ids, logits)
        return logits


# ------------------------------------------------------------------ warpers


class TemperatureLogitsWarper(LogitsProcessor):
    """logits / temperature. Raises ValueError unless temperature > 0."""

    def __init__(self, temperature: float):
        ops.validate_param("temperature", temperature, rule=ops.POSITIVE_TEMPERATURE)
        self.temperature = temperature

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return ops.apply_temperature(logits, self.temperature)


class _Filter(LogitsProcessor):
    """A truncation warper: one parameter, ``filter_value`` and ``min_tokens_to_keep``."""

    param_name: str
    op: Callable[..., torch.Tensor]

    def __init__(self, value: float, filter_value: float = ops.FILTER_VALUE, min_tokens_to_keep: int = 1):
        ops.validate_param(self.param_name, value)
        ops.validate_param("min_tokens_to_keep", min_tokens_to_keep)
        self.value = value
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return type(self).op(logits, self.value, self.min_tokens_to_keep, self.filter_value)


class TopKLogitsWarper(_Filter):
    """Keep the top_k highest logits (ties kept). Raises ValueError for top_k < 0."""

    param_name, op = "top_k", ops.apply_top_k


class TopPLogitsWarper(_Filter):
    """Nucleus filtering. Raises ValueError unless top_p is in (0, 1]."""

    param_name, op = "top_p", ops.apply_top_p


class MinPLogitsWarper(_Filter):
    """Drop tokens below min_p * top probability. Raises ValueError unless min_p is in [0, 1]."""

    param_name, op = "min_p", ops.apply_min_p


class TypicalLogitsWarper(_Filter):
    """Locally typical filtering with mass typical_p. Raises ValueError unless it is in (0, 1]."""

    param_name, op = "typical_p", ops.apply_typical_p


class EpsilonLogitsWarper(_Filter):
    """Drop tokens with probability < epsilon. Raises ValueError unless epsilon is in [0, 1)."""

    param_name, op = "epsilon_cutoff", ops.apply_epsilon_cutoff


class EtaLogitsWarper(_Filter):
    """Entropy-dependent cutoff. Raises ValueError unless epsilon (eta) is in [0, 1)."""

    param_name, op = "eta_cutoff", ops.apply_eta_cutoff


# --------------------------------------------------------------- processors


class RepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """HF repetition penalty over the whole history (prompt included). Raises ValueError for penalty outside
    [1e-6, 1e6]."""

    def __init__(self, penalty: float):
        ops.validate_param("repetition_penalty", penalty)
        self.penalty = penalty

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return ops.apply_repetition_penalty(logits, token_ids, self.penalty)


class UnbatchedClassifierFreeGuidanceLogitsProcessor(LogitsProcessor):
    """Classifier-free guidance for a decoder-only model: scores become g (log_softmax(scores) - u) + u, u the
    log-softmax of the next-token logits [N, V] ``unconditional_logits(token_ids)`` gives for an unconditional
    sequence (``kvgen.generation.guidance.UnconditionalBranch``: the negative prompt, or each row's last prompt
    token, then every new token). Sanchez et al. 2023, "Stay on topic with Classifier-Free Guidance"; transformers
    4.55 ``UnbatchedClassifierFreeGuidanceLogitsProcessor``. Raises ValueError for a scale outside [0, 1e6]."""

    def __init__(self, guidance_scale: float, unconditional_logits: Callable[[torch.Tensor], torch.Tensor]):
        ops.validate_param("guidance_scale", guidance_scale)
        self.guidance_scale = guidance_scale
        self.unconditional_logits = unconditional_logits

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        scores = torch.log_softmax(logits, dim=-1)  # [N, V]
        unconditional = torch.log_softmax(self.unconditional_logits(token_ids), dim=-1)  # [N, V]
        return self.guidance_scale * (scores - unconditional) + unconditional


class EncoderRepetitionPenaltyLogitsProcessor(LogitsProcessor):
    """The repetition penalty inverted, on the prompt's ids: penalty > 1 makes them likelier (a "hallucination
    penalty"). encoder_input_ids [B, T] long: the prompt as passed to ``generate()``, padding ids included.

    As transformers 4.55 (``EncoderRepetitionPenaltyLogitsProcessor``, which ``generate()`` gives the unexpanded
    prompt): rows i < B of the scores take row i's ids, so with beams or several sequences per prompt only the first
    B rows change. Raises ValueError for a penalty outside [1e-6, 1e6].
    """

    def __init__(self, penalty: float, encoder_input_ids: torch.Tensor):
        ops.validate_param("encoder_repetition_penalty", penalty)
        self.penalty = 1 / penalty
        self.encoder_input_ids = encoder_input_ids

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        rows = min(self.encoder_input_ids.shape[0], logits.shape[0])
        ids = self.encoder_input_ids[:rows]  # [rows, T]
        seen = logits.gather(1, ids)  # [rows, T]
        return logits.scatter(1, ids, torch.where(seen < 0, seen * self.penalty, seen / self.penalty))


class EncoderNoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Forbid a token that would complete an ``ngram_size``-gram of the row's prompt. encoder_input_ids [B, T] long,
    as passed to ``generate()``; score row h (of B x k hypotheses) uses prompt h // k, its last ngram_size - 1 tokens
    the n-gram's start. Source: transformers 4.55 ``EncoderNoRepeatNGramLogitsProcessor``. Raises ValueError for
    ngram_size < 1."""

    def __init__(self, ngram_size: int, encoder_input_ids: torch.Tensor):
        ops.validate_param("encoder_no_repeat_ngram_size", ngram_size)
        if ngram_size < 1:
            raise ValueError(f"encoder_no_repeat_ngram_size must be >= 1 here, got {ngram_size}")
        self.ngram_size = ngram_size
        self.next_tokens: list[dict[tuple[int, ...], list[int]]] = []  # per prompt: (n - 1)-gram -> next tokens
        for row in encoder_input_ids.tolist():
            table: dict[tuple[int, ...], list[int]] = {}
            for i in range(len(row) - ngram_size + 1):
                table.setdefault(tuple(row[i : i + ngram_size - 1]), []).append(row[i + ngram_size - 1])
            self.next_tokens.append(table)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        per_prompt = max(1, logits.shape[0] // len(self.next_tokens))
        out, start = logits.clone(), token_ids.shape[1] + 1 - self.ngram_size
        for h, row in enumerate(token_ids.tolist()):
            banned = self.next_tokens[h // per_prompt].get(tuple(row[start:]) if start >= 0 else (), [])
            if start >= 0 and banned:
                out[h, banned] = -float("inf")
        return out


class PresenceFrequencyPenaltyLogitsProcessor(LogitsProcessor):
    """OpenAI presence/frequency penalties over the tokens after ``prompt_length``.

    Raises ValueError for penalties outside [-2, 2] or a negative prompt_length.
    """

    def __init__(self, presence_penalty: float, frequency_penalty: float, prompt_length: int):
        ops.validate_param("presence_penalty", presence_penalty)
        ops.validate_param("frequency_penalty", frequency_penalty)
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 0:
            raise ValueError(f"prompt_length must be an int >= 0, got {prompt_length!r}")
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.prompt_length = prompt_length

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        output_ids = token_ids[:, self.prompt_length :]  # [B, T - prompt_length]
        return ops.apply_presence_frequency_penalty(logits, output_ids, self.presence_penalty, self.frequency_penalty)


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Forbid repeating any n-gram of the history. Raises ValueError for ngram_size < 0."""

    def __init__(self, ngram_size: int):
        ops.validate_param("no_repeat_ngram_size", ngram_size)
        self.ngram_size = ngram_size

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return ops.apply_no_repeat_ngram(logits, token_ids, self.ngram_size)


class MinNewTokensLengthLogitsProcessor(LogitsProcessor):
    """Forbid EOS ids until ``min_new_tokens`` tokens follow the prompt.

    Raises ValueError for negative lengths.
    """

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id: int | Sequence[int]):
        ops.validate_param("prompt_length_to_skip", prompt_length_to_skip, rule=PARAM_RULES["num_generated"])
        ops.validate_param("min_new_tokens", min_new_tokens)
        self.prompt_length_to_skip = prompt_length_to_skip
        self.min_new_tokens = min_new_tokens
        self.eos_token_ids = token_id_list(eos_token_id)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        num_generated = token_ids.shape[1] - self.prompt_length_to_skip
        return ops.apply_min_tokens(logits, num_generated, self.min_new_tokens, self.eos_token_ids)


class MinLengthLogitsProcessor(LogitsProcessor):
    """Forbid EOS ids while the sequence, prompt included, is shorter than ``min_length`` (transformers'
    ``min_length``). Raises ValueError for a negative length."""

    def __init__(self, min_length: int, eos_token_id: int | Sequence[int]):
        ops.validate_param("min_length", min_length)
        self.min_length = min_length
        self.eos_token_ids = token_id_list(eos_token_id)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return ops.apply_min_tokens(logits, token_ids.shape[1], self.min_length, self.eos_token_ids)


class SequenceBiasLogitsProcessor(LogitsProcessor):
    """Additive bias on the id that would complete each listed sequence. Raises ValueError if malformed."""

    def __init__(self, sequence_bias: ops.SequenceBias):
        self.sequence_bias = ops.normalize_sequence_bias(sequence_bias)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return ops.apply_sequence_bias(logits, token_ids, self.sequence_bias)


class NoBadWordsLogitsProcessor(LogitsProcessor):
    """Forbid the listed id sequences; single-id entries equal to an EOS id are dropped, as in HF.

    Raises ValueError for an empty or malformed list.
    """

    def __init__(self, bad_words_ids: Sequence[Sequence[int]], eos_token_id: int | Sequence[int] | None = None):
        if not isinstance(bad_words_ids, Sequence) or not bad_words_ids:
            raise ValueError(f"bad_words_ids must be a non-empty list of id lists, got {bad_words_ids!r}")
        # validates the ids; as [entry, bias] pairs, so a nested or non-list entry is a ValueError, not a TypeError
        ops.normalize_sequence_bias([(ids, 0.0) for ids in bad_words_ids], "bad_words_ids")
        eos = token_id_list(eos_token_id)
        self.bad_words_ids = [list(ids) for ids in bad_words_ids if not (len(ids) == 1 and ids[0] in eos)]

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not self.bad_words_ids:
            return logits.clone()
        return ops.apply_bad_words(logits, token_ids, self.bad_words_ids)


class SuppressTokensLogitsProcessor(LogitsProcessor):
    """Set the listed ids to -inf at every step."""

    def __init__(self, suppress_tokens: Sequence[int]):
        self.suppress_tokens = checked_token_ids("suppress_tokens", suppress_tokens, single=True, allow_empty=True)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return ops.apply_suppress_tokens(logits, self.suppress_tokens)


def _only(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """-inf everywhere but 0 at ``token_ids`` (ids >= V ignored), as transformers' forcing processors."""
    forced = torch.full_like(logits, -math.inf)  # [B, V]
    keep = [t for t in token_ids if t < logits.shape[1]]
    forced[:, keep] = 0
    return forced


class ForcedBOSTokenLogitsProcessor(LogitsProcessor):
    """Force ``bos_token_id`` as the token after a 1-token input (transformers' rule: only when ``cur_len == 1``)."""

    def __init__(self, bos_token_id: int):
        self.bos_token_id = checked_token_ids("forced_bos_token_id", bos_token_id, single=True)[0]

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return _only(logits, [self.bos_token_id]) if token_ids.shape[-1] == 1 else logits


class ForcedEOSTokenLogitsProcessor(LogitsProcessor):
    """Force an EOS id as the last token: at length ``max_length - 1`` only ``eos_token_id`` stays possible."""

    def __init__(self, max_length: int, eos_token_id: int | Sequence[int]):
        self.max_length = max_length
        self.eos_token_ids = checked_token_ids("forced_eos_token_id", eos_token_id, single=True)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return _only(logits, self.eos_token_ids) if token_ids.shape[-1] == self.max_length - 1 else logits


class InfNanRemoveLogitsProcessor(LogitsProcessor):
    """NaN -> 0, +inf / -inf -> the largest / lowest float of the dtype (``remove_invalid_values``)."""

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out = torch.where(torch.isnan(logits), 0.0, logits)
        out = torch.where(logits == math.inf, torch.finfo(logits.dtype).max, out)
        return torch.where(logits == -math.inf, torch.finfo(logits.dtype).min, out)


def check_processor_settings(cfg: object) -> None:
    """``ValueError`` naming the field for a malformed setting of the processors below (GenerationConfig checks
    them on construction, before any model work)."""
    for name in ("forced_bos_token_id", "forced_eos_token_id", "begin_suppress_tokens"):
        if (value := getattr(cfg, name, None)) is not None:
            checked_token_ids(name, value, single=True)
    if (value := getattr(cfg, "suppress_tokens", None)) is not None:
        checked_token_ids("suppress_tokens", value, single=True, allow_empty=True)
    if (words := getattr(cfg, "bad_words_ids", None)) is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, (list, tuple)) for w in words)):
        raise ValueError(f"bad_words_ids must be a list of token id lists, got {words!r}")
    if (bias := getattr(cfg, "sequence_bias", None)) is not None:
        ops.normalize_sequence_bias(bias)
    pair = getattr(cfg, "exponential_decay_length_penalty", None)
    if pair is not None and (
            not isinstance(pair, (list, tuple)) or len(pair) != 2 or isinstance(pair[0], bool)
            or not isinstance(pair[0], int) or pair[0] < 0 or isinstance(pair[1], bool)
            or not isinstance(pair[1], (int, float)) or not math.isfinite(pair[1]) or pair[1] <= 0):
        raise ValueError(f"exponential_decay_length_penalty must be (start >= 0, factor > 0), got {pair!r}")
    for name in ("remove_invalid_values", "renormalize_logits"):
        if not isinstance(getattr(cfg, name, False), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(cfg, name)!r}")


class ExponentialDecayLengthPenalty(LogitsProcessor):
    """After ``start`` new tokens, raise the EOS logits by ``|x| (factor ** (n - start) - 1)`` at new token n > start
    (``exponential_decay_length_penalty = (start, factor)``). Raises ValueError for a malformed pair."""

    def __init__(self, exponential_decay_length_penalty: Sequence[float], eos_token_id: int | Sequence[int],
                 prompt_length: int):
        pair = exponential_decay_length_penalty
        check_processor_settings(SimpleNamespace(exponential_decay_length_penalty=pair))
        self.regulation_start, self.regulation_factor = pair[0] + prompt_length, float(pair[1])
        self.eos_token_ids = checked_token_ids("eos_token_id", eos_token_id, single=True)

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        cur_len = token_ids.shape[-1]
        if cur_len <= self.regulation_start:
            return logits
        eos = [t for t in self.eos_token_ids if t < logits.shape[1]]
        penalties = torch.zeros_like(logits)  # [B, V]
        penalties[:, eos] = logits[:, eos].abs() * (pow(self.regulation_factor, cur_len - self.regulation_start) - 1)
        return logits + penalties


class SuppressTokensAtBeginLogitsProcessor(LogitsProcessor):
    """Set the listed ids to -inf at one step only: when the sequence is ``begin_index`` tokens long."""

    def __init__(self, begin_suppress_tokens: Sequence[int], begin_index: int):
        self.begin_suppress_tokens = checked_token_ids("begin_suppress_tokens", list(begin_suppress_tokens), single=True)
        self.begin_index = begin_index

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if token_ids.shape[-1] != self.begin_index:
            return logits
        return ops.apply_suppress_tokens(logits, self.begin_suppress_tokens)


class LogitNormalization(LogitsProcessor):
    """Log-softmax over the vocabulary (``renormalize_logits``: after every other processor and warper)."""

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1)


# ------------------------------------------------------------------ builder

@dataclass(frozen=True)
class _Settings:
    """What the factories read: the config plus values derived once."""

    cfg: object
    prompt_length: int
    min_tokens_to_keep: int
    eos_token_ids: list[int]
    prompt_ids: torch.Tensor | None = None  # [B, T] as passed to generate(): the encoder_* processors' prompt
    unconditional_logits: Callable[[torch.Tensor], torch.Tensor] | None = None  # classifier-free guidance's branch

    def get(self, name: str, default: object) -> Any:
        """``cfg.name``, with a missing attribute or ``None`` meaning ``default`` (disabled)."""
        value = getattr(self.cfg, name, None)
        return default if value is None else value


def _when_set(
    cls: Callable[..., LogitsProcessor], name: str, disabled: object = None, **extra: object
) -> Callable[[_Settings], LogitsProcessor | None]:
    """A factory building ``cls(cfg.name, **extra)`` unless the value is the disabled one."""

    def build(s: _Settings) -> LogitsProcessor | None:
        value = s.get(name, disabled)
        return None if value == disabled else cls(value, **extra)

    return build


def _filter(cls: type[_Filter], name: str, disabled: float) -> Callable[[_Settings], LogitsProcessor | None]:
    """A factory for a truncation warper, passing the derived ``min_tokens_to_keep``."""
    return lambda s: _when_set(cls, name, disabled, min_tokens_to_keep=s.min_tokens_to_keep)(s)


def _bad_words(s: _Settings) -> LogitsProcessor | None:
    bad_words_ids = s.get("bad_words_ids", None)
    return None if bad_words_ids is None else NoBadWordsLogitsProcessor(bad_words_ids, s.eos_token_ids)


def _min_length(s: _Settings) -> LogitsProcessor | None:
    min_length = s.get("min_length", 0)
    if s.get("min_new_tokens", 0) > 0:  # it takes precedence (transformers' _prepare_generated_length)
        min_length = s.prompt_length + s.get("min_new_tokens", 0)
    return None if min_length == 0 or not s.eos_token_ids else MinLengthLogitsProcessor(min_length, s.eos_token_ids)


def _min_new_tokens(s: _Settings) -> LogitsProcessor | None:
    min_new_tokens = s.get("min_new_tokens", 0)
    if min_new_tokens == 0 or not s.eos_token_ids:  # HF skips it without an EOS id
        return None
    return MinNewTokensLengthLogitsProcessor(s.prompt_length, min_new_tokens, s.eos_token_ids)


def _forced_eos(s: _Settings) -> LogitsProcessor | None:
    eos = s.get("forced_eos_token_id", None)
    max_new = s.get("max_new_tokens", None)
    return None if eos is None or max_new is None else ForcedEOSTokenLogitsProcessor(s.prompt_length + max_new, eos)


def _exponential_decay(s: _Settings) -> LogitsProcessor | None:
    pair = s.get("exponential_decay_length_penalty", None)
    if pair is None or not s.eos_token_ids:  # nothing to raise (transformers fails on a missing EOS id)
        return None
    return ExponentialDecayLengthPenalty(pair, s.eos_token_ids, s.prompt_length)


def _begin_suppress(s: _Settings) -> LogitsProcessor | None:
    tokens = s.get("begin_suppress_tokens", None)
    if tokens is None:
        return None
    # transformers: one later when a forced BOS follows a 1-token input
    shift = s.prompt_length == 1 and s.get("forced_bos_token_id", None) is not None
    return SuppressTokensAtBeginLogitsProcessor(tokens, s.prompt_length + shift)


def _encoder(cls: Callable[..., LogitsProcessor], name: str, disabled: object
             ) -> Callable[[_Settings], LogitsProcessor | None]:
    """A factory building ``cls(cfg.name, prompt ids)`` unless the value is the disabled one or no prompt is known
    (transformers warns and skips it then)."""

    def build(s: _Settings) -> LogitsProcessor | None:
        value = s.get(name, disabled)
        return None if value == disabled or s.prompt_ids is None else cls(value, s.prompt_ids)

    return build


def _guidance(s: _Settings) -> LogitsProcessor | None:
    scale = s.get("guidance_scale", 1.0)
    if scale == 1.0:
        return None
    if s.unconditional_logits is None:
        raise ValueError("guidance_scale needs the model's unconditional branch (generate() builds it)")
    return UnbatchedClassifierFreeGuidanceLogitsProcessor(scale, s.unconditional_logits)


def _presence_frequency(s: _Settings) -> LogitsProcessor | None:
    presence, frequency = s.get("presence_penalty", 0.0), s.get("frequency_penalty", 0.0)
    if presence == 0.0 and frequency == 0.0:
        return None
    return PresenceFrequencyPenaltyLogitsProcessor(presence, frequency, s.prompt_length)


def _watermark(s: _Settings) -> WatermarkLogitsProcessor | SynthIDTextWatermarkLogitsProcessor | None:
    value = s.get("watermarking_config", None)
    if value is None:
        return None
    config = WatermarkingConfig.of(value)
    if isinstance(config, SynthIDTextWatermarkingConfig):
        return SynthIDTextWatermarkLogitsProcessor(config)
    return WatermarkLogitsProcessor(None, config)


# Stage name (``kvgen.sampling.pipeline.GENERATE_ORDER``) -> (processor class, factory).
_STAGES: dict[str, tuple[type, Callable[[_Settings], Any]]] = {  # (LogitsProcessor or watermark class, factory)
    "guidance": (UnbatchedClassifierFreeGuidanceLogitsProcessor, _guidance),
    "sequence_bias": (SequenceBiasLogitsProcessor, _when_set(SequenceBiasLogitsProcessor, "sequence_bias")),
    "encoder_repetition_penalty": (
        EncoderRepetitionPenaltyLogitsProcessor,
        _encoder(EncoderRepetitionPenaltyLogitsProcessor, "encoder_repetition_penalty", 1.0),
    ),
    "repetition_penalty": (
        RepetitionPenaltyLogitsProcessor,
        _when_set(RepetitionPenaltyLogitsProcessor, "repetition_penalty", 1.0),
    ),
    "no_repeat_ngram": (NoRepeatNGramLogitsProcessor, _when_set(NoRepeatNGramLogitsProcessor, "no_repeat_ngram_size", 0)),
    "encoder_no_repeat_ngram": (
        EncoderNoRepeatNGramLogitsProcessor,
        _encoder(EncoderNoRepeatNGramLogitsProcessor, "encoder_no_repeat_ngram_size", 0),
    ),
    "bad_words": (NoBadWordsLogitsProcessor, _bad_words),
    "min_length": (MinLengthLogitsProcessor, _min_length),
    "min_new_tokens": (MinNewTokensLengthLogitsProcessor, _min_new_tokens),
    "forced_bos": (ForcedBOSTokenLogitsProcessor, _when_set(ForcedBOSTokenLogitsProcessor, "forced_bos_token_id")),
    "forced_eos": (ForcedEOSTokenLogitsProcessor, _forced_eos),
    "remove_invalid_values": (InfNanRemoveLogitsProcessor,
                              lambda s: InfNanRemoveLogitsProcessor() if s.get("remove_invalid_values", False) else None),
    "exponential_decay_length_penalty": (ExponentialDecayLengthPenalty, _exponential_decay),
    "suppress_tokens": (SuppressTokensLogitsProcessor, _when_set(SuppressTokensLogitsProcessor, "suppress_tokens")),
    "begin_suppress_tokens": (SuppressTokensAtBeginLogitsProcessor, _begin_suppress),
    "presence_frequency_penalty": (PresenceFrequencyPenaltyLogitsProcessor, _presence_frequency),
    "temperature": (TemperatureLogitsWarper, _when_set(TemperatureLogitsWarper, "temperature", 1.0)),
    "top_k": (TopKLogitsWarper, _filter(TopKLogitsWarper, "top_k", 0)),
    "top_p": (TopPLogitsWarper, _filter(TopPLogitsWarper, "top_p", 1.0)),
    "min_p": (MinPLogitsWarper, _filter(MinPLogitsWarper, "min_p", 0.0)),
    "typical_p": (TypicalLogitsWarper, _filter(TypicalLogitsWarper, "typical_p", 1.0)),
    "epsilon_cutoff": (EpsilonLogitsWarper, _filter(EpsilonLogitsWarper, "epsilon_cutoff", 0.0)),
    "eta_cutoff": (EtaLogitsWarper, _filter(EtaLogitsWarper, "eta_cutoff", 0.0)),
    "watermark": (WatermarkLogitsProcessor, _watermark),
    "renormalize_logits": (LogitNormalization,
                           lambda s: LogitNormalization() if s.get("renormalize_logits", False) else None),
}
# The classes in GENERATE_ORDER (transformers 4.55 ``_get_logits_processor`` order).
PROCESSOR_ORDER: tuple[type, ...] = tuple(_STAGES[name][0] for name in GENERATE_ORDER)
_ALWAYS, _WARPERS = split_order(GENERATE_ORDER[:-2], GENERATE_FIRST_WARPER)
_ALWAYS += GENERATE_ORDER[-2:]  # watermark, renormalize_logits: last, with or without sampling
WARPERS: frozenset[type] = frozenset(_STAGES[name][0] for name in _WARPERS)


def default_min_tokens_to_keep(cfg: object) -> int:
    """1, or for beam sampling (num_beams > 1) the number of EOS ids + 1 (2 when ``eos_token_id`` is None; 1 for
    an explicit empty list, whose EOS tensor has 0 rows), as transformers 4.55 ``_get_logits_processor``."""
    if (getattr(cfg, "num_beams", None) or 1) <= 1:
        return 1
    eos = getattr(cfg, "eos_token_id", None)
    return 2 if eos is None else len(token_id_list(eos)) + 1


def build_logits_processors(
    cfg: object, prompt_length: int, min_tokens_to_keep: int | None = None,
    custom: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = (), prompt_ids: torch.Tensor | None = None,
    unconditional_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LogitsProcessorList:
    """The processors ``cfg`` enables, in ``GENERATE_ORDER``; warpers only when ``cfg.do_sample``.

    cfg: any object with HF ``GenerationConfig`` attribute names (missing or ``None``
    means disabled). prompt_length: tokens before the first generated one (columns
    of token_ids). min_tokens_to_keep: for the warpers; ``None`` derives it from
    num_beams as HF does. ``custom``: the caller's own processors ``(token_ids [B, T],
    logits [B, V]) -> [B, V]``, merged as transformers 4.55 ``_merge_criteria_processor_list``
    does: one of the same class as a built one takes its place, the others run after
    the built processors and before the warpers. ``prompt_ids`` [B, T]: the prompt as passed to ``generate()``
    (before any expansion), which the encoder_* processors read (without it they are left out, as transformers does
    without input ids). ``unconditional_logits``: classifier-free guidance's branch (``guidance_scale``), token_ids
    [N, T] -> next-token logits [N, V]. Raises ValueError for invalid settings.
    """
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 0:
        raise ValueError(f"prompt_length must be an int >= 0, got {prompt_length!r}")
    if not isinstance(custom, Sequence) or not all(callable(c) for c in custom):
        raise ValueError(f"logits_processor must be a list of callables (token_ids, scores) -> scores, got {custom!r}")
    keep = default_min_tokens_to_keep(cfg) if min_tokens_to_keep is None else min_tokens_to_keep
    ops.validate_param("min_tokens_to_keep", keep)
    settings = _Settings(cfg, prompt_length, keep, token_id_list(getattr(cfg, "eos_token_id", None)), prompt_ids,
                         unconditional_logits)
    sampling = getattr(cfg, "do_sample", False)
    stages, merge_at = (GENERATE_ORDER, GENERATE_FIRST_WARPER) if sampling else (_ALWAYS, _ALWAYS[-2])
    processors = LogitsProcessorList()
    for name in stages:
        if name == merge_at:  # the caller's processors: before the warpers (and renormalize_logits)
            processors = _merge_custom(processors, custom)
        processor = _STAGES[name][1](settings)
        if processor is not None:
            processors.append(processor)
    return processors


def _merge_custom(built: LogitsProcessorList, custom: Sequence[Callable[..., torch.Tensor]]) -> LogitsProcessorList:
    """``built`` with each processor of a class found in ``custom`` replaced by that custom one, then the rest of
    ``custom`` appended (transformers' ``_merge_criteria_processor_list``); the caller's run as
    :class:`CallerProcessor`."""
    merged = LogitsProcessorList(next((c for c in custom if type(c) is type(p)), p) for p in built)
    merged.extend(c for c in custom if c not in merged)
    return LogitsProcessorList(CallerProcessor(p) if any(p is c for c in custom) else p for p in merged)


class CallerProcessor(LogitsProcessor):
    """A caller's processor, given a copy of the logits (transformers' processors write theirs in place, which the
    inference-mode tensors of a forward refuse) and held to the contract: a float tensor of the logits' shape
    [B, V], else ``ValueError`` naming it."""

    def __init__(self, processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.processor = processor

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        out = self.processor(token_ids, logits.clone())
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape or not out.is_floating_point():
            got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"logits_processor {self.processor!r} must return float scores {list(logits.shape)} "
                             f"[B, V], got {got}")
        return out
