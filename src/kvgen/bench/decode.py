"""``kvgen bench decode``: batch-1 greedy prefill and decode speed, kvgen vs transformers and llama.cpp.

Workload (``workloads.seeded_prompt_ids``): one prompt of ``prompt_tokens`` ids; greedy
decoding of exactly ``new_tokens`` tokens (EOS disabled), batch 1. Each configuration
(no KV cache, dynamic, static) is timed by ``harness.time_generation`` around the public
``generate``: ``prefill_s`` = median 1-token generation, ``decode_s = total_s - prefill_s``,
``decode_tokens_per_s = (new_tokens - 1) / decode_s``. Without a cache each step re-reads
the sequence (O(n^2)), so that configuration runs ``no_cache_new_tokens``. ``ttft_s``: median
1-token generation of a ``ttft_prompt_tokens`` prompt (kvgen: static cache). transformers
and llama-cpp-python (``bench/peers.py``) run after kvgen, each in a fresh subprocess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kvgen.bench.harness import (
    GenerateFn,
    Progress,
    RunStats,
    Side,
    TokenTimer,
    current_rss_bytes,
    default_dtype,
    environment_info,
    fmt,
    load_average,
    peak_rss_bytes,
    ratio,
    run_peer,
    set_threads,
    time_generation,
    time_to_first_token,
    timed,
    to_json,
)
from kvgen.bench.workloads import seeded_prompt_ids
from kvgen.fields import config_field as _f

if TYPE_CHECKING:
    from kvgen.config import ModelConfig

CACHE_KINDS = ("no_cache", "dynamic", "static")
SCHEMA = "kvgen.bench.decode/2"


@dataclass
class DecodeBenchConfig:
    """What ``run_decode_bench`` measures. Raises ``ValueError`` for out-of-range values."""

    model: str = _f("default", "a .gguf file, a Hugging Face directory or 'default' (SmolLM2-135M-Instruct)")
    dtype: str | None = _f(None, "kvgen's dtype, as load_model takes it (default: load_model's default)")
    prompt_tokens: int = _f(512, "prompt length in tokens (seeded random ids)")
    new_tokens: int = _f(128, "greedy tokens generated per timed run (EOS disabled)")
    no_cache_new_tokens: int = _f(16, "new tokens for the O(n^2) no-cache runs")
    include_transformers: bool = _f(True, "time transformers (subprocess)")
    include_llama_cpp: bool = _f(True, "time llama-cpp-python (subprocess)")
    ttft_prompt_tokens: int = _f(20, "prompt tokens of the time-to-first-token runs")
    seed: int = _f(0, "seed of the prompt's torch.Generator")
    num_threads: int | None = _f(None, "threads of every engine (default: physical cores)", flags=("--threads", "--num-threads"))
    num_prefill_repeats: int = _f(3, "prefill timings per configuration; the median is reported")
    progress: bool = _f(True, "progress lines on stderr", cli=False)

    def __post_init__(self) -> None:
        self.dtype = self.dtype or default_dtype()  # load_model validates it
        for name, low in (("prompt_tokens", 1), ("ttft_prompt_tokens", 1), ("new_tokens", 2), ("no_cache_new_tokens", 2),
                          ("num_prefill_repeats", 1)):  # decode speed needs one step after prefill
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")


def kvgen_generate_fn(model: nn.Module, cache: str) -> GenerateFn:
    """``GenerateFn`` over kvgen ``generate``: greedy, EOS disabled (``eos_token_id=[]``), per cache kind."""
    from kvgen.generation import GenerationConfig, generate

    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {"cache_implementation": cache}

    def run(prompt_ids: torch.Tensor, max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0, **cache_args)
        out = generate(model, prompt_ids, None, config, streamer=streamer)
        return RunStats(out.prompt_length, out.new_token_ids[0], out.timings.prefill_s, out.timings.decode_s)

    return run


def measure_caches(make_fn: Callable[[str], GenerateFn], prompt_ids: Any, config: DecodeBenchConfig,
                   log: Callable[[str], None], name: str) -> dict[str, Side]:
    """Time every cache kind of one engine (JSON reports); a configuration that raises reports ``{"error": ...}``."""
    results: dict[str, Side] = {}
    for cache in CACHE_KINDS:
        n = config.no_cache_new_tokens if cache == "no_cache" else config.new_tokens
        log(f"{name}: {cache}: warm-up, prefill x{config.num_prefill_repeats}, {n} new tokens")
        try:
            r = results[cache] = to_json(time_generation(make_fn(cache), prompt_ids, n, config.num_prefill_repeats))
            log(f"{name}: {cache}: prefill {fmt(r['prefill_tokens_per_s'])} tokens/s, decode {fmt(r['decode_tokens_per_s'], '.2f')} tokens/s")
        except Exception as e:  # noqa: BLE001 -- one failing configuration is reported, the others still run
            results[cache] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name}: {cache}: failed: {results[cache]['error']}")
    return results


def measure_ours(model: nn.Module, prompt_ids: torch.Tensor, config: DecodeBenchConfig, log: Callable[[str], None] | None = None) -> dict[str, Side]:
    """Time kvgen's ``generate`` on a built model per cache kind; prompt_ids [1, T] int64."""
    return measure_caches(lambda cache: kvgen_generate_fn(model, cache), prompt_ids, config, log or (lambda _: None), "kvgen")


def _bench_kvgen(config: DecodeBenchConfig, log: Progress) -> Side:
    from kvgen.bench.kernels import qgemm_crossover, step_breakdown
    from kvgen.loader import load_model, resolve_model_path

    rss_before = current_rss_bytes()
    log(f"kvgen: loading {config.model} ({config.dtype})")
    (model, _), load_s = timed(lambda: load_model(config.model, dtype=config.dtype))
    vocab_size = cast("ModelConfig", model.config).vocab_size
    prompt_ids = seeded_prompt_ids(config.prompt_tokens, vocab_size, config.seed)  # [1, prompt_tokens]
    configs = measure_ours(model, prompt_ids, config, log)
    ttft_ids = seeded_prompt_ids(config.ttft_prompt_tokens, vocab_size, config.seed)  # [1, ttft_prompt_tokens]
    ttft_s = time_to_first_token(kvgen_generate_fn(model, "static"), ttft_ids, config.num_prefill_repeats)
    log("kvgen: decode step breakdown and kernel crossover")
    return {
        "model_path": str(resolve_model_path(config.model)), "step_breakdown": to_json(step_breakdown(model, prompt_ids)),
        "qgemm_crossover": qgemm_crossover(), "vocab_size": vocab_size, "load_s": load_s, "rss_before_load_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(), "configs": configs, "ttft_s": ttft_s,
    }


def _bench_llama_cpp(config: DecodeBenchConfig, vocab_size: int, num_threads: int, log: Progress) -> Side:
    from kvgen.loader import resolve_model_path

    path = resolve_model_path(config.model)
    if path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    request = {
        "model_path": str(path), "num_threads": num_threads, "new_tokens": config.new_tokens,
        "prompt_ids": seeded_prompt_ids(config.prompt_tokens, vocab_size, config.seed)[0].tolist(),
        "ttft_prompt_ids": seeded_prompt_ids(config.ttft_prompt_tokens, vocab_size, config.seed)[0].tolist(),
        "num_prefill_repeats": config.num_prefill_repeats,
    }
    return run_peer("llama_cpp", "decode", request, log, quiet=not config.progress)


RATIO_NOTE = (
    "kvgen over peer: > 1 is kvgen better for *_tokens_per_s and ttft_speedup (peer ttft_s / kvgen ttft_s); "
    "*_kvgen_over_peer < 1 is kvgen better (load seconds, peak RSS bytes). Against llama.cpp every kvgen cache kind "
    "is compared with its one configuration (kv_cache); prefill compares kvgen's static cache"
)


def compare(ours: Side, theirs: Side, their_config: str | None = None) -> dict[str, float | None]:
    """Ratios kvgen / peer per comparable figure (see ``RATIO_NOTE``; None where a side is missing).

    ``their_config``: None compares each cache kind with the peer's same kind (transformers);
    a name compares every kvgen cache kind with that one peer configuration (llama.cpp).
    """

    def fig(side: Side, cache: str, key: str) -> float | None:
        return side.get("configs", {}).get(cache, {}).get(key)

    kinds = CACHE_KINDS if their_config is None else ("dynamic", "static")
    ratios = {"prefill_tokens_per_s": ratio(fig(ours, "static", "prefill_tokens_per_s"), fig(theirs, their_config or "static", "prefill_tokens_per_s"))}
    for key in ("decode_tokens_per_s", "decode_tokens_per_s_at_median_step"):
        for cache in kinds:
            ratios[f"{key}_{cache}"] = ratio(fig(ours, cache, key), fig(theirs, their_config or cache, key))
    their_best = max((v for c in theirs.get("configs", {}) if (v := fig(theirs, c, "decode_tokens_per_s")) is not None), default=None)
    ratios["decode_tokens_per_s_static_vs_their_best"] = ratio(fig(ours, "static", "decode_tokens_per_s"), their_best)
    ratios["ttft_speedup"] = ratio(theirs.get("ttft_s"), ours.get("ttft_s"))
    ratios["load_s_kvgen_over_peer"] = ratio(ours.get("load_s"), theirs.get("load_s"))
    ratios["peak_rss_kvgen_over_peer"] = ratio(ours.get("peak_rss_bytes"), theirs.get("peak_rss_bytes"))
    return ratios


def greedy_agreement(ours: Side, theirs: Side, cache: str = "dynamic", their_config: str | None = None) -> dict[str, Any]:
    """How many leading greedy tokens of the two engines agree (a sanity check that both ran the same model)."""
    a = ours.get("configs", {}).get(cache, {}).get("new_token_ids")
    b = theirs.get("configs", {}).get(their_config or cache, {}).get("new_token_ids")
    if a is None or b is None:
        return {"num_compared_tokens": 0, "num_leading_equal_tokens": None}
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"num_compared_tokens": min(len(a), len(b)), "num_leading_equal_tokens": n,
            "kvgen_first_new_token_ids": a[:16], "peer_first_new_token_ids": b[:16]}


@dataclass
class DecodeReport:
    """``run_decode_bench``'s result: seconds in ``*_s``, speeds in ``*_tokens_per_s``, memory in ``*_bytes``."""

    schema: str
    env: dict[str, Any]
    workload: dict[str, Any]
    kvgen: Side
    transformers: Side
    llama_cpp: Side
    ratios: dict[str, Any]
    greedy_agreement: dict[str, Any]


def run_decode_bench(config: DecodeBenchConfig) -> DecodeReport:
    """Benchmark batch-1 prefill and greedy decode of kvgen, transformers and llama-cpp-python on one model.

    Peers may report ``{"skipped"|"error": ...}``. Progress goes to stderr. Raises the loader's errors for a bad model.
    """
    log = Progress(config.progress)
    num_threads = set_threads(config.num_threads)
    env = environment_info()
    if (load := env["load_average_1m"]) is not None and load > 0.5:
        log(f"warning: 1-minute load average is {load:.2f}; other processes share these cores, timings will be contended")
    ours = _bench_kvgen(config, log)
    request = {"config": dataclasses.asdict(config), "vocab_size": ours["vocab_size"], "num_threads": num_threads}
    hf: Side = {"skipped": "include_transformers=False"} if not config.include_transformers else (
        {"skipped": "transformers is not installed"} if env["transformers_version"] is None
        else run_peer("transformers", "decode", request, log, quiet=not config.progress))
    cpp: Side = _bench_llama_cpp(config, ours["vocab_size"], num_threads, log) if config.include_llama_cpp else {"skipped": "include_llama_cpp=False"}
    report = DecodeReport(
        SCHEMA, env, _workload(config, num_threads), ours, hf, cpp,
        {"note": RATIO_NOTE, "vs_transformers": compare(ours, hf), "vs_llama_cpp": compare(ours, cpp, "kv_cache")},
        {"vs_transformers": greedy_agreement(ours, hf), "vs_llama_cpp": greedy_agreement(ours, cpp, "static", "kv_cache")},
    )
    for side in (ours, hf, cpp):  # token ids served the agreement checks; keep the report short
        configs: dict[str, Side] = side.get("configs", {})
        for rep in configs.values():
            rep.pop("new_token_ids", None)
    env["load_average_1m_at_end"] = load_average()
    log("done")
    return report


def _workload(config: DecodeBenchConfig, num_threads: int) -> dict[str, Any]:
    from kvgen.loader import DTYPES

    workload = dataclasses.asdict(config)
    del workload["progress"]
    return workload | {
        "num_threads": num_threads, "batch_size": 1,
        "transformers_dtype": str(DTYPES.get(str(config.dtype), torch.float32)).removeprefix("torch."),
        "decoding": "greedy, EOS disabled (kvgen: eos_token_id=[]; transformers: min_new_tokens=max_new_tokens; "
        "llama.cpp: top_k=1, its generate never stops, cut at new_tokens)",
        "prompt": f"{config.prompt_tokens} token ids uniform over [0, vocab_size) from torch.Generator().manual_seed({config.seed}), "
        "the same ids for every engine",
        "no_cache_note": f"no-cache runs generate {config.no_cache_new_tokens} tokens instead of {config.new_tokens} (O(n^2) per sequence)",
        "timing": "wall clock; prefill_s = median of 1-token runs; decode_s = total_s - prefill_s; "
        "decode_tokens_per_s = (num_new_tokens - 1) / decode_s; decode_step_s_* = gaps between streamed tokens "
        "(decode_tokens_per_s_at_median_step = 1 / median gap, robust to outliers); one untimed 2-token warm-up per configuration; "
        f"ttft_s = median 1-token generation of a {config.ttft_prompt_tokens}-token prompt (kvgen: static cache; transformers: dynamic)",
        "peak_rss_note": "VmHWM of each process: kvgen in the calling process, transformers and llama.cpp (no torch) each in its own subprocess",
    }


def format_decode_report(result: dict[str, Any]) -> str:
    """A human table of ``run_decode_bench``'s JSON result (speeds in tokens/s, memory in MiB)."""
    env, work = result["env"], result["workload"]
    sides = (result["kvgen"], result.get("transformers", {}), result.get("llama_cpp", {}))
    vs = (result.get("ratios", {}).get("vs_transformers", {}), result.get("ratios", {}).get("vs_llama_cpp", {}))
    lines = [
        (f"decode bench: {work['model']} ({work['dtype']}), prompt {work['prompt_tokens']} tokens, {work['new_tokens']} new "
         f"tokens (no cache: {work['no_cache_new_tokens']}), batch 1, greedy, {work['num_threads']} threads"),
        f"torch {env['torch_version']}, transformers {env['transformers_version']}, {env['processor']}, {env['platform']}",
    ]
    lines += [f"{name}: {s.get('skipped') or s.get('error')}" for name, s in zip(("transformers", "llama.cpp"), sides[1:]) if "skipped" in s or "error" in s]
    lines += ["", f"{'':28}{'kvgen':>10}{'transformers':>14}{'llama.cpp':>11}{'kvgen/hf':>10}{'kvgen/cpp':>11}"]

    def row(label: str, key: str, ratio_key: str, spec: str, cache: str | None = None, scale: float = 1.0) -> None:
        values = []
        for side, cfg in zip(sides, (cache, cache, None if cache == "no_cache" else "kv_cache")):
            v = side.get("configs", {}).get(cfg, {}).get(key) if cache else side.get(key)
            values.append(fmt(v / scale if v is not None else None, spec))
        r = [fmt(x.get(ratio_key), ".2f") for x in vs]
        lines.append(f"{label:28}{values[0]:>10}{values[1]:>14}{values[2]:>11}{r[0]:>10}{r[1]:>11}")

    row("load (s)", "load_s", "load_s_kvgen_over_peer", ".2f")
    row("peak RSS (MiB)", "peak_rss_bytes", "peak_rss_kvgen_over_peer", ".0f", scale=1 << 20)
    row("TTFT (s; ratio: speedup)", "ttft_s", "ttft_speedup", ".3f")
    row("prefill static (tokens/s)", "prefill_tokens_per_s", "prefill_tokens_per_s", ".1f", "static")
    for cache in CACHE_KINDS:
        row(f"decode {cache} (tokens/s)", "decode_tokens_per_s", f"decode_tokens_per_s_{cache}", ".2f", cache)
    for side_name, side in zip(("kvgen", "transformers", "llama.cpp"), sides):
        lines += [f"{side_name} {cache}: {rep['error']}" for cache, rep in side.get("configs", {}).items() if "error" in rep]
    for peer, agree in result.get("greedy_agreement", {}).items():
        if agree.get("num_compared_tokens"):
            lines.append(f"greedy tokens {peer}: first {agree['num_leading_equal_tokens']} of {agree['num_compared_tokens']} equal")
    return "\n".join(lines)
