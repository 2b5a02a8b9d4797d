"""``kvgen bench serve``: OpenAI-API serving throughput of ``kvgen serve`` vs llama-cpp-python's server.

Workload: the throughput bench's (``bench.throughput.make_workload``: seeded prompt and
output lengths, ids uniform over the vocabulary), sent as decoded text to
``/v1/completions`` by the ``openai`` async client, streamed, ``max_tokens`` = the
request's output length and EOS banned (``logit_bias`` -100) so both servers generate
the same number of tokens. At each concurrency C the client keeps C requests in flight.
Servers: ``kvgen serve`` and ``python -m llama_cpp.server`` on the same GGUF, each a
subprocess on 127.0.0.1 with ``num_threads`` threads, started fresh per run.
Per server and concurrency: requests/s, output tokens/s, TTFT (from the request's send)
and ITL (gaps between streamed chunks) p50/p99 in seconds.
``ratios.vs_llama_cpp_server[C]``: throughput ours/theirs (> 1 = kvgen faster) and TTFT p99
theirs/ours (> 1 = kvgen's first tokens come sooner).
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
from collections.abc import Sequence
from typing import Any

from kvgen.bench.common import (
    Progress,
    environment_info,
    per_second,
    percentile,
    physical_cores,
    ratio,
)
from kvgen.bench.throughput import make_workload

SCHEMA = "kvgen.bench.serve/1"
READY_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before answering")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} did not answer within {timeout} s")


def start_server(system: str, gguf_path: str, dtype: str | None, num_threads: int) -> tuple[subprocess.Popen, str]:
    """Start ``kvgen`` or ``llama_cpp`` serving ``gguf_path``; returns (process, base URL) once it answers."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
    if system == "kvgen":
        cmd = [sys.executable, "-m", "kvgen.cli", "serve", "--model", gguf_path, "--port", str(port),
               "--served-model-name", "bench", "--log-level", "warning", *(["--dtype", dtype] if dtype else [])]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path, "--port", str(port), "--host", "127.0.0.1",
               "--n_threads", str(num_threads), "--model_alias", "bench", "--n_ctx", "2048"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, url


async def _one_request(client: Any, prompt: str, max_tokens: int, eos_id: int) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed chunk with text), ``time.perf_counter`` seconds."""
    sent = time.perf_counter()
    stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, logit_bias={str(eos_id): -100})
    times = [time.perf_counter() async for chunk in stream if chunk.choices and chunk.choices[0].text]
    return sent, times


async def run_load(base_url: str, prompts: list[str], output_lens: list[int], concurrency: int, eos_id: int) -> dict[str, Any]:
    """Send every request keeping ``concurrency`` in flight; the figures of the run."""
    import openai

    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=3600) as client:

        async def bounded(i: int) -> tuple[float, list[float]]:
            async with limit:
                return await _one_request(client, prompts[i], output_lens[i], eos_id)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(len(prompts))))
        end = time.perf_counter()
    ttft = [times[0] - sent for sent, times in results if times]
    itl = [b - a for _, times in results for a, b in itertools.pairwise(times)]
    return {
        "concurrency": concurrency, "elapsed_s": end - start, "num_requests": len(prompts),
        "num_output_tokens": sum(output_lens), "requests_per_s": per_second(len(prompts), end - start),
        "output_tokens_per_s": per_second(sum(output_lens), end - start),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
    }


def measure_system(system: str, gguf_path: str, dtype: str | None, num_threads: int, workload: tuple[list[str], list[int]],
                   concurrencies: Sequence[int], eos_id: int, log: Progress) -> dict[str, Any]:
    """One server's figures per concurrency (keys are the concurrency as a string), or ``{"error": ...}``."""
    try:
        proc, url = start_server(system, gguf_path, dtype, num_threads)
    except (RuntimeError, OSError) as e:
        return {"error": f"{system} server did not start: {e}"}
    try:
        out: dict[str, Any] = {}
        for c in concurrencies:
            log(f"{system}: {len(workload[0])} requests at concurrency {c}")
            out[str(c)] = asyncio.run(run_load(url, workload[0], workload[1], c, eos_id))
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


def run_serve_bench(model: str = "default", dtype: str | None = None, num_prompts: int = 32, seed: int = 0,
                    concurrencies: Sequence[int] = (1, 4, 16), include_llama_cpp: bool = True,
                    num_threads: int | None = None) -> dict[str, Any]:
    """The whole bench as a JSON-ready dict (see module docstring). Raises ``ValueError`` for a bad setting."""
    from kvgen.loader import resolve_model_path
    from kvgen.tokenizer import Tokenizer
    from kvgen.weights.gguf_file import gguf_metadata, open_gguf

    if any(c < 1 for c in concurrencies):
        raise ValueError(f"concurrency must be >= 1, got {list(concurrencies)}")
    path = resolve_model_path(model)
    if path.is_dir():
        raise ValueError(f"kvgen bench serve needs a GGUF file (llama.cpp serves the same file), got directory {path}")
    tokenizer = Tokenizer.from_gguf(gguf_metadata(open_gguf(path)))
    threads = num_threads or physical_cores()
    raw = make_workload(num_prompts, tokenizer.vocab_size, seed)
    prompts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in raw.prompt_token_ids]
    log, eos_id = Progress(), tokenizer.eos_token_id
    result: dict[str, Any] = {
        "schema": SCHEMA, "environment": environment_info(), "model": str(path), "num_threads": threads,
        "workload": {"num_prompts": num_prompts, "seed": seed, "concurrencies": list(concurrencies),
                     "num_output_tokens": sum(raw.output_lens)},
        "kvgen": measure_system("kvgen", str(path), dtype, threads, (prompts, raw.output_lens), concurrencies, eos_id, log),
    }
    missing = _llama_cpp_server_missing() if include_llama_cpp else "skipped (--no-llama-cpp)"
    result["llama_cpp_server"] = {"skipped": missing} if missing else measure_system(
        "llama_cpp", str(path), None, threads, (prompts, raw.output_lens), concurrencies, eos_id, log)
    result["ratios"] = {"vs_llama_cpp_server": _ratios(result["kvgen"], result["llama_cpp_server"], concurrencies)}
    return result


def _ratios(ours: dict[str, Any], theirs: dict[str, Any], concurrencies: Sequence[int]) -> dict[str, Any]:
    out = {}
    for c in map(str, concurrencies):
        a, b = ours.get(c), theirs.get(c)
        if isinstance(a, dict) and isinstance(b, dict):
            out[c] = {"output_tokens_per_s": ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
                      "ttft_p99_s": ratio(b["ttft_p99_s"], a["ttft_p99_s"])}
    return out


def format_serve_report(result: dict[str, Any]) -> str:
    """A short human-readable table of ``run_serve_bench``'s result."""
    lines = [f"kvgen bench serve: {result['workload']['num_prompts']} requests, {result['num_threads']} threads"]
    for system in ("kvgen", "llama_cpp_server"):
        runs = result[system]
        if "error" in runs or "skipped" in runs:
            lines.append(f"  {system}: {runs.get('error') or runs.get('skipped')}")
            continue
        for c, r in runs.items():
            lines.append(f"  {system:17s} c={c:>3s}  {r['output_tokens_per_s'] or 0:8.1f} tok/s"
                         f"  {r['requests_per_s'] or 0:6.2f} req/s"
                         f"  TTFT p50/p99 {r['ttft_p50_s'] or 0:.3f}/{r['ttft_p99_s'] or 0:.3f} s"
                         f"  ITL p50/p99 {r['itl_p50_s'] or 0:.4f}/{r['itl_p99_s'] or 0:.4f} s")
    for c, r in result["ratios"]["vs_llama_cpp_server"].items():
        speed, ttft = r["output_tokens_per_s"], r["ttft_p99_s"]
        lines.append(f"  vs llama.cpp server at c={c}: throughput x{speed}, TTFT p99 x{ttft}")
    return "\n".join(lines)
