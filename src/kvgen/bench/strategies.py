"""``kvgen bench strategies``: tokens/s of every decoding strategy, kvgen vs transformers, on ``PROMPTS`` as one
left-padded batch; exactly ``new_tokens`` per prompt, seeded sampling, a 2-token warm-up then one timed run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvgen.bench import BenchConfig, BenchReport
from kvgen.bench import harness as h
from kvgen.bench.peers import load_transformers, pad_token_id
from kvgen.bench.workloads import PROMPTS, left_padded
from kvgen.fields import config_field as _f
from kvgen.generation import GenerationConfig, generate
from kvgen.loader import load_model

SCHEMA = "kvgen.bench.strategies/1"
STRATEGY_SETTINGS: dict[str, dict[str, Any]] = {  # GenerationConfig fields; transformers gets the same
    "greedy": {},
    "sample": {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "beam_search": {"num_beams": 4},
    "beam_sample": {"num_beams": 4, "do_sample": True, "temperature": 0.8},
    "group_beam_search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "constrained_beam_search": {"num_beams": 4, "force_words_ids": [[28]]},  # id 28: "," in GPT-2-style vocabularies
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "sample_and_rank": {"do_sample": True, "temperature": 0.8, "best_of": 4},  # transformers has no best_of
    "dola": {"dola_layers": "high", "repetition_penalty": 1.2},
    "classifier_free_guidance": {"guidance_scale": 1.5},
}
SIDES = tuple(f"strategies.{name}" for name in STRATEGY_SETTINGS)  # the columns of its text table (harness.render)


@dataclass
class StrategiesBenchConfig(BenchConfig):
    """What ``run_strategies_bench`` measures. Raises ``ValueError`` for ``new_tokens < 2`` or no prompts."""

    new_tokens: int = _f(40, "tokens generated per prompt and strategy", minimum=2)
    prompts: tuple[str, ...] = _f(PROMPTS, "the prompts of the batch", cli=False)
    include_transformers: bool = _f(True, "time transformers")
    seed: int = _f(0, "seed of the sampling strategies", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prompts:
            raise ValueError("prompts must hold at least one prompt, got none")


@dataclass
class StrategyRun:
    """One timed ``generate`` of one engine (seconds, tokens/s)."""

    seconds: float
    num_new_tokens: int
    tokens_per_s: float | None
    model_prefill_s: float | None = h.optional()
    model_decode_s: float | None = h.optional()


def measure(model: Any, batch: tuple[torch.Tensor, torch.Tensor], settings: dict[str, Any],
            config: StrategiesBenchConfig) -> tuple[StrategyRun, list[list[int]]]:
    """Time kvgen's or (for a transformers ``model``) transformers' ``generate`` on ids, mask [B, T]; its new ids."""
    ids, mask = batch
    is_ours = not hasattr(model, "generation_config")

    def run(n: int) -> Any:
        if is_ours:
            # the settings as keyword arguments, as transformers gets them: over the model's generation config
            return generate(model, ids, mask, GenerationConfig(max_new_tokens=n, min_new_tokens=n, seed=config.seed),
                            **settings)
        torch.manual_seed(config.seed)
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  pad_token_id=pad_token_id(model), **settings)

    run(2)  # warm-up
    out, seconds = h.timed(lambda: run(config.new_tokens))
    new_ids: list[list[int]] = out.new_token_ids if is_ours else out[:, ids.shape[1]:].tolist()  # [B, new_tokens]
    timings = (out.timings.prefill_s, out.timings.decode_s) if is_ours else (None, None)
    num_new = sum(map(len, new_ids))
    return StrategyRun(seconds, num_new, h.per_second(num_new, seconds), *timings), new_ids


def _measure_strategy(name: str, models: tuple[Any, Any], batch: tuple[torch.Tensor, torch.Tensor],
                      config: StrategiesBenchConfig, log: h.Progress) -> dict[str, Any]:
    settings = STRATEGY_SETTINGS[name]
    rows = settings["top_k"] if "penalty_alpha" in settings else settings.get("num_beams", settings.get("best_of", 1))
    log(f"{name}: kvgen")
    ours, our_ids = measure(models[0], batch, settings, config)
    theirs: h.Side = {"skipped": "include_transformers=False" if models[1] is None else "transformers has no best_of"}
    their_ids = None
    if models[1] is not None and "best_of" not in settings:
        log(f"{name}: transformers")
        try:
            run, their_ids = measure(models[1], batch, settings, config)
            theirs = h.to_json(run)
        except Exception as e:  # noqa: BLE001 -- a strategy transformers rejects is reported, the others still run
            theirs = {"error": f"{type(e).__name__}: {e}"}
    return {"settings": settings, "rows_per_step": rows * batch[0].shape[0], "kvgen": h.to_json(ours), "transformers":
            theirs, "ratio_kvgen_over_transformers": h.ratio(ours.tokens_per_s, theirs.get("tokens_per_s")),
            "tokens_identical_to_transformers": None if their_ids is None else our_ids == their_ids}


@dataclass
class StrategiesReport(BenchReport):
    """``run_strategies_bench``'s result: per strategy its settings, runs, ratio (> 1: kvgen faster), agreement."""

    strategies: dict[str, dict[str, Any]]


def run_strategies_bench(config: StrategiesBenchConfig) -> StrategiesReport:
    """Tokens/s of each decoding strategy on ``config.model``, kvgen and (where it has it) transformers."""
    log, threads, env = h.start(config)
    workload = {"model": config.model, "dtype": config.dtype, "quantization": config.quantization,
                "prompts": list(config.prompts), "seed": config.seed, "batch_size": len(config.prompts), "new_tokens": config.new_tokens, "num_threads": threads,
                "timing": "tokens_per_s = batch_size x new_tokens / seconds of one run after a warm-up"}
    log(f"kvgen: loading {config.model} ({config.dtype})")
    ours, tokenizer = load_model(config.model, config.dtype, config.quantization)
    theirs = load_transformers(config.model, config.dtype) if config.include_transformers else None
    batch = left_padded([tokenizer.encode(p) for p in config.prompts], tokenizer.pad_token_id or 0)  # [B, T] each
    strategies = {name: _measure_strategy(name, (ours, theirs), batch, config, log) for name in STRATEGY_SETTINGS}
    env["load_average_1m_at_end"] = h.load_average()
    return StrategiesReport(SCHEMA, env, workload, strategies)
