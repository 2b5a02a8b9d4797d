"""``kvgen bench throughput``: ``make_workload`` (all requests at t=0, greedy, EOS ignored) on ``LLMEngine`` with
continuous batching (``kvgen_engine``) and fed static batches (``kvgen_static``), vs transformers' left-padded static
batches and llama.cpp one request at a time (subprocesses): tokens/s, requests/s, TTFT and ITL, peak RSS, and the
engine's phase seconds (``profile``, by wrapping its methods from outside)."""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

from kvgen.bench import BenchConfig, BenchReport
from kvgen.bench import harness as h
from kvgen.bench.workloads import Workload, make_workload
from kvgen.engine import EngineArgs, LLMEngine, SamplingParams
from kvgen.fields import config_field as _f
from kvgen.loader import load_model

SCHEMA = "kvgen.bench.throughput/1"
SIDES = ("kvgen_engine", "kvgen_static", "transformers_static", "llama_cpp")  # its systems; harness.render's columns


@dataclasses.dataclass
class ThroughputBenchConfig(BenchConfig):
    """What ``run_throughput_bench`` measures. Raises ``ValueError`` for out-of-range values."""

    num_prompts: int = _f(64, "requests in the workload", minimum=1)
    seed: int = _f(0, "seed of the workload's torch.Generator")
    static_batch_size: int = _f(32, "requests per static batch (kvgen_static, transformers_static)", minimum=1)
    include_transformers: bool = _f(True, "time transformers (subprocess)")
    include_llama_cpp: bool = _f(True, "time llama-cpp-python (subprocess)")
    max_num_seqs: int = _f(64, "EngineArgs.max_num_seqs of kvgen_engine")
    max_num_batched_tokens: int = _f(512, "EngineArgs.max_num_batched_tokens of both kvgen systems")
    kv_cache_memory: int = _f(2 << 30, "EngineArgs.kv_cache_memory (bytes) of both kvgen systems")
    kv_cache_dtype: str = _f("auto", "EngineArgs.kv_cache_dtype of both kvgen systems: auto or int8")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine_args()  # its ValueError before the bench's progress lines, naming the flag

    def engine_args(self) -> EngineArgs:
        """The EngineArgs of ``kvgen_engine`` (no dtype: the model is loaded before it). Raises its ``ValueError``."""
        return EngineArgs(model=self.model, max_num_seqs=self.max_num_seqs, kv_cache_memory=self.kv_cache_memory,
                          kv_cache_dtype=self.kv_cache_dtype, max_num_batched_tokens=self.max_num_batched_tokens)


@dataclasses.dataclass
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


@dataclasses.dataclass
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
    num_generated_tokens_including_waste: int | None = h.optional()
    profile: EngineProfile | None = dataclasses.field(default=None, metadata=h.OMIT_IF_NONE)


def summarize(token_times: list[list[float]], output_lens: list[int], start: float, end: float) -> ThroughputSummary:
    """One system's figures from each request's token timestamps (seconds, on the clock of ``start``, ``end``)."""
    n, useful, elapsed = len(output_lens), sum(output_lens), end - start
    return ThroughputSummary(elapsed_s=elapsed, num_requests=n, num_useful_tokens=useful,
                             generated_tokens_per_s=h.per_second(useful, elapsed),
                             requests_per_s=h.per_second(n, elapsed), **h.latencies(token_times, [start] * n))


def profile_engine(engine: Any) -> EngineProfile:
    """Time ``engine``'s phases by wrapping its and its runner's methods on the instances (engine code untouched);
    ``output_s`` holds whole steps until :func:`finish_profile`."""
    prof, runner, scheduler = EngineProfile(), engine.runner, engine.scheduler

    def wrap(obj: Any, method: str, key: str, count: str = "", amount: Any = lambda _: 1) -> None:
        fn, owner = getattr(type(obj), method), weakref.ref(obj)  # no cycle: a dropped engine frees its KV pool

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            out, seconds = h.timed(lambda: fn(owner(), *args, **kwargs))
            setattr(prof, key, getattr(prof, key) + seconds)
            if count:
                setattr(prof, count, getattr(prof, count) + amount(out))
            return out

        setattr(obj, method, timed_call)

    wrap(engine, "step", "output_s", "num_steps")
    wrap(runner, "prepare_inputs", "runner_prepare_s", "num_packed_tokens", lambda step: step.input_ids.shape[1])
    for obj, method, key in ((scheduler, "schedule", "schedule_s"), (scheduler, "update_from_output", "update_s"),
                             (runner, "execute", "execute_s"), (runner, "run_model", "runner_forward_s"),
                             (runner, "compute_logits", "runner_logits_s"), (runner, "sample", "runner_sample_s")):
        wrap(obj, method, key)
    return prof


def finish_profile(prof: EngineProfile) -> EngineProfile:
    """``output_s`` = whole steps minus schedule, execute and update (see :func:`profile_engine`)."""
    prof.output_s -= prof.schedule_s + prof.execute_s + prof.update_s
    return prof


def measure_kvgen(model: Any, workload: Workload, engine_args: EngineArgs, static_batch_size: int | None
                  ) -> ThroughputSummary:
    """The workload on a fresh engine: continuous batching, or static batches when ``static_batch_size`` is set."""
    engine, n = LLMEngine(model, None, engine_args), len(workload.output_lens)
    prof, size = profile_engine(engine), static_batch_size or n
    token_times: list[list[float]] = [[] for _ in range(n)]
    start = time.perf_counter()
    for batch in (range(b, min(b + size, n)) for b in range(0, n, size)):  # the next batch once the previous finished
        for i in batch:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=workload.output_lens[i])
            engine.add_request(str(i), prompt_token_ids=workload.prompt_token_ids[i], sampling_params=params)
        while engine.has_unfinished_requests():
            outputs, now = engine.step(), time.perf_counter()
            for out in outputs:
                times = token_times[int(out.request_id)]
                times.extend([now] * (len(out.outputs[0].token_ids) - len(times)))
    result = summarize(token_times, workload.output_lens, start, time.perf_counter())
    result.profile = finish_profile(prof)
    return result


def peer_summary(side: h.Side, workload: Workload) -> h.Side:
    """A peer's token times (seconds from its start) summarized like kvgen's; a skipped or failed side unchanged."""
    if "token_times_s" not in side:
        return side
    summary = summarize(side.pop("token_times_s"), workload.output_lens, 0.0, side.pop("elapsed_s"))
    summary.num_generated_tokens_including_waste = side.pop("num_generated_tokens_including_waste", None)
    return dict(h.to_json(summary)) | side


@dataclasses.dataclass
class ThroughputReport(BenchReport):
    """``run_throughput_bench``'s result; peers are ``Side`` dicts (figures, or skipped / error)."""

    kvgen_engine: ThroughputSummary
    kvgen_static: ThroughputSummary
    kvgen_peak_rss_bytes: int
    transformers_static: h.Side
    llama_cpp: h.Side
    ratios: dict[str, Any]


def run_throughput_bench(config: ThroughputBenchConfig) -> ThroughputReport:
    """The engine against static batching, transformers and llama-cpp-python (see the module docstring)."""
    log, threads, env = h.start(config, "[bench:throughput]")
    engine_args = config.engine_args()
    log(f"loading {config.model} ({config.dtype})")
    model, _ = load_model(config.model, config.dtype, config.quantization)
    workload = make_workload(config.num_prompts, model.config.vocab_size, config.seed)
    lens, outs = [len(p) for p in workload.prompt_token_ids], workload.output_lens
    described = {"num_prompts": len(lens), "seed": config.seed, "prompt_tokens_total": sum(lens),
                 "prompt_tokens_min_max": [min(lens), max(lens)], "output_tokens_total": sum(outs),
                 "output_tokens_min_max": [min(outs), max(outs)], "decoding": "greedy, ignore_eos",
                 "arrivals": "all at t=0", "static_batch_size": config.static_batch_size,
                 "engine_args": {k: v for k, v in dataclasses.asdict(engine_args).items()
                                 if k not in ("dtype", "quantization")},  # the model is loaded: these two are below
                 "vocab_size": model.config.vocab_size, "dtype": config.dtype, "quantization": config.quantization,
                 "num_threads": threads}
    measure_kvgen(model, Workload([list(range(100, 164))], [4]), engine_args, None)  # warm-up: first-call paths
    log(f"kvgen engine: {config.num_prompts} requests, continuous batching, then static batches")
    engine = measure_kvgen(model, workload, engine_args, None)
    static_args = dataclasses.replace(engine_args, max_num_seqs=config.static_batch_size)
    static = measure_kvgen(model, workload, static_args, config.static_batch_size)
    log(f"kvgen engine: {engine.generated_tokens_per_s:.1f} tokens/s; static: {static.generated_tokens_per_s:.1f}")
    rss, request = h.peak_rss_bytes(), {"dtype": config.dtype, "num_threads": threads, **dataclasses.asdict(workload),
                                        "static_batch_size": config.static_batch_size}
    del model
    hf, cpp = (peer_summary(h.peer_side(peer, "throughput", on, config.model, log, request), workload)
               for peer, on in (("transformers", config.include_transformers), ("llama_cpp", config.include_llama_cpp)))
    report = ThroughputReport(schema=SCHEMA, env=env, workload=described, kvgen_engine=engine, kvgen_static=static,
                              kvgen_peak_rss_bytes=rss, transformers_static=hf, llama_cpp=cpp, ratios={})
    report.ratios = _ratios(h.to_json(report))
    env["load_average_1m_at_end"] = h.load_average()
    return report


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    def fig(name: str, key: str = "generated_tokens_per_s") -> Any:
        return result.get(name, {}).get(key)

    def vs(peer: str) -> dict[str, float | None]:
        return {"generated_tokens_per_s": h.ratio(fig("kvgen_engine"), fig(peer)),
                "requests_per_s": h.ratio(fig("kvgen_engine", "requests_per_s"), fig(peer, "requests_per_s")),
                "ttft_p50_speedup": h.ratio(fig(peer, "ttft_p50_s"), fig("kvgen_engine", "ttft_p50_s")),
                "itl_p50_speedup": h.ratio(fig(peer, "itl_p50_s"), fig("kvgen_engine", "itl_p50_s")),
                "peak_rss_kvgen_over_peer": h.ratio(result.get("kvgen_peak_rss_bytes"), fig(peer, "peak_rss_bytes"))}

    return {"note": "kvgen_engine over each system: > 1 is kvgen better, except *_kvgen_over_peer",
            "vs_transformers": vs("transformers_static"), "vs_llama_cpp": vs("llama_cpp"),
            **{f"over_{name}": h.ratio(fig("kvgen_engine"), fig(name)) for name in SIDES[1:]}}
