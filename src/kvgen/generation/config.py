"""``GenerationConfig``: Hugging Face field names and defaults, validated once.

The decoding strategy is derived once into :class:`Strategy` (as transformers
4.55 ``GenerationConfig.get_generation_mode``); contradictory settings raise
``ValueError`` naming both parameters. Each field's ``help`` metadata is reused
by the CLI to generate ``kvgen generate`` flags.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgen.config import checked_token_ids, token_id_list
from kvgen.fields import as_bool, check_int, config_field
from kvgen.sampling.logits_process import check_processor_settings
from kvgen.sampling.params import PARAM_RULES, SAMPLING_EPS, check_param


class Strategy(enum.Enum):
    """Decoding strategies, one module each under ``kvgen.generation``."""

    GREEDY = "greedy"
    SAMPLE = "sample"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    GROUP_BEAM_SEARCH = "group_beam_search"
    CONTRASTIVE_SEARCH = "contrastive_search"
    SAMPLE_AND_RANK = "sample_and_rank"
    PROMPT_LOOKUP = "prompt_lookup"  # greedy search or sampling with drafts copied from the sequence (HF "assisted")
    ASSISTED = "assisted"  # greedy search or sampling with drafts from an assistant model (generate(assistant_model=))
    DOLA = "dola"  # greedy search or sampling on logits contrasted with an earlier layer's (kvgen.generation.dola)
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"  # beam search whose output contains given token sequences


_f = config_field
HF_DEFAULT_MAX_LENGTH = 20  # transformers' GenerationConfig.max_length: 20 new tokens when nothing else is set


class _UnsetMaxNewTokens(int):
    """``max_new_tokens``' default, 20, of a type of its own: transformers' default is None, so an explicit
    ``max_new_tokens=20`` wins over ``max_length`` (its own or the model file's) while the default gives way."""


def is_unset_max_new_tokens(value: int) -> bool:
    """Is ``value`` ``GenerationConfig``'s default ``max_new_tokens`` (not an explicit 20)?"""
    return type(value) is _UnsetMaxNewTokens


class _UnsetMinNewTokens(int):
    """``min_new_tokens``' default, 0, of a type of its own: transformers' default is None, and any value it is
    given, an explicit 0 included, replaces ``min_length``."""


class _ModelMinNewTokens(int):
    """A ``min_new_tokens`` taken from the model's generation config: transformers takes one above the run's
    ``max_new_tokens`` (EOS is then suppressed to the end), where the caller's own would contradict it."""


def _model_min_new_tokens(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with an int ``min_new_tokens`` marked as the model's (other values are left for the checks)."""
    value = values.get("min_new_tokens")
    if type(value) is not int:
        return dict(values)
    return {**values, "min_new_tokens": _ModelMinNewTokens(value)}


# generation_config.json keys that become generate()'s defaults (transformers' model.generation_config); others
# (cache_implementation, return_dict_in_generate, ...) are left out.
MODEL_DEFAULT_KEYS = (
    "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "num_beams", "num_beam_groups", "diversity_penalty",
    "length_penalty", "early_stopping", "num_return_sequences", "penalty_alpha", "max_new_tokens", "min_new_tokens",
    "min_length", "max_length",
    "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values", "eos_token_id", "pad_token_id",
)


# transformers 4.55 GenerationConfig fields kvgen does not implement -> what they would do there
UNIMPLEMENTED_HF_FIELDS = {
    "token_healing": "token healing",
    "assistant_early_exit": "self-speculative decoding",
    "assistant_lookbehind": "universal assisted decoding, an assistant with another tokenizer",
    "target_lookbehind": "universal assisted decoding, an assistant with another tokenizer",
    "cache_config": "quantized and offloaded KV caches",
    "return_legacy_cache": "tuple-of-tensors caches",
    "is_assistant": "an assistant model's own generation config",
    "bos_token_id": "generation from no prompt: pass input_ids",
    "decoder_start_token_id": "encoder-decoder models",
}
# transformers GenerationConfig keys that are bookkeeping, not settings
HF_METADATA_KEYS = ("_from_model_config", "transformers_version")
# transformers' special tokens, the only defaults a passed config takes from a file older than 4.50 (kvgen's two)
SPECIAL_TOKEN_KEYS = ("eos_token_id", "pad_token_id")


def defaults_for_given_config(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The model's generation defaults (``CausalLM.generation_defaults``) that fill a ``GenerationConfig`` passed to
    ``generate()``: all of them, but only :data:`SPECIAL_TOKEN_KEYS` when the file's ``transformers_version`` is
    older than 4.50 (transformers 4.55 ``_prepare_generation_config``'s legacy rule; a version that does not parse
    counts as new)."""
    version = re.match(r"\s*v?(\d+)\.(\d+)", str(defaults.get("transformers_version", "")))
    if version is None or (int(version[1]), int(version[2])) >= (4, 50):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in SPECIAL_TOKEN_KEYS}


def check_dola_layers(value: object) -> None:
    """``dola_layers``: 'low', 'high' or a non-empty list of layer indices >= 0 (``ValueError`` otherwise)."""
    if value in ("low", "high"):
        return
    if not isinstance(value, (list, tuple)) or not value or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
        raise ValueError(f"dola_layers must be 'low', 'high' or a non-empty list of layer indices >= 0, got {value!r}")


def check_setting_names(settings: Mapping[str, Any]) -> None:
    """``generate(**settings)``'s names: ``NotImplementedError`` naming a transformers setting kvgen does not
    implement, ``ValueError`` listing names that are no setting at all (as transformers' check of unused
    ``model_kwargs``, where typos show up)."""
    names = {f.name for f in dataclasses.fields(GenerationConfig)}
    for name in settings:
        if name in UNIMPLEMENTED_HF_FIELDS:
            raise NotImplementedError(f"kvgen does not implement transformers' {name} "
                                      f"({UNIMPLEMENTED_HF_FIELDS[name]})")
    if unknown := sorted(set(settings) - names):
        raise ValueError(f"unknown generation setting(s) {unknown}: not GenerationConfig fields (check for typos)")


@dataclass
class GenerationConfig:
    """How ``generate()`` decodes (transformers ``GenerationConfig`` names and defaults).

    Lengths are in tokens, ``max_time`` in seconds. Raises ``ValueError`` for an
    out-of-range value (naming the field and the value; ranges from
    ``kvgen.sampling.params.PARAM_RULES``, shared with ``SamplingParams`` and the
    CLI) or contradictory fields (naming both), and as ``generate(**settings)`` for a keyword that is no field:
    ``NotImplementedError`` naming a transformers setting kvgen lacks (``token_healing``, ...), ``ValueError``
    for any other (a typo).
    """

    max_new_tokens: int = _f(_UnsetMaxNewTokens(20), "maximum number of new tokens to generate")
    max_length: int | None = _f(None, "maximum length, prompt included (used while max_new_tokens is not set)")
    min_new_tokens: int = _f(_UnsetMinNewTokens(0), "EOS is suppressed until this many new tokens exist")
    min_length: int = _f(0, "EOS is suppressed until the sequence, prompt included, is this long (a min_new_tokens "
                         "given, even 0, takes precedence, as in transformers)")
    do_sample: bool = _f(False, "sample from the distribution instead of taking the argmax")
    num_beams: int = _f(1, "beams for beam search (1 = no beam search)")
    num_beam_groups: int = _f(1, "groups for diverse (group) beam search; must divide num_beams")
    diversity_penalty: float = _f(0.0, "group beam search: penalty for tokens chosen by earlier groups")
    penalty_alpha: float | None = _f(None, "contrastive search: degeneration penalty (with top_k > 1)")
    low_memory: bool | None = _f(None, "accepted for transformers' sake: its sequential contrastive search gives the "
                                 "tokens of the batched one kvgen runs")
    length_penalty: float = _f(1.0, "beam score = sum logprob / length**length_penalty")
    early_stopping: bool | str = _f(False, "beam search stop rule: true, false or 'never'")
    num_return_sequences: int = _f(1, "sequences returned per prompt")
    force_words_ids: list[list[int]] | list[list[list[int]]] | None = _f(
        None, "constrained beam search: id lists the output must contain (a list of id lists: any one of them)")
    constraints: list[Any] | None = _f(None, "constrained beam search: PhrasalConstraint / DisjunctiveConstraint "
                                       "objects (kvgen.generation.constraints) the output must fulfil")
    best_of: int | None = _f(None, "sample-and-rank: draw this many samples, return the most likely")
    temperature: float = _f(1.0, "softmax temperature when sampling")
    top_k: int = _f(50, "keep the k most likely tokens when sampling (0 = off)")
    top_p: float = _f(1.0, "nucleus sampling: keep the smallest set with probability >= top_p")
    min_p: float | None = _f(None, "drop tokens below min_p * the top probability")
    typical_p: float = _f(1.0, "locally typical sampling mass (1.0 = off)")
    epsilon_cutoff: float = _f(0.0, "drop tokens with probability below this (0 = off)")
    eta_cutoff: float = _f(0.0, "eta sampling cutoff (0 = off)")
    repetition_penalty: float = _f(1.0, "CTRL repetition penalty over prompt and output (1.0 = off)")
    presence_penalty: float = _f(0.0, "OpenAI presence penalty over generated tokens")
    frequency_penalty: float = _f(0.0, "OpenAI frequency penalty over generated tokens")
    no_repeat_ngram_size: int = _f(0, "forbid repeating any n-gram of this size (0 = off)")
    guidance_scale: float | None = _f(None, "classifier-free guidance: > 1 pushes away from the unconditional "
                                      "(negative-prompt) continuation (1.0 / None = off)")
    encoder_repetition_penalty: float = _f(1.0, "> 1 favours the prompt's tokens, < 1 avoids them (1.0 = off)")
    encoder_no_repeat_ngram_size: int = _f(0, "forbid n-grams of this size that occur in the prompt (0 = off)")
    sequence_bias: dict[tuple[int, ...], float] | None = _f(None, "bias added to the logit of token sequences")
    bad_words_ids: list[list[int]] | None = _f(None, "token sequences that may not be generated")
    suppress_tokens: list[int] | None = _f(None, "token ids that are never generated")
    begin_suppress_tokens: list[int] | None = _f(None, "token ids that may not be the first new token")
    forced_bos_token_id: int | None = _f(None, "token forced after a 1-token input")
    forced_eos_token_id: int | list[int] | None = _f(None, "EOS id(s) forced as the last token at max_new_tokens")
    exponential_decay_length_penalty: tuple[int, float] | None = _f(
        None, "(start, factor): after start new tokens, EOS logits grow by |x| (factor ** n - 1)")
    watermarking_config: Any = _f(None, "green-list watermark (Kirchenbauer et al. 2023): a WatermarkingConfig or its "
                                  "fields, e.g. {\"bias\": 2.0, \"seeding_scheme\": \"selfhash\"}; or SynthID's "
                                  "(a SynthIDTextWatermarkingConfig, or {\"ngram_len\": 5, \"keys\": [...]})")
    remove_invalid_values: bool = _f(False, "replace NaN and inf logits by finite values")
    renormalize_logits: bool = _f(False, "log-softmax the scores after every processor")
    eos_token_id: int | list[int] | None = _f(None, "end-of-sequence token id(s); default: the model's")
    pad_token_id: int | None = _f(None, "id emitted by finished rows; default: the model's, else EOS")
    stop_strings: list[str] | None = _f(None, "stop when the generated text contains one of these", cli_name="stop")
    max_time: float | None = _f(None, "stop after this many seconds")
    output_scores: bool = _f(False, "return processed scores of every step")
    output_logits: bool = _f(False, "return raw logits of every step")
    output_hidden_states: bool = _f(False, "return every layer's input hidden states and the output of every forward")
    output_attentions: bool = _f(False, "return every layer's attention weights of every forward")
    return_dict_in_generate: bool = _f(True, "accepted for compatibility; the output type never changes")
    disable_compile: bool = _f(False, "accepted for compatibility: kvgen compiles no forward (its kernels are built "
                               "ahead)")
    use_cache: bool = _f(True, "reuse keys/values of earlier tokens (False recomputes everything each step)")
    prefill_chunk_size: int | None = _f(
        None, "greedy search and sampling: prefill the prompt this many tokens per forward (less peak memory, the "
        "same tokens)")
    cache_implementation: str = _f("dynamic", "KV cache: 'dynamic' (grows as written) or 'static' (preallocated)")
    seed: int | None = _f(None, "seed of the torch.Generator used when sampling")
    dola_layers: str | list[int] | None = _f(
        None, "DoLa decoding: contrast the last layer with 'low' or 'high' layers, or these layer indices (JSON list)")
    prompt_lookup_num_tokens: int | None = _f(
        None, "prompt lookup decoding: draft up to this many tokens per step from the sequence itself (batch size 1)")
    max_matching_ngram_size: int | None = _f(None, "prompt lookup decoding: longest n-gram looked up (default 2)")
    num_assistant_tokens: int = _f(20, "assisted decoding: tokens the assistant drafts per step, at first")
    num_assistant_tokens_schedule: str = _f(
        "constant", "assisted decoding: 'constant' (the default, as transformers 4.55), 'heuristic' (+2 after a fully "
        "accepted draft, else -1) or 'heuristic_transient' (the same; transformers resets it after each call)")
    assistant_confidence_threshold: float = _f(
        0.4, "assisted decoding: the assistant stops drafting after a token it gives less probability (0 = off)")

    def __new__(cls, *args: Any, **kwargs: Any) -> GenerationConfig:
        # the dataclass __init__ would raise TypeError ("unexpected keyword argument") for a name it lacks
        check_setting_names(kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._check_ranges()
        self._check_combinations()

    def _check_ranges(self) -> None:
        """Every field with a rule in ``kvgen.sampling.params.PARAM_RULES`` (None = unset), then the rest. None in a
        field that is not optional means unset, as in transformers: the field's default (which the model's
        generation config may then replace); a bool field takes bools only."""
        for f in dataclasses.fields(self):
            value, typed = getattr(self, f.name), str(f.type)
            if value is None and "None" not in typed and f.default is not None and f.default is not dataclasses.MISSING:
                setattr(self, f.name, value := f.default)
            if typed in ("bool", "bool | None") and value is not None:
                setattr(self, f.name, value := as_bool(f.name, value))
            if f.name in PARAM_RULES and value is not None:
                check_param(f.name, value)
        if isinstance(self.stop_strings, str):  # one stop string, as transformers takes it (not its characters)
            self.stop_strings = [self.stop_strings]
        eos = self.eos_token_id
        if eos is not None:  # an id, or a list of them ([] disables EOS)
            eos = token_id_list(eos) if hasattr(eos, "tolist") else eos  # a tensor of ids
            checked_token_ids("eos_token_id", eos, single=True, allow_empty=True)
        if self.pad_token_id is not None:
            check_int("pad_token_id", self.pad_token_id, 0)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_assistant_tokens_schedule not in ("heuristic", "heuristic_transient", "constant"):
            raise ValueError("num_assistant_tokens_schedule must be 'heuristic', 'heuristic_transient' or 'constant', "
                             f"got {self.num_assistant_tokens_schedule!r}")
        check_processor_settings(self)
        if self.watermarking_config is not None:
            from kvgen.sampling.watermark import WatermarkingConfig

            self.watermarking_config = WatermarkingConfig.of(self.watermarking_config)
        if self.cache_implementation not in ("dynamic", "static"):
            raise ValueError(f"cache_implementation must be 'dynamic' or 'static', got {self.cache_implementation!r}")
        if isinstance(self.stop_strings, (set, frozenset)):  # transformers' StopStringCriteria iterates any collection
            self.stop_strings = sorted(self.stop_strings, key=str)
        if self.stop_strings is not None and (not isinstance(self.stop_strings, (list, tuple))
                                              or any(not isinstance(s, str) or not s for s in self.stop_strings)):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {self.stop_strings!r}")

    def _check_combinations(self) -> None:
        def clash(a: str, b: str, why: str) -> ValueError:
            return ValueError(f"{a}={getattr(self, a)!r} conflicts with {b}={getattr(self, b)!r}: {why}")

        if self.do_sample and self.temperature < SAMPLING_EPS:
            raise clash("temperature", "do_sample", f"sampling needs temperature >= {SAMPLING_EPS} (0 = greedy)")
        if self.num_beams % self.num_beam_groups != 0:
            raise clash("num_beam_groups", "num_beams", "num_beam_groups must divide num_beams")
        if self.num_beam_groups > 1 and self.do_sample:
            raise clash("num_beam_groups", "do_sample", "group beam search does not sample")
        if self.num_beam_groups > 1 and self.diversity_penalty == 0.0:  # transformers 4.55 refuses both
            raise clash("num_beam_groups", "diversity_penalty", "groups without a diversity penalty are identical")
        if self.num_beam_groups == 1 and self.diversity_penalty != 0.0:
            raise clash("diversity_penalty", "num_beam_groups", "the penalty works between groups: set "
                        "num_beam_groups > 1")
        if self.penalty_alpha is not None and self.penalty_alpha > 0:
            if self.do_sample:
                raise clash("penalty_alpha", "do_sample", "contrastive search is deterministic")
            if self.num_beams > 1:
                raise clash("penalty_alpha", "num_beams", "contrastive search does not use beams")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise clash("num_return_sequences", "num_beams", "cannot return more sequences than beams")
        if self.best_of is not None and self.num_return_sequences > self.best_of:  # as SamplingParams' n <= best_of
            raise clash("num_return_sequences", "best_of", "cannot return more sequences than samples")
        if self.best_of is not None and self.best_of > 1:
            if not self.do_sample:
                raise clash("best_of", "do_sample", "sample-and-rank needs do_sample=True")
            if self.num_beams > 1:
                raise clash("best_of", "num_beams", "sample-and-rank does not use beams")
        deterministic = self.strategy in (Strategy.GREEDY, Strategy.CONTRASTIVE_SEARCH) or (
            self.strategy is Strategy.DOLA and not self.do_sample)
        if self.num_return_sequences > 1 and deterministic:
            raise clash("num_return_sequences", "do_sample", "deterministic decoding returns one sequence per prompt")
        if self.min_new_tokens > self.max_new_tokens and type(self.min_new_tokens) is not _ModelMinNewTokens:
            raise clash("min_new_tokens", "max_new_tokens", "min_new_tokens must not exceed max_new_tokens")
        if self.force_words_ids is not None or self.constraints is not None:
            self._check_constrained(clash)
        if self.dola_layers is not None:
            check_dola_layers(self.dola_layers)
            if self._base_strategy() not in (Strategy.GREEDY, Strategy.SAMPLE) or self.prompt_lookup_num_tokens:
                raise ValueError(f"dola_layers works with greedy search or sampling only, got "
                                 f"{self.strategy.value} settings (transformers ignores it then)")
        if self.prefill_chunk_size is not None:
            if self.strategy not in (Strategy.GREEDY, Strategy.SAMPLE):
                raise ValueError(f"prefill_chunk_size works with greedy search or sampling only (transformers "
                                 f"ignores it otherwise), got {self.strategy.value} settings")
            if not self.use_cache:
                raise clash("prefill_chunk_size", "use_cache", "chunks of the prompt are kept in the KV cache")
        if self.prompt_lookup_num_tokens is not None:
            base = self._base_strategy()
            if base not in (Strategy.GREEDY, Strategy.SAMPLE):
                raise ValueError(f"prompt_lookup_num_tokens={self.prompt_lookup_num_tokens} works with greedy search "
                                 f"or sampling only, got {base.value} settings")
            if self.num_return_sequences > 1:
                raise clash("num_return_sequences", "prompt_lookup_num_tokens", "prompt lookup returns one sequence")

    def _check_constrained(self, clash: Any) -> None:
        """Constrained beam search: well-formed constraints, beams, no sampling, no groups (transformers 4.55)."""
        from kvgen.generation.constraints import build_constraints

        if not build_constraints(self.force_words_ids, self.constraints):
            raise ValueError("constraints must hold at least one constraint, got []")
        if self.num_beams < 2:
            raise ValueError(f"constrained beam search (force_words_ids / constraints) needs num_beams > 1, got "
                             f"{self.num_beams}")
        if self.do_sample:
            raise clash("do_sample", "num_beams", "constrained beam search does not sample")
        if self.num_beam_groups > 1:
            raise clash("num_beam_groups", "num_beams", "constrained beam search uses one group")

    @property
    def strategy(self) -> Strategy:
        """The decoding strategy these settings select (transformers 4.55 rules: prompt lookup extends greedy search
        and sampling, and only them)."""
        base = self._base_strategy()
        if self.prompt_lookup_num_tokens is not None and base in (Strategy.GREEDY, Strategy.SAMPLE):
            return Strategy.PROMPT_LOOKUP
        if self.dola_layers is not None and base in (Strategy.GREEDY, Strategy.SAMPLE):
            return Strategy.DOLA
        return base

    def _base_strategy(self) -> Strategy:
        """The strategy without prompt lookup (transformers' ``get_generation_mode`` before assisted generation)."""
        if self.force_words_ids is not None or self.constraints is not None:
            return Strategy.CONSTRAINED_BEAM_SEARCH
        if self.num_beams > 1:
            if self.num_beam_groups > 1:
                return Strategy.GROUP_BEAM_SEARCH
            return Strategy.BEAM_SAMPLE if self.do_sample else Strategy.BEAM_SEARCH
        if self.penalty_alpha is not None and self.penalty_alpha > 0 and self.top_k > 1 and not self.do_sample:
            return Strategy.CONTRASTIVE_SEARCH
        if self.do_sample:
            return Strategy.SAMPLE_AND_RANK if (self.best_of or 1) > 1 else Strategy.SAMPLE
        return Strategy.GREEDY

    def with_prompt_length(self, prompt_length: int) -> GenerationConfig:
        """``max_length`` (total tokens) as ``max_new_tokens`` for prompts of ``prompt_length`` columns, where
        ``max_new_tokens`` was left at its default (transformers' ``_prepare_generated_length``). Raises ValueError
        when ``max_length`` does not exceed ``prompt_length``, as transformers 4.55. A ``min_new_tokens`` the caller
        set, even 0, drops ``min_length`` (transformers makes it ``prompt_length + min_new_tokens``)."""
        if self.min_length and type(self.min_new_tokens) is not _UnsetMinNewTokens:
            return self.replace(min_length=0).with_prompt_length(prompt_length)
        if self.max_length is None or not is_unset_max_new_tokens(self.max_new_tokens):
            return self
        if self.max_length <= prompt_length:  # transformers 4.55 _validate_generated_length
            raise ValueError(f"max_length={self.max_length} leaves no room after the prompt's {prompt_length} "
                             f"tokens: raise it or set max_new_tokens")
        is_models = type(self.min_new_tokens) is _ModelMinNewTokens  # transformers lets the model's exceed the room
        if self.min_new_tokens > self.max_length - prompt_length and not is_models:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} conflicts with max_length={self.max_length}: the "
                             f"prompt's {prompt_length} tokens leave {self.max_length - prompt_length} new tokens")
        return self.replace(max_new_tokens=self.max_length - prompt_length)

    def with_generation_defaults(self, defaults: Mapping[str, Any]) -> GenerationConfig:
        """These settings with each field still at its default taking the model's value (transformers 4.55
        ``_prepare_generation_config``: the model's generation config fills what the caller left at the global
        default; ``temperature=0.0`` keeps ``do_sample=False`` over the model's). ``defaults``:
        ``CausalLM.generation_defaults``."""
        plain = GenerationConfig()

        def unset(k: str) -> bool:  # an explicit max_new_tokens=20 or min_new_tokens=0 is the caller's (transformers'
            if k == "max_new_tokens":  # defaults are None)
                return is_unset_max_new_tokens(self.max_new_tokens)
            if k == "min_new_tokens":
                return type(self.min_new_tokens) is _UnsetMinNewTokens
            if k == "max_length":  # transformers' default is 20: a config's 20 is indistinguishable from it
                return self.max_length in (None, HF_DEFAULT_MAX_LENGTH)
            return getattr(self, k) == getattr(plain, k)

        changes = _model_min_new_tokens({k: v for k, v in defaults.items()
                                         if k not in HF_METADATA_KEYS and unset(k) and v != getattr(plain, k)})
        if self.temperature == 0.0:  # greedy, though the model samples (transformers' edge case: do_sample=False)
            changes.pop("do_sample", None)
        return self.replace(**changes) if changes else self

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (empty when none is set)."""
        return token_id_list(self.eos_token_id)

    def replace(self, **changes: Any) -> GenerationConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def with_model_defaults(self, eos_token_ids: list[int], pad_token_id: int | None) -> GenerationConfig:
        """Fill ``eos_token_id`` / ``pad_token_id`` from the model when unset (pad falls back to EOS, as HF)."""
        eos = self.eos_token_id if self.eos_token_id is not None else (list(eos_token_ids) or None)
        pad = self.pad_token_id
        if pad is None and pad_token_id is not None and pad_token_id >= 0:  # some configs say -1 for "none"
            pad = pad_token_id
        if pad is None:
            eos_ids = token_id_list(eos)  # [] disables EOS: no pad from it
            pad = eos_ids[0] if eos_ids else None
        return self.replace(eos_token_id=eos, pad_token_id=pad)


def read_generation_defaults(path: Path) -> dict[str, Any]:
    """The :data:`MODEL_DEFAULT_KEYS` of a ``generation_config.json`` ({} when the file is absent), checked as
    ``GenerationConfig`` checks them, and its ``transformers_version`` when a string (see
    :func:`defaults_for_given_config`). Raises ``ModelFormatError`` naming the file for bad JSON or a bad value."""
    from kvgen.errors import ModelFormatError
    from kvgen.tokenizer.hf_files import read_json

    if not path.is_file():
        return {}
    raw = read_json(path)
    values = {k: raw[k] for k in MODEL_DEFAULT_KEYS if raw.get(k) is not None}
    if values.get("max_length") == HF_DEFAULT_MAX_LENGTH:  # transformers reads its own default as 20 new tokens
        del values["max_length"]
    if isinstance(values.get("exponential_decay_length_penalty"), list):
        values["exponential_decay_length_penalty"] = tuple(values["exponential_decay_length_penalty"])
    try:  # the model's min_new_tokens may exceed any max_new_tokens (transformers suppresses EOS to the end)
        GenerationConfig(**_model_min_new_tokens(values))
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}: {e}") from None
    if isinstance(raw.get("transformers_version"), str):
        values["transformers_version"] = raw["transformers_version"]
    return values
