"""``kvgen bench strategies``: speed of every decoding strategy, kvgen vs transformers.

Workload: three fixed prompts as one left-padded batch; each strategy returns one
sequence per prompt of exactly ``new_tokens`` tokens (``min_new_tokens =
max_new_tokens``, on both sides, so EOS never ends a row early and both engines
run the same processors). Sampling strategies are seeded (kvgen: a
``torch.Generator(seed)``; transformers: ``torch.manual_seed(seed)``).
Per strategy and engine: one untimed 2-token warm-up, then one timed run;
``tokens_per_s = prompts x new_tokens / wall seconds`` around the public
``generate`` call (the work behind a token grows with the beams / candidates /
samples a strategy keeps: ``rows_per_step``). Both engines run in this process,
strategy by strategy, kvgen first, so contention from other processes hits both
alike. transformers has no sample-and-rank mode; that row has no ratio.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvgen.bench.common import (
    Progress,
    default_dtype,
    environment_info,
    load_average,
    peer_torch_dtype,
    per_second,
    ratio,
    set_threads,
    timed,
)

SCHEMA = "kvgen.bench.strategies/1"

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):",
)

# Strategy -> GenerationConfig fields (transformers gets the same, except ``best_of``).
STRATEGY_SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "sample": {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "beam_search": {"num_beams": 4},
    "beam_sample": {"num_beams": 4, "do_sample": True, "temperature": 0.8},
    "group_beam_search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "sample_and_rank": {"do_sample": True, "temperature": 0.8, "best_of": 4},
}
NOT_IN_TRANSFORMERS = ("best_of",)


def _rows_per_step(settings: dict[str, Any]) -> int:
    """Model rows per prompt in one decode step (beams, contrastive candidates, samples)."""
    if "penalty_alpha" in settings:
        return settings["top_k"]
    return settings.get("num_beams", settings.get("best_of", 1))


def measure_kvgen(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, settings: dict[str, Any], new_tokens: int, seed: int
) -> dict[str, Any]:
    """Time kvgen ``generate`` on a padded batch ids/mask [B, T]; returns seconds, tokens/s and the new ids."""
    from kvgen.generation import GenerationConfig, generate

    def run(n: int) -> Any:
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, seed=seed, **settings)
        return generate(model, ids, mask, config)

    run(2)  # warm-up
    out, seconds = timed(lambda: run(new_tokens))
    return _report(
        out.new_token_ids, seconds, {"model_prefill_s": out.timings.prefill_s, "model_decode_s": out.timings.decode_s}
    )


def measure_transformers(
    hf_model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, settings: dict[str, Any], new_tokens: int, seed: int
) -> dict[str, Any]:
    """Time transformers ``generate`` on the same batch and settings (seeded through ``torch.manual_seed``)."""
    eos = hf_model.generation_config.eos_token_id
    pad = hf_model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    def run(n: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.inference_mode():
            return hf_model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **settings
            )

    run(2)  # warm-up
    out, seconds = timed(lambda: run(new_tokens))
    return _report(out[:, ids.shape[1] :].tolist(), seconds, {})


def _report(new_token_ids: list[list[int]], seconds: float, extra: dict[str, Any]) -> dict[str, Any]:
    num_new = sum(len(row) for row in new_token_ids)
    return {
        "seconds": seconds,
        "num_new_tokens": num_new,
        "tokens_per_s": per_second(num_new, seconds),
        **extra,
        "new_token_ids": new_token_ids,
    }


def _load(model: str, dtype: str, include_transformers: bool, log: Progress) -> tuple[nn.Module, Any, nn.Module | None]:
    from kvgen.loader import load_model, resolve_model_path

    log(f"kvgen: loading {model} ({dtype})")
    ours, tokenizer = load_model(model, dtype=dtype)
    if not include_transformers:
        return ours, tokenizer, None
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    log(f"transformers: loading {path.name}")
    kwargs: dict[str, Any] = {"torch_dtype": peer_torch_dtype(dtype)} | ({} if path.is_dir() else {"gguf_file": path.name})
    theirs = AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, **kwargs).eval()
    return ours, tokenizer, theirs


def _batch(tokenizer: Any, prompts: tuple[str, ...] | list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask [B, T] int64 of ``prompts``."""
    rows = [tokenizer.encode(p) for p in prompts]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # [B, T]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [B, T]
    return ids, mask


def _measure_strategy(
    name: str,
    models: tuple[nn.Module, nn.Module | None],
    batch: tuple[torch.Tensor, torch.Tensor],
    new_tokens: int,
    seed: int,
    log: Progress,
) -> dict[str, Any]:
    settings = STRATEGY_SETTINGS[name]
    ours_model, hf_model = models
    entry: dict[str, Any] = {"settings": settings, "rows_per_step": _rows_per_step(settings) * batch[0].shape[0]}
    log(f"{name}: kvgen")
    entry["kvgen"] = measure_kvgen(ours_model, *batch, settings, new_tokens, seed)
    if hf_model is None:
        entry["transformers"] = {"skipped": "include_transformers=False"}
    elif any(key in settings for key in NOT_IN_TRANSFORMERS):
        entry["transformers"] = {"skipped": "transformers has no sample-and-rank (best_of) mode"}
    else:
        log(f"{name}: transformers")
        try:
            entry["transformers"] = measure_transformers(hf_model, *batch, settings, new_tokens, seed)
        except Exception as e:
            entry["transformers"] = {"error": f"{type(e).__name__}: {e}"}
    theirs = entry["transformers"]
    entry["ratio_kvgen_over_transformers"] = ratio(entry["kvgen"]["tokens_per_s"], theirs.get("tokens_per_s"))
    their_ids = theirs.pop("new_token_ids", None)
    entry["tokens_identical_to_transformers"] = (
        None if their_ids is None else entry["kvgen"]["new_token_ids"] == their_ids
    )
    entry["kvgen"].pop("new_token_ids")
    log(
        f"{name}: kvgen {_num(entry['kvgen']['tokens_per_s'])} tokens/s, transformers {_num(theirs.get('tokens_per_s'))} tokens/s"
    )
    return entry


def run_strategies_bench(
    model: str = "default",
    new_tokens: int = 40,
    prompts: tuple[str, ...] | list[str] = PROMPTS,
    include_transformers: bool = True,
    dtype: str | None = None,
    num_threads: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokens/s of each decoding strategy on ``model``, kvgen and (where it has it) transformers.

    Returns a JSON-ready dict: ``env``, ``workload``, and ``strategies``: per
    strategy ``settings``, ``rows_per_step``, ``kvgen`` / ``transformers``
    (``seconds``, ``num_new_tokens``, ``tokens_per_s``; or ``skipped``/``error``),
    ``ratio_kvgen_over_transformers`` (> 1: kvgen faster) and
    ``tokens_identical_to_transformers``. Progress goes to stderr.
    Raises ``ValueError`` for ``new_tokens < 2`` or no prompts, and the loader's errors.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2, got {new_tokens}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got none")
    log = Progress(progress)
    threads = set_threads(num_threads)
    dtype = dtype or default_dtype()
    result: dict[str, Any] = {"schema": SCHEMA, "env": environment_info()}
    result["workload"] = {
        "model": model,
        "dtype": dtype,
        "prompts": list(prompts),
        "batch_size": len(prompts),
        "new_tokens": new_tokens,
        "seed": seed,
        "num_threads": threads,
        "timing": (
            "per strategy and engine: one untimed 2-token warm-up, one timed run; wall clock around generate(); "
            "tokens_per_s = batch_size x new_tokens / seconds (min_new_tokens = max_new_tokens on both sides)"
        ),
    }
    ours, tokenizer, theirs = _load(model, dtype, include_transformers, log)
    batch = _batch(tokenizer, prompts)
    result["strategies"] = {
        name: _measure_strategy(name, (ours, theirs), batch, new_tokens, seed, log) for name in STRATEGY_SETTINGS
    }
    result["env"]["load_average_1m_at_end"] = load_average()
    return result


def _num(value: float | None, fmt: str = ".1f") -> str:
    return format(value, fmt) if value is not None else "-"


def format_strategies_report(result: dict[str, Any]) -> str:
    """A human table of ``run_strategies_bench``'s result (tokens/s of each strategy, both engines)."""
    work, env = result["workload"], result["env"]
    lines = [
        f"strategies bench: {work['model']} ({work['dtype']}), {work['batch_size']} prompts x {work['new_tokens']} new tokens",
        (
            f"torch {env['torch_version']}, transformers {env['transformers_version']}, {work['num_threads']} threads, "
            f"load average {_num(env.get('load_average_1m'), '.2f')} -> {_num(env.get('load_average_1m_at_end'), '.2f')}"
        ),
        "",
        f"{'strategy':20}{'rows/step':>10}{'kvgen tok/s':>13}{'hf tok/s':>10}{'kvgen/hf':>10}{'same tokens':>13}",
    ]
    for name, entry in result["strategies"].items():
        theirs = entry["transformers"]
        same = entry["tokens_identical_to_transformers"]
        lines.append(
            f"{name:20}{entry['rows_per_step']:>10}{_num(entry['kvgen']['tokens_per_s']):>13}"
            f"{_num(theirs.get('tokens_per_s')):>10}{_num(entry['ratio_kvgen_over_transformers'], '.2f'):>10}"
            f"{'-' if same is None else ('yes' if same else 'no'):>13}"
        )
    return "\n".join(lines)
