"""``kvgen bench serve``: OpenAI-API serving throughput of ``kvgen serve`` vs llama-cpp-python's server.

Workload: ``workloads.make_workload`` (seeded prompt and output lengths), sent as decoded
text to ``/v1/completions`` by the ``openai`` async client, streamed, ``max_tokens`` = the
request's output length and EOS banned (``logit_bias`` -100) so both servers generate the
same tokens. At concurrency C the client keeps C requests in flight. Servers: ``kvgen
serve`` and ``python -m llama_cpp.server`` on the same GGUF, subprocesses on 127.0.0.1,
started fresh per system. Per server and concurrency: requests/s, output tokens/s, TTFT
(from the request's send) and ITL (gaps between streamed chunks) p50/p99 in seconds.
``ratios.vs_llama_cpp_server[C]``: throughput ours/theirs, TTFT p99 theirs/ours (> 1: kvgen better).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvgen.bench.harness import (
    Progress,
    Side,
    environment_info,
    per_second,
    percentile,
    physical_cores,
    ratio,
    to_json,
)
from kvgen.bench.workloads import make_workload
from kvgen.fields import config_field as _f

SCHEMA = "kvgen.bench.serve/1"
READY_TIMEOUT_S = 300.0


@dataclass
class ServeBenchConfig:
    """What ``run_serve_bench`` measures. Raises ``ValueError`` for a concurrency below 1."""

    model: str = _f("default", "a .gguf file or 'default' (SmolLM2-135M-Instruct); llama.cpp serves the same file")
    dtype: str | None = _f(None, "kvgen's dtype, as load_model takes it (default: load_model's default)")
    num_prompts: int = _f(32, "requests per concurrency")
    seed: int = _f(0, "seed of the workload's torch.Generator")
    concurrency: tuple[int, ...] = _f((1, 4, 16), "requests kept in flight (one run each)")
    include_llama_cpp: bool = _f(True, "run llama-cpp-python's server")
    num_threads: int | None = _f(None, "threads of every engine (default: physical cores)", flags=("--threads", "--num-threads"))

    def __post_init__(self) -> None:
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be >= 1, got {list(self.concurrency)}")


@dataclass
class LoadRun:
    """One server at one concurrency (seconds, tokens/s, requests/s)."""

    concurrency: int
    elapsed_s: float
    num_requests: int
    num_output_tokens: int
    requests_per_s: float | None
    output_tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None


def start_server(system: str, gguf_path: str, dtype: str | None, num_threads: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``kvgen`` or ``llama_cpp`` serving ``gguf_path``; (process, base URL) once it answers ``/v1/models``."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if system == "kvgen":
        cmd = [sys.executable, "-m", "kvgen.cli", "serve", "--model", gguf_path, "--port", str(port),
               "--served-model-name", "bench", "--log-level", "warning", *(["--dtype", dtype] if dtype else [])]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path, "--port", str(port), "--host", "127.0.0.1",
               "--n_threads", str(num_threads), "--model_alias", "bench", "--n_ctx", "2048"]
    env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before answering")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server at {url} did not answer within {READY_TIMEOUT_S} s")


async def run_load(base_url: str, prompts: list[str], output_lens: list[int], concurrency: int, eos_id: int) -> LoadRun:
    """Send every request keeping ``concurrency`` in flight; the figures of the run."""
    import openai

    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=3600) as client:

        async def one(i: int) -> tuple[float, list[float]]:  # send time, arrival of each streamed chunk with text
            async with limit:
                sent = time.perf_counter()
                stream = await client.completions.create(model="bench", prompt=prompts[i], max_tokens=output_lens[i], temperature=0.0,
                                                         stream=True, logit_bias={str(eos_id): -100})
                return sent, [time.perf_counter() async for chunk in stream if chunk.choices and chunk.choices[0].text]

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        elapsed = time.perf_counter() - start
    ttft = [times[0] - sent for sent, times in results if times]
    itl = [b - a for _, times in results for a, b in itertools.pairwise(times)]
    n, tokens = len(prompts), sum(output_lens)
    return LoadRun(concurrency, elapsed, n, tokens, per_second(n, elapsed), per_second(tokens, elapsed), percentile(ttft, 50),
                   percentile(ttft, 99), percentile(itl, 50), percentile(itl, 99))


def measure_system(system: str, gguf_path: str, dtype: str | None, num_threads: int, workload: tuple[list[str], list[int]],
                   concurrencies: tuple[int, ...], eos_id: int, log: Progress) -> Side:
    """One server's runs keyed by the concurrency as a string, or ``{"error": ...}`` when it does not start."""
    try:
        proc, url = start_server(system, gguf_path, dtype, num_threads)
    except (RuntimeError, OSError) as e:
        return {"error": f"{system} server did not start: {e}"}
    try:
        out: Side = {}
        for c in concurrencies:
            log(f"{system}: {len(workload[0])} requests at concurrency {c}")
            out[str(c)] = to_json(asyncio.run(run_load(url, workload[0], workload[1], c, eos_id)))
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _llama_cpp_server_missing() -> str | None:
    for module in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[bench]' brings llama-cpp-python[server])"
    return None


@dataclass
class ServeReport:
    """``run_serve_bench``'s result: per server, ``LoadRun`` figures keyed by concurrency."""

    schema: str
    environment: dict[str, Any]
    model: str
    num_threads: int
    workload: dict[str, Any]
    kvgen: Side
    llama_cpp_server: Side
    ratios: dict[str, Any]


def run_serve_bench(config: ServeBenchConfig) -> ServeReport:
    """The whole bench (see module docstring). Raises ``ValueError`` for a Hugging Face directory."""
    from kvgen.loader import resolve_model_path
    from kvgen.tokenizer import Tokenizer
    from kvgen.weights.gguf_file import gguf_metadata, open_gguf

    path = resolve_model_path(config.model)
    if path.is_dir():
        raise ValueError(f"kvgen bench serve needs a GGUF file (llama.cpp serves the same file), got directory {path}")
    tokenizer = Tokenizer.from_gguf(gguf_metadata(open_gguf(path)))
    threads, eos_id, log = config.num_threads or physical_cores(), tokenizer.eos_token_id, Progress()
    if eos_id is None:
        raise ValueError(f"kvgen bench serve bans EOS by its id, but {path} names no eos_token_id")
    raw = make_workload(config.num_prompts, tokenizer.vocab_size, config.seed)
    workload = ([tokenizer.decode(ids, skip_special_tokens=True) for ids in raw.prompt_token_ids], raw.output_lens)
    ours = measure_system("kvgen", str(path), config.dtype, threads, workload, config.concurrency, eos_id, log)
    missing = _llama_cpp_server_missing() if config.include_llama_cpp else "skipped (--no-llama-cpp)"
    theirs: Side = {"skipped": missing} if missing else measure_system(
        "llama_cpp", str(path), None, threads, workload, config.concurrency, eos_id, log)
    ratios = {c: {"output_tokens_per_s": ratio(ours[c]["output_tokens_per_s"], theirs[c]["output_tokens_per_s"]),
                  "ttft_p99_s": ratio(theirs[c]["ttft_p99_s"], ours[c]["ttft_p99_s"])}
              for c in map(str, config.concurrency) if isinstance(ours.get(c), dict) and isinstance(theirs.get(c), dict)}
    described = {"num_prompts": config.num_prompts, "seed": config.seed, "concurrencies": list(config.concurrency),
                 "num_output_tokens": sum(raw.output_lens)}
    return ServeReport(SCHEMA, environment_info(), str(path), threads, described, ours, theirs, {"vs_llama_cpp_server": ratios})


def format_serve_report(result: dict[str, Any]) -> str:
    """A short human-readable table of ``run_serve_bench``'s JSON result."""
    lines = [f"kvgen bench serve: {result['workload']['num_prompts']} requests, {result['num_threads']} threads"]
    for system in ("kvgen", "llama_cpp_server"):
        runs = result[system]
        if "error" in runs or "skipped" in runs:
            lines.append(f"  {system}: {runs.get('error') or runs.get('skipped')}")
            continue
        for c, r in runs.items():
            lines.append(f"  {system:17s} c={c:>3s}  {r['output_tokens_per_s'] or 0:8.1f} tok/s  {r['requests_per_s'] or 0:6.2f} req/s"
                         f"  TTFT p50/p99 {r['ttft_p50_s'] or 0:.3f}/{r['ttft_p99_s'] or 0:.3f} s"
                         f"  ITL p50/p99 {r['itl_p50_s'] or 0:.4f}/{r['itl_p99_s'] or 0:.4f} s")
    for c, r in result["ratios"]["vs_llama_cpp_server"].items():
        lines.append(f"  vs llama.cpp server at c={c}: throughput x{r['output_tokens_per_s']}, TTFT p99 x{r['ttft_p99_s']}")
    return "\n".join(lines)
