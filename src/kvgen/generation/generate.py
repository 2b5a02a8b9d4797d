"""``generate()``: the Hugging Face-style offline entry point.

Validates the batch, fills model defaults into the config, builds the logits
processors and stopping checks, then dispatches on ``config.strategy`` through
an explicit table (one module per strategy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvgen.errors import ContextLengthError
from kvgen.generation.assisted import assisted_decoding
from kvgen.generation.beam_sample import beam_sample
from kvgen.generation.beam_search import beam_search
from kvgen.generation.config import (
    HF_DEFAULT_MAX_LENGTH,
    GenerationConfig,
    Strategy,
    check_setting_names,
    defaults_for_given_config,
)
from kvgen.generation.constrained_beam_search import constrained_beam_search
from kvgen.generation.contrastive_search import contrastive_search
from kvgen.generation.decoding import LoopContext
from kvgen.generation.dola import dola_decoding, premature_layers
from kvgen.generation.greedy import greedy_search
from kvgen.generation.group_beam_search import group_beam_search
from kvgen.generation.guidance import UnconditionalBranch
from kvgen.generation.output import GenerateOutput
from kvgen.generation.prompt_lookup import prompt_lookup_decoding
from kvgen.generation.runner import StepRunner
from kvgen.generation.sample import multinomial_sample
from kvgen.generation.sample_and_rank import sample_and_rank
from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.models import CausalLM, cache_dtypes
from kvgen.models.recording import ForwardRecorder
from kvgen.sampling.logits_process import build_logits_processors
from kvgen.sampling.stopping import StopChecker, StopStrings, TokenStops

STRATEGIES: dict[Strategy, Callable[[StepRunner, LoopContext], GenerateOutput]] = {
    Strategy.GREEDY: greedy_search,
    Strategy.SAMPLE: multinomial_sample,
    Strategy.BEAM_SEARCH: beam_search,
    Strategy.BEAM_SAMPLE: beam_sample,
    Strategy.GROUP_BEAM_SEARCH: group_beam_search,
    Strategy.CONTRASTIVE_SEARCH: contrastive_search,
    Strategy.SAMPLE_AND_RANK: sample_and_rank,
    Strategy.PROMPT_LOOKUP: prompt_lookup_decoding,
    Strategy.ASSISTED: assisted_decoding,
    Strategy.DOLA: dola_decoding,
    Strategy.CONSTRAINED_BEAM_SEARCH: constrained_beam_search,
}

# Strategies that keep several hypotheses per prompt and pick among them at the end: nothing to stream.
NOT_STREAMABLE = (Strategy.BEAM_SEARCH, Strategy.BEAM_SAMPLE, Strategy.GROUP_BEAM_SEARCH,
                  Strategy.CONSTRAINED_BEAM_SEARCH, Strategy.SAMPLE_AND_RANK)
# Strategies that verify several drafted tokens per forward: no per-token hidden states or attention weights.
NOT_RECORDABLE = (Strategy.PROMPT_LOOKUP, Strategy.ASSISTED)


def generate(
    model: CausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    tokenizer: Any = None,
    streamer: Any = None,
    logits_processor: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = (),
    assistant_model: CausalLM | None = None,
    past_key_values: StaticCache | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    **overrides: Any,
) -> GenerateOutput:
    """Generate continuations of a left-padded batch of prompts.

    input_ids: [B, T] int64; attention_mask: [B, T] (1 = token, 0 = left pad) or
    None: no padding, unless rows start with ``pad_token_id`` (no EOS id), whose leading run is then the padding
    (as transformers infers the mask). ``overrides`` are GenerationConfig fields. Sampling
    uses ``generator`` or, if None, a ``torch.Generator`` seeded with
    ``config.seed`` (fresh default generator when both are None). ``tokenizer``
    is needed for ``stop_strings``; ``streamer`` gets ``put(ids)`` / ``end()``.
    ``logits_processor``: the caller's own processors ``(token_ids [B, T], logits [B, V]) -> [B, V]``,
    run after the built ones and before the sampling warpers (as transformers merges them).
    ``assistant_model``: a smaller model with the same vocabulary that drafts tokens (assisted decoding, batch
    size 1, greedy search or sampling: :mod:`kvgen.generation.assisted`).
    ``past_key_values``: a ``DynamicCache`` / ``StaticCache`` (``make_cache``) holding the keys and values of the
    first ``S = seq_length`` tokens of every row of an unpadded ``input_ids`` (S < T): only the last T - S tokens are
    prefilled (transformers' reuse of a cache across chat turns; ``cache_implementation`` is then unused). With
    one row per prompt (or per sample), the cache is left holding every column of ``sequences`` but the last, ready
    for the next turn (``cache.crop(n)`` keeps a shorter prefix); beams and ranked samples (``best_of``) leave it one
    row per returned row holding its prompt.
    ``negative_prompt_ids`` [N, S] (``negative_prompt_attention_mask`` [N, S]): with ``guidance_scale``, the
    unconditional sequence of classifier-free guidance, one row per generated row (default: each row's last prompt
    token), as transformers.
    Returns a :class:`GenerateOutput`. Raises ``TypeError`` for a model or generation_config of another kind,
    ``ValueError`` for bad shapes or settings (an unknown setting name too), ``NotImplementedError`` for a
    transformers setting kvgen does not
    implement (``token_healing``, ``assistant_early_exit``, hidden states of drafting strategies, ...) and
    ``ContextLengthError`` when
    prompt + ``max_new_tokens`` exceeds the model's context window.
    Reference: transformers 4.55 ``GenerationMixin.generate``.
    """
    if not hasattr(model, "generation_defaults") or not hasattr(model, "config"):
        raise TypeError(f"model must be a kvgen model (kvgen.load_model), got {type(model).__name__}")
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a kvgen.GenerationConfig (its fields may also be passed as keyword "
                        f"arguments), got {type(generation_config).__name__}")
    _check_callbacks(streamer, generator)
    defaults = model.generation_defaults if generation_config is None else defaults_for_given_config(
        model.generation_defaults)
    cfg = (generation_config or GenerationConfig()).with_generation_defaults(defaults)
    if overrides:
        check_setting_names(overrides)
        cfg = cfg.replace(**overrides)
    if generation_config is not None and "max_length" not in overrides and cfg.max_length == HF_DEFAULT_MAX_LENGTH:
        cfg = cfg.replace(max_length=None)  # transformers' default 20, not passed as a keyword: 20 new tokens
    model_cfg = model.config
    cfg = cfg.with_model_defaults(model_cfg.eos_token_ids, model_cfg.pad_token_id)
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, cfg)
    input_ids, attention_mask = _check_batch(input_ids, attention_mask, model_cfg)
    if negative_prompt_ids is not None:
        negative_prompt_ids, negative_prompt_attention_mask = _check_batch(
            negative_prompt_ids, negative_prompt_attention_mask, model_cfg,
            ("negative_prompt_ids", "negative_prompt_attention_mask"))
    _check_forced_token_ids(cfg, model_cfg.vocab_size)
    cfg = cfg.with_prompt_length(input_ids.shape[1])
    longest = int(attention_mask.sum(-1).max())
    if longest + cfg.max_new_tokens > model_cfg.max_position_embeddings:
        raise ContextLengthError(
            f"prompt of {longest} tokens plus max_new_tokens={cfg.max_new_tokens} exceeds the context window of "
            f"{model_cfg.max_position_embeddings} tokens"
        )
    strategy = cfg.strategy if assistant_model is None else _assisted_strategy(cfg, model, assistant_model, longest)
    if strategy not in STRATEGIES:
        raise NotImplementedError(f"decoding strategy {strategy.value} is not implemented yet")
    if streamer is not None and strategy in NOT_STREAMABLE:
        raise ValueError(f"streamer cannot be used with {strategy.value} (it picks among hypotheses at the end)")
    if strategy in (Strategy.PROMPT_LOOKUP, Strategy.ASSISTED) and cfg.guidance_scale not in (None, 1.0):
        raise ValueError(f"guidance_scale cannot be used with {strategy.value} decoding (it verifies several tokens "
                         "per forward; the unconditional branch advances one token per step)")
    if strategy in (Strategy.PROMPT_LOOKUP, Strategy.ASSISTED) and input_ids.shape[0] != 1:
        what = "assistant_model" if strategy is Strategy.ASSISTED else "prompt_lookup_num_tokens"
        raise ValueError(f"{what} needs a batch of one prompt (as transformers), got {input_ids.shape[0]}")
    copies, prompt_ids = _num_copies(cfg), input_ids  # prompt_ids [B, T]: the encoder_* processors' (unexpanded)
    if copies > 1:
        input_ids = input_ids.repeat_interleave(copies, dim=0)  # [B*n, T]
        attention_mask = attention_mask.repeat_interleave(copies, dim=0)  # [B*n, T]
    if generator is None and cfg.do_sample:
        generator = torch.Generator()
        generator.manual_seed(cfg.seed) if cfg.seed is not None else generator.seed()
    if past_key_values is not None:
        _check_past(past_key_values, model, cfg, strategy, input_ids, attention_mask)
    cache_kind = cfg.cache_implementation if cfg.use_cache else None
    recorder = _recorder(cfg, strategy, model)
    runner = StepRunner(model, input_ids, attention_mask, cache_kind, _cache_room(cfg, strategy), prefill_copies=copies,
                        cache=past_key_values, recorder=recorder, prefill_chunk_size=cfg.prefill_chunk_size)
    ctx = LoopContext(
        config=cfg,
        processors=build_logits_processors(
            cfg, prompt_length=input_ids.shape[1], custom=logits_processor, prompt_ids=prompt_ids,
            unconditional_logits=UnconditionalBranch(model, negative_prompt_ids, negative_prompt_attention_mask)),
        stopper=_stopper(cfg, input_ids.shape[1], tokenizer),
        generator=generator,
        streamer=streamer,
        assistant=assistant_model,
    )
    if streamer is not None:
        streamer.put(input_ids)
    with recorder or contextlib.nullcontext():
        out = STRATEGIES[strategy](runner, ctx)
    if recorder is not None and recorder.keep_steps:
        out.hidden_states = recorder.hidden_states_per_step() if cfg.output_hidden_states else None
        out.attentions = recorder.attentions_per_step() if cfg.output_attentions else None
    if past_key_values is not None:
        _settle_cache(past_key_values, out, copies, strategy, input_ids.shape[1])
    return out


def _settle_cache(cache: StaticCache, out: GenerateOutput, copies: int, strategy: Strategy, prompt_length: int) -> None:
    """Leave ``cache`` ready to continue ``out.sequences`` [N, T']: one row per prompt, or per sample, holding every
    column but the last; after beams or ranked samples (whose rows at the last step are hypotheses in search order,
    not the returned rows) one row per returned row holding its prompt's T columns."""
    if copies == 1 or strategy is Strategy.SAMPLE:  # drafting strategies may leave rejected drafts after the kept
        cache.crop(out.sequences.shape[1] - 1)
        return
    num_prompts = cache.layer_shape()[0] // copies
    per_prompt = out.sequences.shape[0] // num_prompts
    cache.reorder(torch.arange(num_prompts).repeat_interleave(per_prompt) * copies)  # [N]: a row of each prompt
    cache.crop(prompt_length)


def _recorder(cfg: GenerationConfig, strategy: Strategy, model: CausalLM) -> ForwardRecorder | None:
    """What the forwards record: every layer's input and the output (``output_hidden_states``), attention weights
    (``output_attentions``), DoLa's premature layers (its latest step only, unless asked for more); None: nothing.
    Raises ``NotImplementedError`` for hidden states or attentions of a strategy in ``NOT_RECORDABLE``, and
    ``ValueError`` for ``dola_layers`` that leave no layer."""
    asked = cfg.output_hidden_states or cfg.output_attentions
    if asked and strategy in NOT_RECORDABLE:
        raise NotImplementedError(f"output_hidden_states / output_attentions are not implemented for "
                                  f"{strategy.value} decoding")
    num_layers = model.config.num_hidden_layers
    layers = set(range(num_layers)) if cfg.output_hidden_states else set()
    if strategy is Strategy.DOLA:
        assert cfg.dola_layers is not None  # the strategy exists only with them
        layers |= set(premature_layers(cfg.dola_layers, num_layers, model.config.tie_word_embeddings))
    if not layers and not cfg.output_attentions:
        return None
    return ForwardRecorder(model, layers, final=cfg.output_hidden_states, attentions=cfg.output_attentions,
                           keep_steps=asked)


def _assisted_strategy(cfg: GenerationConfig, model: CausalLM, assistant: Any, longest: int) -> Strategy:
    """``Strategy.ASSISTED`` after checking the assistant. Raises ValueError for settings it cannot serve (as
    transformers: greedy search or sampling of one sequence) or an assistant with another vocabulary size, and
    ``ContextLengthError`` when the prompt and ``max_new_tokens`` exceed the assistant's context."""
    if not isinstance(assistant, CausalLM):
        raise ValueError(f"assistant_model must be a kvgen model (load_model), got {type(assistant).__name__}")
    strategy = cfg.strategy
    if strategy not in (Strategy.GREEDY, Strategy.SAMPLE) or cfg.num_return_sequences > 1:
        raise ValueError(f"assistant_model works with greedy search or sampling of one sequence, got {strategy.value} "
                         f"settings (num_return_sequences={cfg.num_return_sequences})")
    ours, theirs = model.config, assistant.config
    if theirs.vocab_size != ours.vocab_size:
        raise ValueError(f"assistant_model must share the model's vocabulary: vocab_size {theirs.vocab_size} != "
                         f"{ours.vocab_size}")
    if longest + cfg.max_new_tokens > theirs.max_position_embeddings:
        raise ContextLengthError(f"prompt of {longest} tokens plus max_new_tokens={cfg.max_new_tokens} exceeds the "
                                 f"assistant model's context window of {theirs.max_position_embeddings} tokens")
    return Strategy.ASSISTED


def _check_past(cache: Any, model: CausalLM, cfg: GenerationConfig, strategy: Strategy, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``cache`` can carry ``input_ids``' first tokens into this generation, and
    ``ContextLengthError`` when a ``StaticCache`` cannot hold the prompt and ``max_new_tokens``."""
    if not isinstance(cache, StaticCache):
        raise ValueError(f"past_key_values must be a kvgen DynamicCache or StaticCache (make_cache), got "
                         f"{type(cache).__name__}")
    if not cfg.use_cache:
        raise ValueError("past_key_values needs use_cache=True")
    if strategy is Strategy.CONTRASTIVE_SEARCH:  # its degeneration penalty needs the hidden states of every token
        raise ValueError("past_key_values cannot be used with contrastive search")
    m, (rows, heads, _, head_dim) = model.config, cache.layer_shape()
    if (cache.num_layers, heads, head_dim) != (m.num_hidden_layers, m.num_key_value_heads, m.head_dim) or (
            cache.key_cache[0].dtype not in cache_dtypes(model).values()):
        raise ValueError(f"past_key_values was not made for this model (make_cache(model)): {cache.num_layers} layers "
                         f"of [B, {heads}, S, {head_dim}] {cache.key_cache[0].dtype}")
    if rows != input_ids.shape[0] // _num_copies(cfg):
        raise ValueError(f"past_key_values holds {rows} rows; input_ids has {input_ids.shape[0] // _num_copies(cfg)} "
                         f"prompts")
    tokens = input_ids.shape[1]
    if not bool(attention_mask.all()):
        raise ValueError("past_key_values needs an unpadded batch (attention_mask of ones)")
    if cache.seq_length >= tokens:
        raise ValueError(f"past_key_values holds {cache.seq_length} tokens; input_ids ({tokens} tokens) must extend "
                         f"them by at least one")
    if not isinstance(cache, DynamicCache) and tokens + _cache_room(cfg, strategy) > cache.max_cache_len:
        raise ContextLengthError(f"past_key_values is a StaticCache of {cache.max_cache_len} tokens; the prompt of "
                                 f"{tokens} plus max_new_tokens={cfg.max_new_tokens} does not fit"
                                 + (" with the drafts" if _cache_room(cfg, strategy) > cfg.max_new_tokens else ""))


def _cache_room(cfg: GenerationConfig, strategy: Strategy) -> int:
    """Slots after the prompt a KV cache needs: ``max_new_tokens``, and ``prompt_lookup_num_tokens`` more for
    sampled prompt lookup, whose drafts run past the room left (as transformers', whose draws depend on them)."""
    if strategy is Strategy.PROMPT_LOOKUP and cfg.do_sample:
        return cfg.max_new_tokens + (cfg.prompt_lookup_num_tokens or 0)
    return cfg.max_new_tokens


def _num_copies(cfg: GenerationConfig) -> int:
    """Rows per prompt the strategy runs: beams, returned samples, or samples to rank."""
    strategy = cfg.strategy
    if strategy in (Strategy.BEAM_SEARCH, Strategy.BEAM_SAMPLE, Strategy.GROUP_BEAM_SEARCH,
                    Strategy.CONSTRAINED_BEAM_SEARCH):
        return cfg.num_beams
    if strategy is Strategy.SAMPLE_AND_RANK:
        return cfg.best_of or 1
    return cfg.num_return_sequences if strategy is Strategy.SAMPLE else 1


def _check_callbacks(streamer: Any, generator: Any) -> None:
    """``TypeError`` naming the argument for a ``streamer`` without callable ``put`` and ``end`` or a ``generator``
    that is neither a ``torch.Generator`` nor a list of them (one per row, None for torch's default): transformers
    fails with an AttributeError at the first ``put`` (or at ``end``, after the whole generation)."""
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        raise TypeError(f"streamer must have put(token_ids) and end() methods (a transformers streamer), got "
                        f"{type(streamer).__name__}")
    rows = generator if isinstance(generator, (list, tuple)) else [generator]
    if not all(g is None or isinstance(g, torch.Generator) for g in rows):
        raise TypeError(f"generator must be a torch.Generator, a list of them (one per row) or None, got {generator!r}")


def _check_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, model_cfg: Any,
    names: tuple[str, str] = ("input_ids", "attention_mask"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) as int64 after checking them: ids [B, T] integer tokens in [0, V); mask None (all ones) or [B, T]
    of 0 and 1, left-padded, no empty row. ``names``: the arguments' names in the messages."""
    ids_name, mask_name = names
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"{ids_name} must be a 2-D tensor [B, T], got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError(f"{ids_name} must hold at least one token per row, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"{ids_name} must hold integer token ids, got {input_ids.dtype}")
    input_ids = input_ids.long()
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= model_cfg.vocab_size:
        raise ValueError(f"{ids_name} must be in [0, {model_cfg.vocab_size}), got values in [{int(input_ids.min())}, "
                         f"{int(input_ids.max())}]")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):  # e.g. a GenerationConfig in HF's second place
        raise ValueError(f"{mask_name} must be a tensor [B, T] or None, got {type(attention_mask).__name__} "
                         f"(pass a GenerationConfig as generation_config=...)")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"{mask_name} shape {tuple(attention_mask.shape)} must equal {ids_name} shape "
                         f"{tuple(input_ids.shape)}")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError(f"{mask_name} must hold 0 (padding) and 1 (token) only")
    attention_mask = attention_mask.long()
    if bool((attention_mask.sum(-1) == 0).any()):
        raise ValueError(f"{mask_name} has a row with no tokens")
    if bool((attention_mask[:, :-1] > attention_mask[:, 1:]).any()):
        raise ValueError(f"{mask_name} must be left-padded (zeros only before the first token of each row)")
    return input_ids, attention_mask


def _inferred_attention_mask(input_ids: Any, cfg: GenerationConfig) -> torch.Tensor | None:
    """The mask of ``input_ids`` [B, T] given without one: 0 over each row's leading run of ``pad_token_id`` (left
    padding) when that id is no EOS id, as transformers 4.55 ``_prepare_attention_mask_for_generation`` infers it;
    None (no padding) when no row starts with it. The id after a row's first token stays a token (a chat template's
    ``<|im_end|>`` that is the pad id: transformers would mask it too, which left padding cannot express). Raises
    ``ValueError`` for a row of pad tokens only."""
    pad = cfg.pad_token_id
    if pad is None or pad in cfg.eos_token_ids or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return None  # (bad input_ids are _check_batch's to name)
    if input_ids.numel() == 0 or not bool((input_ids[:, 0] == pad).any()):
        return None
    leading = (input_ids == pad).long().cumprod(dim=-1).bool()  # [B, T]: each row's leading pads
    if bool(leading.all(dim=-1).any()):
        raise ValueError(f"a row of input_ids holds only pad_token_id={pad} and no attention_mask was given: it has no "
                         f"token to continue")
    return (~leading).long()  # [B, T]


def _check_forced_token_ids(cfg: GenerationConfig, vocab_size: int) -> None:
    """``ValueError`` for a forced BOS / EOS id past the vocabulary: its processor would leave no token (transformers
    fails with an IndexError there). Suppressed ids past it are ignored, as transformers ignores them."""
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        value = getattr(cfg, name)
        for token_id in [] if value is None else [value] if isinstance(value, int) else value:
            if token_id >= vocab_size:
                raise ValueError(f"{name} must be a token id in [0, {vocab_size}), got {token_id}")


def _stopper(cfg: GenerationConfig, prompt_length: int, tokenizer: Any) -> StopChecker:
    """EOS ids, max_new_tokens, stop strings and max_time (the clock starts now)."""
    if cfg.stop_strings and tokenizer is None:
        raise ValueError("stop_strings needs a tokenizer: pass generate(..., tokenizer=tok)")
    if cfg.stop_strings and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must have a decode(token_ids) method (stop_strings), got {type(tokenizer).__name__}")
    return StopChecker(
        TokenStops(eos_token_ids=tuple(cfg.eos_token_ids), max_new_tokens=cfg.max_new_tokens),
        prompt_length,
        stop_strings=StopStrings(tuple(cfg.stop_strings)) if cfg.stop_strings else None,
        decode=tokenizer.decode if cfg.stop_strings else None,
        max_time=cfg.max_time,
    )
