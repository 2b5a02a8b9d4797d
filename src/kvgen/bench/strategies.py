"""``kvgen bench strategies``: speed of every decoding strategy, kvgen vs transformers.

Workload: ``workloads.PROMPTS`` as one left-padded batch; each strategy returns one
sequence per prompt of exactly ``new_tokens`` tokens (``min_new_tokens = max_new_tokens``
on both sides). Sampling is seeded (kvgen: ``GenerationConfig.seed``; transformers:
``torch.manual_seed``). Per strategy and engine: one untimed 2-token warm-up, one timed run;
``tokens_per_s = prompts x new_tokens / wall seconds`` around ``generate``. Both engines run
in this process, strategy by strategy, kvgen first. transformers has no sample-and-rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvgen.bench.harness import (
    OMIT_IF_NONE,
    Progress,
    Side,
    default_dtype,
    environment_info,
    fmt,
    load_average,
    per_second,
    ratio,
    set_threads,
    timed,
    to_json,
)
from kvgen.bench.workloads import PROMPTS, left_padded
from kvgen.fields import config_field as _f

SCHEMA = "kvgen.bench.strategies/1"
# Strategy -> GenerationConfig fields (transformers gets the same; it has no ``best_of``).
STRATEGY_SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "sample": {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "beam_search": {"num_beams": 4},
    "beam_sample": {"num_beams": 4, "do_sample": True, "temperature": 0.8},
    "group_beam_search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "sample_and_rank": {"do_sample": True, "temperature": 0.8, "best_of": 4},
}


@dataclass
class StrategiesBenchConfig:
    """What ``run_strategies_bench`` measures. Raises ``ValueError`` for ``new_tokens < 2`` or no prompts."""

    model: str = _f("default", "a .gguf file, a Hugging Face directory or 'default' (SmolLM2-135M-Instruct)")
    dtype: str | None = _f(None, "kvgen's dtype, as load_model takes it (default: load_model's default)")
    new_tokens: int = _f(40, "tokens generated per prompt and strategy")
    prompts: tuple[str, ...] = _f(PROMPTS, "the prompts of the batch", cli=False)
    include_transformers: bool = _f(True, "time transformers")
    num_threads: int | None = _f(None, "threads of every engine (default: physical cores)", flags=("--threads", "--num-threads"))
    seed: int = _f(0, "seed of the sampling strategies", cli=False)
    progress: bool = _f(True, "progress lines on stderr", cli=False)

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2, got {self.new_tokens}")
        if not self.prompts:
            raise ValueError("prompts must hold at least one prompt, got none")


@dataclass
class StrategyRun:
    """One timed ``generate`` of one engine (seconds, tokens/s)."""

    seconds: float
    num_new_tokens: int
    tokens_per_s: float | None
    model_prefill_s: float | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)
    model_decode_s: float | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)


def _run(new_token_ids: list[list[int]], seconds: float, prefill_s: float | None = None, decode_s: float | None = None) -> StrategyRun:
    num_new = sum(len(row) for row in new_token_ids)
    return StrategyRun(seconds, num_new, per_second(num_new, seconds), prefill_s, decode_s)


def measure_kvgen(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, settings: dict[str, Any], new_tokens: int,
                  seed: int) -> tuple[StrategyRun, list[list[int]]]:
    """Time kvgen ``generate`` on a padded batch ids/mask [B, T]; the run and its new token ids."""
    from kvgen.generation import GenerationConfig, generate

    def run(n: int) -> Any:
        return generate(model, ids, mask, GenerationConfig(max_new_tokens=n, min_new_tokens=n, seed=seed, **settings))

    run(2)  # warm-up
    out, seconds = timed(lambda: run(new_tokens))
    return _run(out.new_token_ids, seconds, out.timings.prefill_s, out.timings.decode_s), out.new_token_ids


def measure_transformers(hf_model: Any, ids: torch.Tensor, mask: torch.Tensor, settings: dict[str, Any], new_tokens: int,
                         seed: int) -> tuple[StrategyRun, list[list[int]]]:
    """Time transformers ``generate`` on the same batch and settings (seeded through ``torch.manual_seed``)."""
    from kvgen.bench.peers import pad_token_id

    def run(n: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.inference_mode():
            return hf_model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     pad_token_id=pad_token_id(hf_model), **settings)

    run(2)  # warm-up
    out, seconds = timed(lambda: run(new_tokens))
    new_ids: list[list[int]] = out[:, ids.shape[1]:].tolist()  # [B, new_tokens]
    return _run(new_ids, seconds), new_ids


def _measure_strategy(name: str, models: tuple[nn.Module, Any], batch: tuple[torch.Tensor, torch.Tensor],
                      config: StrategiesBenchConfig, log: Progress) -> dict[str, Any]:
    settings = STRATEGY_SETTINGS[name]
    rows = settings["top_k"] if "penalty_alpha" in settings else settings.get("num_beams", settings.get("best_of", 1))
    log(f"{name}: kvgen")
    ours, our_ids = measure_kvgen(models[0], *batch, settings, config.new_tokens, config.seed)
    their_ids: list[list[int]] | None = None
    theirs: Side
    if models[1] is None:
        theirs = {"skipped": "include_transformers=False"}
    elif "best_of" in settings:
        theirs = {"skipped": "transformers has no sample-and-rank (best_of) mode"}
    else:
        log(f"{name}: transformers")
        try:
            run, their_ids = measure_transformers(models[1], *batch, settings, config.new_tokens, config.seed)
            theirs = to_json(run)
        except Exception as e:  # noqa: BLE001 -- a strategy transformers rejects is reported, the others still run
            theirs = {"error": f"{type(e).__name__}: {e}"}
    log(f"{name}: kvgen {fmt(ours.tokens_per_s)} tokens/s, transformers {fmt(theirs.get('tokens_per_s'))} tokens/s")
    return {"settings": settings, "rows_per_step": rows * batch[0].shape[0], "kvgen": to_json(ours), "transformers": theirs,
            "ratio_kvgen_over_transformers": ratio(ours.tokens_per_s, theirs.get("tokens_per_s")),
            "tokens_identical_to_transformers": None if their_ids is None else our_ids == their_ids}


@dataclass
class StrategiesReport:
    """``run_strategies_bench``'s result: per strategy ``settings``, ``rows_per_step``, ``kvgen`` /
    ``transformers`` runs, ``ratio_kvgen_over_transformers`` (> 1: kvgen faster), ``tokens_identical_to_transformers``."""

    schema: str
    env: dict[str, Any]
    workload: dict[str, Any]
    strategies: dict[str, dict[str, Any]]


def run_strategies_bench(config: StrategiesBenchConfig) -> StrategiesReport:
    """Tokens/s of each decoding strategy on ``config.model``, kvgen and (where it has it) transformers."""
    from kvgen.bench.peers import load_transformers
    from kvgen.loader import load_model

    log, threads, dtype = Progress(config.progress), set_threads(config.num_threads), config.dtype or default_dtype()
    env = environment_info()
    workload = {
        "model": config.model, "dtype": dtype, "prompts": list(config.prompts), "batch_size": len(config.prompts),
        "new_tokens": config.new_tokens, "seed": config.seed, "num_threads": threads,
        "timing": "per strategy and engine: one untimed 2-token warm-up, one timed run; wall clock around generate(); "
        "tokens_per_s = batch_size x new_tokens / seconds (min_new_tokens = max_new_tokens on both sides)",
    }
    log(f"kvgen: loading {config.model} ({dtype})")
    ours, tokenizer = load_model(config.model, dtype=dtype)
    theirs = load_transformers(config.model, dtype) if config.include_transformers else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = left_padded([tokenizer.encode(p) for p in config.prompts], pad)  # ids, mask: [B, T]
    strategies = {name: _measure_strategy(name, (ours, theirs), batch, config, log) for name in STRATEGY_SETTINGS}
    env["load_average_1m_at_end"] = load_average()
    return StrategiesReport(SCHEMA, env, workload, strategies)


def format_strategies_report(result: dict[str, Any]) -> str:
    """A human table of ``run_strategies_bench``'s JSON result (tokens/s of each strategy, both engines)."""
    work, env = result["workload"], result["env"]
    lines = [
        f"strategies bench: {work['model']} ({work['dtype']}), {work['batch_size']} prompts x {work['new_tokens']} new tokens",
        (f"torch {env['torch_version']}, transformers {env['transformers_version']}, {work['num_threads']} threads, "
         f"load average {fmt(env.get('load_average_1m'), '.2f')} -> {fmt(env.get('load_average_1m_at_end'), '.2f')}"),
        "",
        f"{'strategy':20}{'rows/step':>10}{'kvgen tok/s':>13}{'hf tok/s':>10}{'kvgen/hf':>10}{'same tokens':>13}",
    ]
    for name, e in result["strategies"].items():
        same = e["tokens_identical_to_transformers"]
        lines.append(f"{name:20}{e['rows_per_step']:>10}{fmt(e['kvgen']['tokens_per_s']):>13}{fmt(e['transformers'].get('tokens_per_s')):>10}"
                     f"{fmt(e['ratio_kvgen_over_transformers'], '.2f'):>10}{'-' if same is None else ('yes' if same else 'no'):>13}")
    return "\n".join(lines)
