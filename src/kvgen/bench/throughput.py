"""``kvgen bench throughput``: offline serving throughput of the engine vs static batching.

Workload (seeded by ``torch.Generator(seed)``): ``num_prompts`` requests, all
arriving at t=0; prompt lengths uniform in [16, 512] tokens of ids uniform over
the vocabulary, output lengths uniform in [16, 256]; greedy with EOS ignored, so
every request generates exactly its output length. Systems, timed in the same run:

* ``kvgen_engine``: ``LLMEngine`` continuous batching (paged KV, chunked prefill);
* ``kvgen_static``: the same engine fed static batches of ``static_batch_size`` requests
  in input order, each batch run to completion before the next is admitted;
* ``transformers_static``: ``generate()`` on static batches of ``static_batch_size``
  left-padded prompts (subprocess), each batch decoding ``max_new_tokens =
  min_new_tokens =`` the longest requested output of the batch; only each request's
  requested tokens count as useful (the rest of a row is wasted work, as it is in a
  static server);
* ``llama_cpp``: ``llama-cpp-python`` on the GGUF, one request at a time (its own
  torch-free subprocess, ``bench/llama_cpp_peer.py``), when it is importable.

Per system: useful generated tokens/s, requests/s, time to first token (TTFT: from
t=0, so queueing counts) and inter-token latency (ITL: gaps between a request's
consecutive tokens) p50/p99 in seconds, peak RSS of the process (VmHWM). kvgen runs
in this process; the others each in their own subprocess so their peak RSS is their own.
Every engine runs ``num_threads`` threads (default: physical cores). On a shared machine
pass ``num_threads=1``: with other processes on the cores, two OpenMP threads made
matmuls ~10x slower here (barrier waits on a descheduled thread).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvgen.bench.common import (
    Progress,
    default_dtype,
    environment_info,
    load_average,
    peak_rss_bytes,
    peer_torch_dtype,
    per_second,
    ratio,
    run_side,
    set_threads,
)
from kvgen.bench.llama_cpp_peer import run_llama_cpp

SCHEMA = "kvgen.bench.throughput/1"


@dataclass
class Workload:
    """prompt_token_ids[i] and output_lens[i] (tokens) of request i."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0, prompt_range: tuple[int, int] = (16, 512),
                  output_range: tuple[int, int] = (16, 256)) -> Workload:
    """The seeded workload (see module docstring); identical in every process for one torch version."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_prompts,), generator=gen).tolist()
    output_lens = torch.randint(output_range[0], output_range[1] + 1, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    return Workload(prompts, output_lens)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def summarize(token_times: list[list[float]], output_lens: list[int], start: float, end: float) -> dict[str, Any]:
    """Figures of one system from each request's token timestamps (seconds, ``time.perf_counter``)."""
    useful = sum(output_lens)
    ttft = [times[0] - start for times in token_times if times]
    itl = [b - a for times in token_times for a, b in itertools.pairwise(times)]
    elapsed = end - start
    return {
        "elapsed_s": elapsed,
        "num_requests": len(output_lens),
        "num_useful_tokens": useful,
        "generated_tokens_per_s": per_second(useful, elapsed),
        "requests_per_s": per_second(len(output_lens), elapsed),
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_p50_s": _percentile(itl, 0.5),
        "itl_p99_s": _percentile(itl, 0.99),
    }


# ------------------------------------------------------------------ kvgen


def _run_engine(engine: Any, workload: Workload, batches: list[range]) -> list[list[float]]:
    """Feed ``batches`` of request indices (the next once the previous finished); token timestamps per request."""
    from kvgen.engine import SamplingParams

    token_times: list[list[float]] = [[] for _ in workload.output_lens]
    for batch in batches:
        for i in batch:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=workload.output_lens[i])
            engine.add_request(str(i), prompt_token_ids=workload.prompt_token_ids[i], sampling_params=params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                times = token_times[int(out.request_id)]
                times.extend([now] * (len(out.outputs[0].token_ids) - len(times)))
    return token_times


def _engine_profile(engine: Any) -> dict[str, Any]:
    """Where the engine's time went (cumulative seconds per phase)."""
    e, r = engine.timings, engine.runner.timings
    return {
        "num_steps": e.num_steps, "schedule_s": e.schedule_s, "execute_s": e.execute_s, "update_s": e.update_s,
        "output_s": e.output_s, "runner_prepare_s": r.prepare_s, "runner_forward_s": r.forward_s,
        "runner_logits_s": r.logits_s, "runner_sample_s": r.sample_s, "num_packed_tokens": r.num_tokens,
    }


def measure_kvgen(model: Any, workload: Workload, engine_args: Any, static_batch_size: int | None) -> dict[str, Any]:
    """Run the workload on a fresh engine: continuous batching, or static batches when ``static_batch_size`` is set."""
    from kvgen.engine import LLMEngine

    engine = LLMEngine(model, None, engine_args)
    n = len(workload.output_lens)
    size = static_batch_size or n
    batches = [range(i, min(i + size, n)) for i in range(0, n, size)]
    start = time.perf_counter()
    token_times = _run_engine(engine, workload, batches)
    result = summarize(token_times, workload.output_lens, start, time.perf_counter())
    result["profile"] = _engine_profile(engine)
    return result


def _warm_up(model: Any, engine_args: Any) -> None:
    """One tiny request: first-call allocations and kernel selection stay out of the timings."""
    from kvgen.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, None, engine_args)
    engine.add_request("warm", prompt_token_ids=list(range(100, 164)), sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()


# ------------------------------------------------------------------ transformers / llama.cpp (subprocesses)


class _StepClock:
    """A ``generate(streamer=...)`` target that timestamps each decoding step (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._is_prompt = True

    def put(self, value: Any) -> None:
        if self._is_prompt:
            self._is_prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure_transformers_static(model_path: str, dtype: str, workload: Workload, batch_size: int) -> dict[str, Any]:
    """transformers ``generate`` on left-padded static batches (see module docstring)."""
    from transformers import AutoModelForCausalLM

    from kvgen.loader import resolve_model_path

    path = resolve_model_path(model_path)
    kwargs: dict[str, Any] = {"torch_dtype": peer_torch_dtype(dtype)}
    if not path.is_dir():
        kwargs["gguf_file"] = path.name
    model = AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, **kwargs).eval()
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
    n = len(workload.output_lens)
    token_times: list[list[float]] = [[] for _ in range(n)]
    with torch.inference_mode():  # warm-up
        model.generate(torch.tensor([[100, 101, 102, 103]]), attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    for b in range(0, n, batch_size):
        rows = list(range(b, min(b + batch_size, n)))
        width = max(len(workload.prompt_token_ids[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            p = workload.prompt_token_ids[i]
            ids[j, width - len(p):], mask[j, width - len(p):] = torch.tensor(p), 1
        new = max(workload.output_lens[i] for i in rows)
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad, streamer=clock)
        for i in rows:
            token_times[i] = clock.times[: workload.output_lens[i]]
    result = summarize(token_times, workload.output_lens, start, time.perf_counter())
    result["num_generated_tokens_including_waste"] = sum(
        max(workload.output_lens[i] for i in range(b, min(b + batch_size, n))) * len(range(b, min(b + batch_size, n)))
        for b in range(0, n, batch_size)
    )
    return result


def measure_llama_cpp(model_path: str, workload: Workload, num_threads: int, log: Progress) -> dict[str, Any]:
    """llama-cpp-python on the GGUF, one request at a time (greedy, cut at each output length), in its
    own torch-free process; its token timestamps are summarized here like every other system's."""
    from kvgen.loader import resolve_model_path

    path = resolve_model_path(model_path)
    if path.is_dir():
        return {"skipped": "llama.cpp reads GGUF files; the model is a Hugging Face directory"}
    request = {"model_path": str(path), "num_threads": num_threads,
               "prompt_token_ids": workload.prompt_token_ids, "output_lens": workload.output_lens}
    side = run_llama_cpp("throughput", request, log)
    if "token_times_s" not in side:
        return side
    result = summarize(side.pop("token_times_s"), workload.output_lens, 0.0, side.pop("elapsed_s"))
    return result | side


def _subprocess(side: str, config: dict[str, Any], log: Progress) -> dict[str, Any]:
    args = ["--side", side, "--json", "--num-prompts", str(config["num_prompts"]), "--seed", str(config["seed"]),
            "--model", config["model"], "--dtype", config["dtype"], "--static-batch-size", str(config["static_batch_size"]),
            "--threads", str(config["num_threads"]), "--vocab-size", str(config["vocab_size"])]
    code = "import sys; from kvgen.bench.throughput import main; sys.exit(main())"
    return run_side(side, ["-c", code, *args], log)


def _side_main(side: str, a: argparse.Namespace) -> dict[str, Any]:
    set_threads(a.num_threads)
    workload = make_workload(a.num_prompts, a.vocab_size, a.seed)
    with contextlib.redirect_stdout(sys.stderr):
        result = measure_transformers_static(a.model, a.dtype, workload, a.static_batch_size)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


# ------------------------------------------------------------------ the bench


def run_throughput_bench(
    num_prompts: int = 64,
    seed: int = 0,
    include_transformers: bool = True,
    include_llama_cpp: bool = True,
    model: str = "default",
    dtype: str | None = None,
    static_batch_size: int = 32,
    num_threads: int | None = None,
    progress: bool = True,
    **engine_overrides: Any,
) -> dict[str, Any]:
    """Benchmark the engine against static batching, transformers and llama-cpp-python (see module docstring).

    ``engine_overrides`` are ``EngineArgs`` fields (``max_num_seqs``, ``max_num_batched_tokens``,
    ``num_blocks``...). ``dtype`` is kvgen's (default: ``load_model``'s default). Returns a
    JSON-ready dict: ``env``, ``workload``, one entry per system (or ``{"skipped"|"error": ...}``)
    and ``ratios``. Progress goes to stderr.
    """
    from kvgen.engine import EngineArgs
    from kvgen.loader import load_model

    log = Progress(progress, "[bench:throughput]")
    threads = set_threads(num_threads)
    dtype = dtype or default_dtype()
    defaults = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_cache_memory": 2 << 30}
    # The bench loads the model itself (LLMEngine takes it built), so EngineArgs carries no dtype.
    engine_args = EngineArgs(model=model, **{**defaults, **engine_overrides})
    static_args = EngineArgs(**{**asdict(engine_args), "max_num_seqs": static_batch_size})
    log(f"loading {model} ({dtype})")
    llm_model, _ = load_model(model, dtype=dtype)
    workload = make_workload(num_prompts, llm_model.config.vocab_size, seed)
    vocab_size = llm_model.config.vocab_size
    result: dict[str, Any] = {"schema": SCHEMA, "env": environment_info(), "workload": _describe(workload, seed, static_batch_size, engine_args)}
    result["workload"] |= {"vocab_size": vocab_size, "dtype": dtype, "num_threads": threads}
    _warm_up(llm_model, engine_args)
    log(f"kvgen engine: {num_prompts} requests, continuous batching")
    result["kvgen_engine"] = measure_kvgen(llm_model, workload, engine_args, None)
    log(f"kvgen engine: {result['kvgen_engine']['generated_tokens_per_s']:.1f} tokens/s; now static batches of {static_batch_size}")
    result["kvgen_static"] = measure_kvgen(llm_model, workload, static_args, static_batch_size)
    log(f"kvgen static: {result['kvgen_static']['generated_tokens_per_s']:.1f} tokens/s")
    result["kvgen_peak_rss_bytes"] = peak_rss_bytes()
    del llm_model
    side_config = {"num_prompts": num_prompts, "seed": seed, "model": model, "dtype": dtype, "num_threads": threads,
                   "static_batch_size": static_batch_size, "vocab_size": vocab_size}
    if not include_transformers:
        result["transformers_static"] = {"skipped": "include_transformers=False"}
    elif result["env"]["transformers_version"] is None:
        result["transformers_static"] = {"skipped": "transformers is not installed"}
    else:
        result["transformers_static"] = _subprocess("transformers", side_config, log)
    if include_llama_cpp:
        result["llama_cpp"] = measure_llama_cpp(model, workload, threads, log)
    else:
        result["llama_cpp"] = {"skipped": "include_llama_cpp=False"}
    result["ratios"] = _ratios(result)
    result["env"]["load_average_1m_at_end"] = load_average()
    log("done")
    return result


def _describe(workload: Workload, seed: int, static_batch_size: int, engine_args: Any) -> dict[str, Any]:
    lens = [len(p) for p in workload.prompt_token_ids]
    return {
        "num_prompts": len(lens), "seed": seed,
        "prompt_tokens_total": sum(lens), "prompt_tokens_min_max": [min(lens), max(lens)],
        "output_tokens_total": sum(workload.output_lens), "output_tokens_min_max": [min(workload.output_lens), max(workload.output_lens)],
        "decoding": "greedy, ignore_eos (transformers: min_new_tokens = max_new_tokens)",
        "arrivals": "all requests at t=0; TTFT includes queueing",
        "static_batch_size": static_batch_size,
        "engine_args": {k: v for k, v in asdict(engine_args).items() if k != "dtype"},
    }


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    def tps(name: str) -> float | None:
        return result.get(name, {}).get("generated_tokens_per_s")

    def peer_ratios(peer: str) -> dict[str, float | None]:
        def fig(name: str, key: str) -> float | None:
            return result.get(name, {}).get(key)

        return {
            "generated_tokens_per_s": ratio(tps("kvgen_engine"), tps(peer)),
            "requests_per_s": ratio(fig("kvgen_engine", "requests_per_s"), fig(peer, "requests_per_s")),
            "ttft_p50_speedup": ratio(fig(peer, "ttft_p50_s"), fig("kvgen_engine", "ttft_p50_s")),
            "itl_p50_speedup": ratio(fig(peer, "itl_p50_s"), fig("kvgen_engine", "itl_p50_s")),
            "peak_rss_kvgen_over_peer": ratio(result.get("kvgen_peak_rss_bytes"), fig(peer, "peak_rss_bytes")),
        }

    ours = tps("kvgen_engine")
    return {
        "note": "kvgen_engine over each other system: > 1 is kvgen_engine better for *_per_s and *_speedup "
        "(peer seconds / kvgen seconds); peak_rss_kvgen_over_peer < 1 is kvgen smaller. over_*: generated tokens/s only",
        "vs_transformers": peer_ratios("transformers_static"),
        "vs_llama_cpp": peer_ratios("llama_cpp"),
        "over_kvgen_static": ratio(ours, tps("kvgen_static")),
        "over_transformers_static": ratio(ours, tps("transformers_static")),
        "over_llama_cpp": ratio(ours, tps("llama_cpp")),
    }


def format_throughput_report(result: dict[str, Any]) -> str:
    """A human table of ``run_throughput_bench``'s result (tokens/s, requests/s, seconds, MiB)."""
    w = result["workload"]
    lines = [
        f"throughput bench: {w['num_prompts']} requests, prompts {w['prompt_tokens_min_max']} tokens "
        f"({w['prompt_tokens_total']} total), outputs {w['output_tokens_min_max']} ({w['output_tokens_total']} total), "
        f"{w['decoding']}; static batches of {w['static_batch_size']}",
        f"{'system':<22}{'tokens/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'RSS MiB':>9}",
    ]
    for name in ("kvgen_engine", "kvgen_static", "transformers_static", "llama_cpp"):
        r = result.get(name, {})
        if "skipped" in r or "error" in r:
            lines.append(f"{name:<22}{r.get('skipped') or r.get('error')}")
            continue
        rss = r.get("peak_rss_bytes", result.get("kvgen_peak_rss_bytes") if name.startswith("kvgen") else None)
        cells = [r["generated_tokens_per_s"], r["requests_per_s"], r["ttft_p50_s"], r["ttft_p99_s"], r["itl_p50_s"], r["itl_p99_s"]]
        fmt = [".1f", ".3f", ".2f", ".2f", ".3f", ".3f"]
        text = "".join(f"{format(c, f) if c is not None else '-':>{wd}}" for c, f, wd in zip(cells, fmt, (10, 8, 10, 10, 9, 9)))
        lines.append(f"{name:<22}{text}{(rss or 0) / 2**20:>9.0f}")
    ratios = result.get("ratios", {})
    parts = [f"{k.removeprefix('over_')}: {v:.2f}x" for k, v in ratios.items() if k.startswith("over_") and v is not None]
    lines.append("kvgen_engine tokens/s over " + ", ".join(parts) if parts else "no ratios")
    prof = result.get("kvgen_engine", {}).get("profile")
    if prof:
        lines.append("kvgen_engine time: " + ", ".join(f"{k} {v:.1f}" for k, v in prof.items() if k.endswith("_s")) + f" s over {prof['num_steps']} steps")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvgen.bench.throughput``: the bench, or with ``--side`` one subprocess side of it."""
    parser = argparse.ArgumentParser(prog="python -m kvgen.bench.throughput")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--static-batch-size", type=int, default=32)
    parser.add_argument("--threads", "--num-threads", dest="num_threads", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--side", choices=["transformers"], default=None)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    if a.side:
        print(json.dumps(_side_main(a.side, a)))
        return 0
    result = run_throughput_bench(a.num_prompts, a.seed, not a.no_transformers, not a.no_llama_cpp, a.model, a.dtype,
                                  a.static_batch_size, a.num_threads)
    print(json.dumps(result, indent=2) if a.json else format_throughput_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
