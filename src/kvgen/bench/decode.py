"""``kvgen bench decode``: batch-1 greedy prefill and decode speed, kvgen vs transformers.

Workload (seeded): one prompt of ``prompt_tokens`` ids drawn uniformly from the
vocabulary by ``torch.Generator(seed)``; greedy decoding of exactly
``new_tokens`` tokens (EOS disabled), batch size 1. Each configuration (no KV
cache, dynamic cache, static cache) is warmed up by one untimed 2-token
generation, then timed by wall clock around the public ``generate`` call:

* ``prefill_s``: median over ``num_prefill_repeats`` runs of a 1-token generation
  (one forward over the prompt, logits of the last row, one argmax);
* ``decode_s = total_s - prefill_s`` where ``total_s`` times the full generation;
  ``decode_tokens_per_s = (new_tokens - 1) / decode_s`` (prefill yields the first token).

The same harness times both engines, so loop and sampling overhead counts on
both sides. Without a cache each step re-reads the whole sequence (O(n^2)), so
that configuration runs only ``no_cache_new_tokens`` new tokens. transformers
runs after kvgen in a fresh subprocess (``python -c ... --transformers-only``)
so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from kvgen.bench.common import (
    Progress,
    TokenTimer,
    current_rss_bytes,
    environment_info,
    load_average,
    median,
    peak_rss_bytes,
    per_second,
    percentile,
    ratio,
    seeded_prompt_ids,
    set_threads,
    timed,
)
from kvgen.fields import config_field

CACHE_KINDS = ("no_cache", "dynamic", "static")
SCHEMA = "kvgen.bench.decode/1"


_f = config_field


@dataclass
class DecodeBenchConfig:
    """What ``run_decode_bench`` measures. Raises ``ValueError`` for out-of-range values."""

    model: str = _f("default", "model: 'default', a .gguf file or a Hugging Face directory")
    dtype: str = _f("float32", "weight dtype: float32, bfloat16 or float16")
    prompt_tokens: int = _f(512, "prompt length in tokens (seeded random ids)")
    new_tokens: int = _f(128, "greedy tokens generated per timed run (EOS disabled)")
    no_cache_new_tokens: int = _f(16, "new tokens for the O(n^2) no-cache runs")
    include_transformers: bool = _f(True, "also time transformers on the same weights (subprocess)")
    seed: int = _f(0, "seed of the prompt's torch.Generator")
    num_threads: int | None = _f(None, "torch threads (default: every available core)")
    num_prefill_repeats: int = _f(3, "prefill timings per configuration; the median is reported")
    progress: bool = _f(True, "progress lines on stderr")

    def __post_init__(self) -> None:
        from kvgen.loader import DTYPES

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        for name in ("new_tokens", "no_cache_new_tokens"):
            if getattr(self, name) < 2:  # decode speed needs at least one step after prefill
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if self.num_prefill_repeats < 1:
            raise ValueError(f"num_prefill_repeats must be >= 1, got {self.num_prefill_repeats}")


@dataclass
class RunStats:
    """What one generation reports: token counts, and the engine's own model-time split if it has one."""

    num_prompt_tokens: int
    new_token_ids: list[int]
    model_prefill_s: float | None = None
    model_decode_s: float | None = None


# (prompt_ids [1, T], max_new_tokens, streamer or None) -> RunStats
GenerateFn = Callable[[torch.Tensor, int, TokenTimer | None], RunStats]


def time_generation(generate_fn: GenerateFn, prompt_ids: torch.Tensor, new_tokens: int, num_prefill_repeats: int = 3) -> dict[str, Any]:
    """Warm up, then time prefill (median of 1-token runs) and a full ``new_tokens`` run (seconds, tokens/s)."""
    generate_fn(prompt_ids, 2, None)  # warm-up: allocator, oneDNN primitives, first-call paths
    prefill_s = median([timed(lambda: generate_fn(prompt_ids, 1, None))[1] for _ in range(num_prefill_repeats)])
    timer = TokenTimer()
    stats, total_s = timed(lambda: generate_fn(prompt_ids, new_tokens, timer))
    num_new = len(stats.new_token_ids)
    decode_s = total_s - prefill_s
    step_s = timer.step_seconds()  # [num_new - 1]
    step_median = percentile(step_s, 50)
    report: dict[str, Any] = {
        "num_prompt_tokens": stats.num_prompt_tokens,
        "num_requested_new_tokens": new_tokens,
        "num_new_tokens": num_new,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": per_second(stats.num_prompt_tokens, prefill_s),
        "total_s": total_s,
        "decode_s": decode_s,
        "decode_tokens_per_s": per_second(num_new - 1, decode_s),
        "num_decode_steps_timed": len(step_s),
        "decode_step_s_median": step_median,
        "decode_step_s_p90": percentile(step_s, 90),
        "decode_tokens_per_s_at_median_step": per_second(1, step_median) if step_median else None,
        "new_token_ids": stats.new_token_ids,
    }
    if stats.model_decode_s is not None:  # the engine's own split: model forward + LM head only
        report["model_prefill_s"] = stats.model_prefill_s
        report["model_decode_s"] = stats.model_decode_s
        report["model_decode_tokens_per_s"] = per_second(num_new - 1, stats.model_decode_s)
    return report


def _kvgen_generate_fn(model: nn.Module, cache: str) -> GenerateFn:
    from kvgen.generation import GenerationConfig, generate

    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {"cache_implementation": cache}

    def run(prompt_ids: torch.Tensor, max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        # eos_token_id=[] disables EOS (an empty id list), so every run yields exactly max_new_tokens.
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0, **cache_args)
        out = generate(model, prompt_ids, None, config, streamer=streamer)
        return RunStats(out.prompt_length, out.new_token_ids[0], out.timings.prefill_s, out.timings.decode_s)

    return run


def _transformers_generate_fn(hf_model: nn.Module, cache: str) -> GenerateFn:
    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {}
    if cache == "static":
        cache_args["cache_implementation"] = "static"
    eos = hf_model.generation_config.eos_token_id
    pad = hf_model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    def run(prompt_ids: torch.Tensor, max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        with torch.inference_mode():
            out = hf_model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # suppresses EOS: fixed length
                pad_token_id=pad,
                streamer=streamer,
                **cache_args,
            )  # [1, T + max_new_tokens]
        return RunStats(prompt_ids.shape[1], out[0, prompt_ids.shape[1] :].tolist())

    return run


def measure_engine(
    make_fn: Callable[[str], GenerateFn],
    prompt_ids: torch.Tensor,
    config: DecodeBenchConfig,
    log: Callable[[str], None],
    name: str,
) -> dict[str, dict[str, Any]]:
    """Time every cache kind of one engine; a configuration that raises reports ``{"error": ...}``."""
    results: dict[str, dict[str, Any]] = {}
    for cache in CACHE_KINDS:
        n = config.no_cache_new_tokens if cache == "no_cache" else config.new_tokens
        log(f"{name}: {cache}: warm-up, prefill x{config.num_prefill_repeats}, {n} new tokens")
        try:
            results[cache] = time_generation(make_fn(cache), prompt_ids, n, config.num_prefill_repeats)
        except Exception as e:
            results[cache] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name}: {cache}: failed: {results[cache]['error']}")
            continue
        r = results[cache]
        log(f"{name}: {cache}: prefill {_num(r['prefill_tokens_per_s'], '.1f')} tokens/s, decode {_num(r['decode_tokens_per_s'], '.2f')} tokens/s")
    return results


def measure_ours(model: nn.Module, prompt_ids: torch.Tensor, config: DecodeBenchConfig, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Time kvgen's ``generate`` on an already-built model, per cache kind (see module docstring).

    prompt_ids: [1, T] int64. Returns ``{cache_kind: report}``; token counts are
    ``num_prompt_tokens`` and ``num_new_tokens`` (what was actually generated).
    """
    return measure_engine(lambda cache: _kvgen_generate_fn(model, cache), prompt_ids, config, log or (lambda _: None), "kvgen")


def measure_transformers(hf_model: nn.Module, prompt_ids: torch.Tensor, config: DecodeBenchConfig, log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Time ``transformers`` ``generate`` on an already-built model, per cache kind (same harness as ours)."""
    return measure_engine(lambda cache: _transformers_generate_fn(hf_model, cache), prompt_ids, config, log or (lambda _: None), "transformers")


def _bench_kvgen(config: DecodeBenchConfig, log: Progress) -> dict[str, Any]:
    from kvgen.loader import load_model, resolve_model_path

    rss_before = current_rss_bytes()
    log(f"kvgen: loading {config.model} ({config.dtype})")
    (model, _tokenizer), load_s = timed(lambda: load_model(config.model, config.dtype))
    log(f"kvgen: loaded in {load_s:.2f} s")
    prompt_ids = seeded_prompt_ids(config.prompt_tokens, model.config.vocab_size, config.seed)  # [1, T]
    configs = measure_ours(model, prompt_ids, config, log)
    return {
        "model_path": str(resolve_model_path(config.model)),
        "vocab_size": model.config.vocab_size,
        "load_s": load_s,
        "rss_before_load_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "configs": configs,
    }


def _bench_transformers_here(config: DecodeBenchConfig, vocab_size: int | None, log: Progress) -> dict[str, Any]:
    """The transformers side, in this process (the subprocess entry point calls this)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from kvgen.loader import parse_dtype, resolve_model_path

    path = resolve_model_path(config.model)
    rss_before = current_rss_bytes()
    log(f"transformers {transformers.__version__}: loading {path.name}")
    kwargs: dict[str, Any] = {"torch_dtype": parse_dtype(config.dtype)}
    if not path.is_dir():
        kwargs["gguf_file"] = path.name
    hf_model, load_s = timed(lambda: AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, **kwargs).eval())
    log(f"transformers: loaded in {load_s:.2f} s")
    prompt_ids = seeded_prompt_ids(config.prompt_tokens, vocab_size or hf_model.config.vocab_size, config.seed)  # [1, T]
    configs = measure_transformers(hf_model, prompt_ids, config, log)
    return {
        "load_s": load_s,
        "rss_before_load_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "configs": configs,
    }


def _bench_transformers_subprocess(config: DecodeBenchConfig, vocab_size: int, num_threads: int, log: Progress) -> dict[str, Any]:
    """Run the transformers side in a fresh interpreter so its peak RSS is its own; errors become ``{"error"}``."""
    args = ["--transformers-only", "--json", "--model", config.model, "--dtype", config.dtype]
    args += ["--prompt-tokens", str(config.prompt_tokens), "--new-tokens", str(config.new_tokens)]
    args += ["--no-cache-new-tokens", str(config.no_cache_new_tokens), "--seed", str(config.seed)]
    args += ["--num-threads", str(num_threads), "--vocab-size", str(vocab_size)]
    args += ["--num-prefill-repeats", str(config.num_prefill_repeats)] + ([] if config.progress else ["--quiet"])
    code = "import sys; from kvgen.bench.decode import main; sys.exit(main())"
    log("transformers: starting a fresh subprocess (its own peak RSS)")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run([sys.executable, "-c", code, *args], stdout=out, stderr=None if config.progress else subprocess.PIPE, text=True)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-2000:] if not config.progress else "see stderr"
        return {"error": f"transformers subprocess exited with status {proc.returncode}: {tail}"}
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return {"error": f"transformers subprocess printed no JSON report ({e}): {text[-500:]!r}"}


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Ratios kvgen / transformers per comparable figure (None where a side is missing)."""

    def fig(side: dict[str, Any], cache: str, key: str) -> float | None:
        return side.get("configs", {}).get(cache, {}).get(key)

    their_best = [fig(theirs, c, "decode_tokens_per_s") for c in CACHE_KINDS]
    their_best_value = max((v for v in their_best if v is not None), default=None)
    ratios: dict[str, Any] = {
        "note": "kvgen / transformers: > 1 is kvgen faster for *_tokens_per_s, < 1 is kvgen better for load_s and peak_rss_bytes",
        "prefill_tokens_per_s": ratio(fig(ours, "dynamic", "prefill_tokens_per_s"), fig(theirs, "dynamic", "prefill_tokens_per_s")),
    }
    for cache in CACHE_KINDS:
        ratios[f"decode_tokens_per_s_{cache}"] = ratio(fig(ours, cache, "decode_tokens_per_s"), fig(theirs, cache, "decode_tokens_per_s"))
    for cache in CACHE_KINDS:
        key = "decode_tokens_per_s_at_median_step"
        ratios[f"{key}_{cache}"] = ratio(fig(ours, cache, key), fig(theirs, cache, key))
    ratios["decode_tokens_per_s_static_vs_their_best"] = ratio(fig(ours, "static", "decode_tokens_per_s"), their_best_value)
    ratios["load_s"] = ratio(ours.get("load_s"), theirs.get("load_s"))
    ratios["peak_rss_bytes"] = ratio(ours.get("peak_rss_bytes"), theirs.get("peak_rss_bytes"))
    return ratios


def greedy_agreement(ours: dict[str, Any], theirs: dict[str, Any], cache: str = "dynamic") -> dict[str, Any]:
    """How many leading greedy tokens of the two engines agree (a sanity check that both ran the same model)."""
    a = ours.get("configs", {}).get(cache, {}).get("new_token_ids")
    b = theirs.get("configs", {}).get(cache, {}).get("new_token_ids")
    if a is None or b is None:
        return {"num_compared_tokens": 0, "num_leading_equal_tokens": None}
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return {
        "num_compared_tokens": min(len(a), len(b)),
        "num_leading_equal_tokens": n,
        "kvgen_first_new_token_ids": a[:16],
        "transformers_first_new_token_ids": b[:16],
    }


def run_decode_bench(
    model: str = "default",
    dtype: str = "float32",
    prompt_tokens: int = 512,
    new_tokens: int = 128,
    include_transformers: bool = True,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Benchmark batch-1 prefill and greedy decode of kvgen (and transformers) on one model.

    ``options`` are further :class:`DecodeBenchConfig` fields (``no_cache_new_tokens``,
    ``seed``, ``num_threads``, ``num_prefill_repeats``). Returns a JSON-ready dict:
    ``env``, ``workload``, ``kvgen``, ``transformers`` (or ``{"skipped"|"error": ...}``),
    ``ratios_kvgen_over_transformers`` and ``greedy_agreement``; seconds in ``*_s``,
    speeds in ``*_tokens_per_s``, memory in ``*_bytes``. Progress goes to stderr.
    Raises ``ValueError`` for bad settings and the loader's errors for a bad model.
    """
    config = DecodeBenchConfig(model, dtype, prompt_tokens, new_tokens, include_transformers=include_transformers, progress=progress, **options)
    log = Progress(config.progress)
    num_threads = set_threads(config.num_threads)
    result: dict[str, Any] = {"schema": SCHEMA, "env": environment_info(), "workload": _workload(config)}
    load = result["env"]["load_average_1m"]
    if load is not None and load > 0.5:
        log(f"warning: 1-minute load average is {load:.2f}; other processes share these {num_threads} cores, timings will be contended")
    result["kvgen"] = _bench_kvgen(config, log)
    if not config.include_transformers:
        result["transformers"] = {"skipped": "include_transformers=False"}
    elif result["env"]["transformers_version"] is None:
        result["transformers"] = {"skipped": "transformers is not installed"}
    else:
        result["transformers"] = _bench_transformers_subprocess(config, result["kvgen"]["vocab_size"], num_threads, log)
    result["ratios_kvgen_over_transformers"] = compare(result["kvgen"], result["transformers"])
    result["greedy_agreement"] = greedy_agreement(result["kvgen"], result["transformers"])
    for side in ("kvgen", "transformers"):  # token ids served the agreement check; keep the report short
        for rep in result[side].get("configs", {}).values():
            rep.pop("new_token_ids", None)
    result["env"]["load_average_1m_at_end"] = load_average()
    log("done")
    return result


def _workload(config: DecodeBenchConfig) -> dict[str, Any]:
    workload = asdict(config)
    workload.pop("progress")
    workload |= {
        "batch_size": 1,
        "decoding": "greedy, EOS disabled (kvgen: eos_token_id=[]; transformers: min_new_tokens=max_new_tokens)",
        "prompt": f"{config.prompt_tokens} token ids uniform over [0, vocab_size) from torch.Generator().manual_seed({config.seed})",
        "no_cache_note": f"no-cache runs generate {config.no_cache_new_tokens} tokens instead of {config.new_tokens} (O(n^2) per sequence)",
        "timing": "wall clock; prefill_s = median of 1-token runs; decode_s = total_s - prefill_s; "
        "decode_tokens_per_s = (num_new_tokens - 1) / decode_s; decode_step_s_* = gaps between streamed tokens "
        "(decode_tokens_per_s_at_median_step = 1 / median gap, robust to outliers); one untimed 2-token warm-up per configuration",
        "peak_rss_note": "ru_maxrss of the process: kvgen in the calling process, transformers in its own subprocess",
    }
    return workload


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def format_decode_report(result: dict[str, Any]) -> str:
    """A human table of ``run_decode_bench``'s result (speeds in tokens/s, memory in MiB)."""
    env, work = result["env"], result["workload"]
    ours, theirs = result["kvgen"], result.get("transformers", {})
    ratios = result.get("ratios_kvgen_over_transformers", {})
    lines = [
        f"decode bench: {work['model']} ({work['dtype']}), prompt {work['prompt_tokens']} tokens, "
        f"{work['new_tokens']} new tokens (no cache: {work['no_cache_new_tokens']}), batch 1, greedy",
        f"torch {env['torch_version']}, transformers {env['transformers_version']}, {env['torch_num_threads']} threads, "
        f"{env['processor']}, {env['platform']}",
    ]
    if "skipped" in theirs or "error" in theirs:
        lines.append(f"transformers: {theirs.get('skipped') or theirs.get('error')}")
    lines += ["", f"{'':28}{'kvgen':>14}{'transformers':>14}{'kvgen/hf':>10}"]

    def row(label: str, a: float | None, b: float | None, r: float | None, fmt: str) -> None:
        lines.append(f"{label:28}{_num(a, fmt):>14}{_num(b, fmt):>14}{_num(r, '.2f'):>10}")

    mib = 1 << 20
    row("load (s)", ours.get("load_s"), theirs.get("load_s"), ratios.get("load_s"), ".2f")
    rss_a, rss_b = ours.get("peak_rss_bytes"), theirs.get("peak_rss_bytes")
    row("peak RSS (MiB)", rss_a / mib if rss_a else None, rss_b / mib if rss_b else None, ratios.get("peak_rss_bytes"), ".0f")

    def fig(side: dict[str, Any], cache: str, key: str) -> float | None:
        return side.get("configs", {}).get(cache, {}).get(key)

    row("prefill (tokens/s)", fig(ours, "dynamic", "prefill_tokens_per_s"), fig(theirs, "dynamic", "prefill_tokens_per_s"), ratios.get("prefill_tokens_per_s"), ".1f")
    for cache in CACHE_KINDS:
        row(f"decode {cache} (tokens/s)", fig(ours, cache, "decode_tokens_per_s"), fig(theirs, cache, "decode_tokens_per_s"), ratios.get(f"decode_tokens_per_s_{cache}"), ".2f")
    for cache in ("dynamic", "static"):
        key = "decode_tokens_per_s_at_median_step"
        row(f"  at median step, {cache}", fig(ours, cache, key), fig(theirs, cache, key), ratios.get(f"{key}_{cache}"), ".2f")
    row("decode static vs hf best", fig(ours, "static", "decode_tokens_per_s"), None, ratios.get("decode_tokens_per_s_static_vs_their_best"), ".2f")
    for side_name, side in (("kvgen", ours), ("transformers", theirs)):
        for cache, rep in side.get("configs", {}).items():
            if "error" in rep:
                lines.append(f"{side_name} {cache}: {rep['error']}")
    agree = result.get("greedy_agreement", {})
    if agree.get("num_compared_tokens"):
        lines.append(f"greedy tokens equal to transformers: first {agree['num_leading_equal_tokens']} of {agree['num_compared_tokens']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvgen.bench.decode``: the bench, or with ``--transformers-only`` its transformers half."""
    parser = argparse.ArgumentParser(prog="python -m kvgen.bench.decode", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-cache-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--num-prefill-repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt id range (default: the model's vocabulary)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--transformers-only", action="store_true", help="time only transformers (used by the subprocess)")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = parser.parse_args(argv)
    config = DecodeBenchConfig(
        a.model, a.dtype, a.prompt_tokens, a.new_tokens, a.no_cache_new_tokens, not a.no_transformers,
        a.seed, a.num_threads, a.num_prefill_repeats, not a.quiet,
    )
    if a.transformers_only:
        set_threads(config.num_threads)
        log = Progress(config.progress, "[bench:transformers]")
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            result = _bench_transformers_here(config, a.vocab_size, log)
    else:
        result = run_decode_bench(**{k: v for k, v in asdict(config).items()})
    print(json.dumps(result, indent=2) if a.json or a.transformers_only else format_decode_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
