"""``kvgen bench throughput``: offline serving throughput of the engine vs static batching.

Workload (``workloads.make_workload``): ``num_prompts`` requests, all arriving at t=0;
prompt lengths uniform in [16, 512] tokens, output lengths in [16, 256]; greedy with EOS
ignored, so every request generates exactly its output length. Systems, in one run:
``kvgen_engine`` (``LLMEngine`` continuous batching), ``kvgen_static`` (the same engine
fed static batches of ``static_batch_size``, each run to completion), ``transformers_static``
(left-padded static batches, subprocess) and ``llama_cpp`` (one request at a time, subprocess).
Per system: useful tokens/s, requests/s, TTFT (from t=0, queueing counts) and ITL (gaps
between a request's tokens) p50/p99 in seconds, peak RSS (VmHWM). The engine's phase
seconds (``profile``) come from wrapping its and its runner's methods from outside.
On a shared machine pass ``num_threads=1`` (a descheduled OpenMP thread stalls matmuls).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvgen.bench.harness import (
    OMIT_IF_NONE,
    Progress,
    Side,
    default_dtype,
    environment_info,
    fmt,
    load_average,
    peak_rss_bytes,
    per_second,
    percentile,
    ratio,
    run_peer,
    set_threads,
    to_json,
)
from kvgen.bench.workloads import Workload, make_workload
from kvgen.fields import config_field as _f

if TYPE_CHECKING:
    from kvgen.config import ModelConfig

SCHEMA = "kvgen.bench.throughput/1"
SYSTEMS = ("kvgen_engine", "kvgen_static", "transformers_static", "llama_cpp")


@dataclass
class ThroughputBenchConfig:
    """What ``run_throughput_bench`` measures. Raises ``ValueError`` for out-of-range values."""

    model: str = _f("default", "a .gguf file, a Hugging Face directory or 'default' (SmolLM2-135M-Instruct)")
    dtype: str | None = _f(None, "kvgen's dtype, as load_model takes it (default: load_model's default)")
    num_prompts: int = _f(64, "requests in the workload")
    seed: int = _f(0, "seed of the workload's torch.Generator")
    static_batch_size: int = _f(32, "requests per static batch (kvgen_static, transformers_static)")
    num_threads: int | None = _f(None, "threads of every engine (default: physical cores)", flags=("--threads", "--num-threads"))
    include_transformers: bool = _f(True, "time transformers (subprocess)")
    include_llama_cpp: bool = _f(True, "time llama-cpp-python (subprocess)")
    max_num_seqs: int = _f(64, "EngineArgs.max_num_seqs of kvgen_engine")
    max_num_batched_tokens: int = _f(512, "EngineArgs.max_num_batched_tokens of both kvgen systems")
    kv_cache_memory: int = _f(2 << 30, "EngineArgs.kv_cache_memory (bytes) of both kvgen systems")
    progress: bool = _f(True, "progress lines on stderr", cli=False)

    def __post_init__(self) -> None:
        for name in ("num_prompts", "static_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class EngineProfile:
    """Cumulative seconds of each phase of ``LLMEngine.step()`` and of ``ModelRunner.execute()``."""

    num_steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0  # Scheduler.update_from_output
    output_s: float = 0.0  # the rest of step(): detokenizing, stop strings, n > 1 merging
    runner_prepare_s: float = 0.0  # generators, packing ids, positions, slot mapping, block tables
    runner_forward_s: float = 0.0
    runner_logits_s: float = 0.0
    runner_sample_s: float = 0.0
    num_packed_tokens: int = 0


@dataclass
class ThroughputSummary:
    """One system's figures (seconds, tokens/s, requests/s)."""

    elapsed_s: float
    num_requests: int
    num_useful_tokens: int
    generated_tokens_per_s: float | None
    requests_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    num_generated_tokens_including_waste: int | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)  # static batches decode their longest output
    profile: EngineProfile | None = dataclasses.field(default=None, metadata=OMIT_IF_NONE)


def summarize(token_times: list[list[float]], output_lens: list[int], start: float, end: float) -> ThroughputSummary:
    """Figures of one system from each request's token timestamps (``time.perf_counter`` seconds)."""
    ttft = [times[0] - start for times in token_times if times]
    itl = [b - a for times in token_times for a, b in itertools.pairwise(times)]
    n, useful, elapsed = len(output_lens), sum(output_lens), end - start
    return ThroughputSummary(elapsed, n, useful, per_second(useful, elapsed), per_second(n, elapsed), percentile(ttft, 50),
                             percentile(ttft, 99), percentile(itl, 50), percentile(itl, 99))


def profile_engine(engine: Any) -> EngineProfile:
    """Time ``engine``'s phases by wrapping its and its runner's methods on the instances (engine code is untouched).

    ``output_s`` is filled in by :func:`finish_profile` (step time minus the other phases).
    """
    prof = EngineProfile()

    def wrap(obj: Any, method: str, key: str, after: Callable[[Any], None] | None = None) -> None:
        fn = getattr(obj, method)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            setattr(prof, key, getattr(prof, key) + time.perf_counter() - start)
            if after is not None:
                after(out)
            return out

        setattr(obj, method, timed_call)

    def count_step(_: Any) -> None:
        prof.num_steps += 1

    def count_tokens(step: Any) -> None:
        prof.num_packed_tokens += step.input_ids.shape[1]

    wrap(engine, "step", "output_s", count_step)
    wrap(engine.scheduler, "schedule", "schedule_s")
    wrap(engine.scheduler, "update_from_output", "update_s")
    wrap(engine.runner, "execute", "execute_s")
    for method, key in (("run_model", "runner_forward_s"), ("compute_logits", "runner_logits_s"), ("sample", "runner_sample_s")):
        wrap(engine.runner, method, key)
    wrap(engine.runner, "prepare_inputs", "runner_prepare_s", count_tokens)
    return prof


def finish_profile(prof: EngineProfile) -> EngineProfile:
    """``output_s`` = whole steps minus schedule, execute and update (see :func:`profile_engine`)."""
    prof.output_s -= prof.schedule_s + prof.execute_s + prof.update_s
    return prof


def measure_kvgen(model: Any, workload: Workload, engine_args: Any, static_batch_size: int | None) -> ThroughputSummary:
    """The workload on a fresh engine: continuous batching, or static batches when ``static_batch_size`` is set."""
    from kvgen.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, None, engine_args)
    prof = profile_engine(engine)
    n = len(workload.output_lens)
    size = static_batch_size or n
    token_times: list[list[float]] = [[] for _ in range(n)]
    start = time.perf_counter()
    for batch in (range(b, min(b + size, n)) for b in range(0, n, size)):  # the next batch once the previous finished
        for i in batch:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=workload.output_lens[i])
            engine.add_request(str(i), prompt_token_ids=workload.prompt_token_ids[i], sampling_params=params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                times = token_times[int(out.request_id)]
                times.extend([now] * (len(out.outputs[0].token_ids) - len(times)))
    result = summarize(token_times, workload.output_lens, start, time.perf_counter())
    result.profile = finish_profile(prof)
    return result


def _warm_up(model: Any, engine_args: Any) -> None:
    """One tiny request: first-call allocations and kernel selection stay out of the timings."""
    from kvgen.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, None, engine_args)
    engine.add_request("warm", prompt_token_ids=list(range(100, 164)), sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()


def _llama_cpp(model: str, workload: Workload, num_threads: int, log: Progress) -> Side:
    from kvgen.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    request = {"model_path": str(path), "num_threads": num_threads, **dataclasses.asdict(workload)}
    side = run_peer("llama_cpp", "throughput", request, log)
    if "token_times_s" not in side:
        return side
    summary: Side = to_json(summarize(side.pop("token_times_s"), workload.output_lens, 0.0, side.pop("elapsed_s")))
    return summary | side


@dataclass
class ThroughputReport:
    """``run_throughput_bench``'s result; peers are ``Side`` dicts (figures, or skipped / error)."""

    schema: str
    env: dict[str, Any]
    workload: dict[str, Any]
    kvgen_engine: ThroughputSummary
    kvgen_static: ThroughputSummary
    kvgen_peak_rss_bytes: int
    transformers_static: Side
    llama_cpp: Side
    ratios: dict[str, Any]


def run_throughput_bench(config: ThroughputBenchConfig) -> ThroughputReport:
    """Benchmark the engine against static batching, transformers and llama-cpp-python (see module docstring)."""
    from kvgen.engine import EngineArgs
    from kvgen.loader import load_model

    log = Progress(config.progress, "[bench:throughput]")
    threads, dtype = set_threads(config.num_threads), config.dtype or default_dtype()
    engine_args = EngineArgs(model=config.model, max_num_seqs=config.max_num_seqs, kv_cache_memory=config.kv_cache_memory,
                             max_num_batched_tokens=config.max_num_batched_tokens)  # the bench loads the model: no dtype here
    log(f"loading {config.model} ({dtype})")
    llm_model, _ = load_model(config.model, dtype=dtype)
    vocab_size = cast("ModelConfig", llm_model.config).vocab_size
    workload = make_workload(config.num_prompts, vocab_size, config.seed)
    env, described = environment_info(), _describe(workload, config, engine_args)
    described |= {"vocab_size": vocab_size, "dtype": dtype, "num_threads": threads}
    _warm_up(llm_model, engine_args)
    log(f"kvgen engine: {config.num_prompts} requests, continuous batching")
    engine = measure_kvgen(llm_model, workload, engine_args, None)
    log(f"kvgen engine: {engine.generated_tokens_per_s:.1f} tokens/s; now static batches of {config.static_batch_size}")
    static_args = dataclasses.replace(engine_args, max_num_seqs=config.static_batch_size)
    static = measure_kvgen(llm_model, workload, static_args, config.static_batch_size)
    log(f"kvgen static: {static.generated_tokens_per_s:.1f} tokens/s")
    rss = peak_rss_bytes()
    del llm_model
    hf: Side = {"skipped": "include_transformers=False"} if not config.include_transformers else (
        {"skipped": "transformers is not installed"} if env["transformers_version"] is None else run_peer(
            "transformers", "throughput", {"model": config.model, "dtype": dtype, "num_threads": threads,
                                           "static_batch_size": config.static_batch_size, **dataclasses.asdict(workload)}, log))
    cpp = _llama_cpp(config.model, workload, threads, log) if config.include_llama_cpp else {"skipped": "include_llama_cpp=False"}
    report = ThroughputReport(SCHEMA, env, described, engine, static, rss, hf, cpp, {})
    report.ratios = _ratios(to_json(report))
    env["load_average_1m_at_end"] = load_average()
    log("done")
    return report


def _describe(workload: Workload, config: ThroughputBenchConfig, engine_args: Any) -> dict[str, Any]:
    lens, outs = [len(p) for p in workload.prompt_token_ids], workload.output_lens
    return {
        "num_prompts": len(lens), "seed": config.seed, "prompt_tokens_total": sum(lens), "prompt_tokens_min_max": [min(lens), max(lens)],
        "output_tokens_total": sum(outs), "output_tokens_min_max": [min(outs), max(outs)],
        "decoding": "greedy, ignore_eos (transformers: min_new_tokens = max_new_tokens)",
        "arrivals": "all requests at t=0; TTFT includes queueing", "static_batch_size": config.static_batch_size,
        "engine_args": {k: v for k, v in dataclasses.asdict(engine_args).items() if k != "dtype"},
    }


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    def fig(name: str, key: str = "generated_tokens_per_s") -> float | None:
        return result.get(name, {}).get(key)

    def vs(peer: str) -> dict[str, float | None]:
        return {
            "generated_tokens_per_s": ratio(fig("kvgen_engine"), fig(peer)),
            "requests_per_s": ratio(fig("kvgen_engine", "requests_per_s"), fig(peer, "requests_per_s")),
            "ttft_p50_speedup": ratio(fig(peer, "ttft_p50_s"), fig("kvgen_engine", "ttft_p50_s")),
            "itl_p50_speedup": ratio(fig(peer, "itl_p50_s"), fig("kvgen_engine", "itl_p50_s")),
            "peak_rss_kvgen_over_peer": ratio(result.get("kvgen_peak_rss_bytes"), fig(peer, "peak_rss_bytes")),
        }

    return {
        "note": "kvgen_engine over each other system: > 1 is kvgen_engine better for *_per_s and *_speedup "
        "(peer seconds / kvgen seconds); peak_rss_kvgen_over_peer < 1 is kvgen smaller. over_*: generated tokens/s only",
        "vs_transformers": vs("transformers_static"), "vs_llama_cpp": vs("llama_cpp"),
        **{f"over_{name}": ratio(fig("kvgen_engine"), fig(name)) for name in SYSTEMS[1:]},
    }


def format_throughput_report(result: dict[str, Any]) -> str:
    """A human table of ``run_throughput_bench``'s JSON result (tokens/s, requests/s, seconds, MiB)."""
    w = result["workload"]
    lines = [
        (f"throughput bench: {w['num_prompts']} requests, prompts {w['prompt_tokens_min_max']} tokens "
         f"({w['prompt_tokens_total']} total), outputs {w['output_tokens_min_max']} ({w['output_tokens_total']} total), "
         f"{w['decoding']}; static batches of {w['static_batch_size']}"),
        f"{'system':<22}{'tokens/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'RSS MiB':>9}",
    ]
    for name in SYSTEMS:
        r = result.get(name, {})
        if "skipped" in r or "error" in r:
            lines.append(f"{name:<22}{r.get('skipped') or r.get('error')}")
            continue
        rss = r.get("peak_rss_bytes", result.get("kvgen_peak_rss_bytes") if name.startswith("kvgen") else None)
        cells = zip(("generated_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"),
                    (".1f", ".3f", ".2f", ".2f", ".3f", ".3f"), (10, 8, 10, 10, 9, 9))
        lines.append(f"{name:<22}" + "".join(f"{fmt(r[k], f):>{wd}}" for k, f, wd in cells) + f"{(rss or 0) / 2**20:>9.0f}")
    parts = [f"{k.removeprefix('over_')}: {v:.2f}x" for k, v in result.get("ratios", {}).items() if k.startswith("over_") and v is not None]
    lines.append("kvgen_engine tokens/s over " + ", ".join(parts) if parts else "no ratios")
    if prof := result.get("kvgen_engine", {}).get("profile"):
        lines.append("kvgen_engine time: " + ", ".join(f"{k} {v:.1f}" for k, v in prof.items() if k.endswith("_s")) + f" s over {prof['num_steps']} steps")
    return "\n".join(lines)
