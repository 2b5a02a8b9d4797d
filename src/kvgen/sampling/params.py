"""The one table of sampling and decoding fields: kind, range, "off" value, help.

``GenerationConfig`` (``generate()``), ``SamplingParams`` (the engine), the CLI
flags and the ops in ``kvgen.sampling.ops`` all check values through
``check_param`` / ``PARAM_RULES``, so a value is accepted or refused the same way
everywhere, with one message naming the field: ``top_p must be in (0, 1], got 1.5``.

Defaults stay those of each API (Hugging Face ``GenerationConfig`` 4.55 for
``generate()``, vLLM ``SamplingParams`` for the engine); "-" = not a field there.

===========================================  ======================  ================  ==========================
field (generate() name / engine name)        GenerationConfig        SamplingParams    accepted (off value)
===========================================  ======================  ================  ==========================
temperature                                  1.0                     1.0               finite >= 0 (1.0)
top_k                                        50                      0 (-1 = off too)  int in [0, 2**31-1] (0)
top_p                                        1.0                     1.0               (0, 1] (1.0)
min_p                                        None (off)              0.0               [0, 1] (0.0)
typical_p                                    1.0                     -                 (0, 1] (1.0)
epsilon_cutoff / eta_cutoff                  0.0                     -                 [0, 1) (0.0)
repetition_penalty                           1.0                     1.0               [1e-6, 1e6] (1.0)
encoder_repetition_penalty                   1.0                     -                 [1e-6, 1e6] (1.0)
guidance_scale                               None (off)              -                 [0, 1e6] (1.0)
presence_penalty / frequency_penalty         0.0                     0.0               [-2, 2] (0.0)
no_repeat_ngram_size                         0                       -                 int in [0, 2**31-1] (0)
encoder_no_repeat_ngram_size                 0                       -                 int in [0, 2**31-1] (0)
min_new_tokens / min_tokens                  0                       0                 int in [0, 2**31-1] (0)
max_new_tokens / max_tokens                  20                      16 (None = ctx)   int in [1, 2**31-1]
min_length / max_length (prompt included)    0 / None                -                 int in [0 / 1, 2**31-1]
num_return_sequences / n                     1                       1                 int in [1, 2**31-1]
best_of                                      None                    None              int in [1, 2**31-1]
seed                                         None                    None              int in [-2**63, 2**64-1]
===========================================  ======================  ================  ==========================

Why these bounds: counts and ``top_k`` become int32/int64 tensor sizes or indices,
so they stop at 2**31-1 (``top_k=2**70`` would overflow ``torch.full``); a seed is
what ``torch.Generator.manual_seed`` accepts; float settings must be finite (NaN
and inf fail every range); the repetition penalty multiplies or divides logits,
so it stays in [1e-6, 1e6], where a float32 logit of any real model (|x| < 1e30)
stays finite (5e-324 would turn logits into inf, then NaN probabilities).
``generate()`` samples only with ``temperature >= SAMPLING_EPS`` (below, logits / T
overflows); the engine's ``SamplingParams`` raises a positive temperature below 0.01 to 0.01,
as vLLM, so only 0 is greedy there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# Temperatures below this are greedy in the engine (vLLM's _SAMPLING_EPS) and refused for sampling in generate().
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class ParamRule:
    """One field's kind and range. Bounds are inclusive unless ``*_open``; ``None`` = unbounded.

    ``off``: the value that disables the transform (None: no such value); ``note``
    is appended to the error message, e.g. ``(0 = off)``.
    """

    kind: type[int | float]
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    off: float | None = None
    help: str = ""
    note: str = ""

    @property
    def expected(self) -> str:
        """What a valid value looks like: ``in (0, 1]``, ``an int in [0, 2147483647] (0 = off)``."""
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{_fmt(self.low)}, {_fmt(self.high)}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_fmt(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_fmt(self.high)}"
        else:
            text = "finite"
        if self.kind is int:
            text = f"an int {text}"
        elif self.low is None or self.high is None:
            text = f"a finite number {text}" if text != "finite" else "a finite number"
        return f"{text} ({self.note})" if self.note else text

    def accepts_kind(self, value: object) -> bool:
        """Whether ``value`` is a Python number of this rule's kind (bools never are)."""
        kinds: tuple[type, ...] = (int,) if self.kind is int else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool)

    def exclusive_low(self, note: str) -> ParamRule:
        """This rule with its lower bound made exclusive (e.g. temperature > 0 where it divides)."""
        return dataclasses.replace(self, low_open=True, note=note)


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _count(low: int, help: str, note: str = "") -> ParamRule:
    return ParamRule(int, low, INT32_MAX, off=0 if low == 0 else None, help=help, note=note)


def _unit(help: str, low_open: bool = False, high_open: bool = False, off: float | None = None) -> ParamRule:
    return ParamRule(float, 0.0, 1.0, low_open, high_open, off, help)


_PENALTY = ParamRule(float, -2.0, 2.0, off=0.0, help="OpenAI penalty over generated tokens")

PARAM_RULES: dict[str, ParamRule] = {
    "temperature": ParamRule(float, 0.0, off=1.0, help="softmax temperature", note="0 = greedy"),
    "top_k": _count(0, "keep the k most likely tokens", "0 = off"),
    "top_p": _unit("nucleus sampling mass", low_open=True, off=1.0),
    "min_p": _unit("drop tokens below min_p * the top probability", off=0.0),
    "typical_p": _unit("locally typical sampling mass", low_open=True, off=1.0),
    "epsilon_cutoff": _unit("drop tokens with probability below this", high_open=True, off=0.0),
    "eta_cutoff": _unit("eta sampling cutoff", high_open=True, off=0.0),
    "repetition_penalty": ParamRule(float, 1e-6, 1e6, off=1.0, help="CTRL penalty over prompt and output"),
    "encoder_repetition_penalty": ParamRule(float, 1e-6, 1e6, off=1.0, help="inverse CTRL penalty on the prompt's ids"),
    "guidance_scale": ParamRule(float, 0.0, 1e6, off=1.0, help="classifier-free guidance scale"),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "no_repeat_ngram_size": _count(0, "forbid repeating n-grams of this size", "0 = off"),
    "encoder_no_repeat_ngram_size": _count(0, "forbid n-grams of this size that occur in the prompt", "0 = off"),
    "min_new_tokens": _count(0, "EOS suppressed until this many new tokens"),
    "min_length": _count(0, "EOS suppressed until the sequence, prompt included, is this long"),
    "max_length": _count(1, "most tokens, prompt included"),
    "min_tokens": _count(0, "EOS and stop tokens suppressed until this many new tokens"),
    "max_new_tokens": _count(1, "most new tokens"),
    "max_tokens": _count(1, "most new tokens"),
    "num_return_sequences": _count(1, "sequences returned per prompt"),
    "n": _count(1, "completions returned per prompt"),
    "best_of": _count(1, "samples drawn per prompt, the best returned"),
    "logprobs": _count(0, "top alternatives returned per token"),
    "prompt_logprobs": _count(0, "top alternatives returned per prompt token"),
    "seed": ParamRule(int, SEED_MIN, SEED_MAX, help="seed of the torch.Generator"),
    "num_beams": _count(1, "beams for beam search"),
    "num_beam_groups": _count(1, "groups for diverse beam search"),
    "diversity_penalty": ParamRule(float, 0.0, off=0.0, help="group beam search diversity penalty"),
    "penalty_alpha": _unit("contrastive search degeneration penalty", off=0.0),
    "length_penalty": ParamRule(float, help="beam score exponent on the length"),
    "max_time": ParamRule(float, 0.0, low_open=True, help="seconds before stopping"),
    "prompt_lookup_num_tokens": _count(1, "prompt lookup decoding: tokens drafted per step"),
    "max_matching_ngram_size": _count(1, "prompt lookup decoding: longest n-gram looked up"),
    "num_assistant_tokens": _count(1, "assisted decoding: tokens the assistant model drafts per step (at first)"),
    "prefill_chunk_size": _count(1, "prompt tokens per prefill forward"),
    "assistant_confidence_threshold": _unit("assisted decoding: drafting stops after a token below this probability",
                                            high_open=True, off=0.0),
    # Op-internal counts.
    "num_generated": _count(0, "tokens generated so far"),
    "min_tokens_to_keep": _count(1, "tokens every truncation keeps"),
}


def check_param(name: str, value: object, rule: ParamRule | None = None) -> None:
    """Check one scalar against ``PARAM_RULES[name]`` (or ``rule``).

    Raises ``ValueError`` naming the field and the value: ``top_p must be in (0, 1], got 1.5``.
    """
    rule = rule or PARAM_RULES[name]
    if isinstance(value, (int, float)) and rule.accepts_kind(value) and in_range(rule, value):
        return
    raise ValueError(f"{name} must be {rule.expected}, got {value!r}")


def in_range(rule: ParamRule, x: float) -> bool:
    """Whether the Python number ``x`` lies in ``rule``'s range (NaN and inf never do; exact for ints of any size)."""
    if isinstance(x, float) and not math.isfinite(x):
        return False
    if rule.low is not None and not (x > rule.low if rule.low_open else x >= rule.low):
        return False
    return rule.high is None or (x < rule.high if rule.high_open else x <= rule.high)
