"""``kvgen bench serve``: ``kvgen serve`` vs llama-cpp-python's server on the same GGUF (fresh subprocesses), the
``openai`` async client streaming ``make_workload`` as text to ``/v1/completions`` with C requests in flight, EOS
banned so both generate ``max_tokens``. Each C gets its own prompts (the next ``num_prompts`` of one workload): a run
never finds an earlier run's prompts in a prefix cache. Per server and C: requests/s, output tokens/s, TTFT and ITL
in seconds."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvgen.bench import BenchConfig
from kvgen.bench import harness as h
from kvgen.bench.workloads import Workload, make_workload
from kvgen.fields import config_field as _f
from kvgen.loader import resolve_model_path
from kvgen.tokenizer import Tokenizer
from kvgen.weights.gguf_file import gguf_metadata, open_gguf

SCHEMA = "kvgen.bench.serve/2"  # /2: distinct prompts per concurrency
SIDES = ("kvgen", "llama_cpp_server")  # the columns of its text table (harness.render)


@dataclass
class ServeBenchConfig(BenchConfig):
    """What ``run_serve_bench`` measures. Raises ``ValueError`` for a concurrency below 1."""

    num_prompts: int = _f(32, "requests per concurrency", minimum=1)
    seed: int = _f(0, "seed of the workload's torch.Generator")
    concurrency: tuple[int, ...] = _f((1, 4, 16), "requests kept in flight (one run each)", minimum=1)
    include_llama_cpp: bool = _f(True, "run llama-cpp-python's server")


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


@contextlib.contextmanager
def serving(system: str, gguf_path: str, dtype: str, threads: int, quantization: str | None = None
            ) -> Iterator[str]:
    """``kvgen`` (with ``dtype`` and ``quantization``) or ``llama_cpp`` serving ``gguf_path`` in a subprocess, stopped
    on exit; its base URL once it answers. Raises ``RuntimeError`` when it exits or does not answer within 300 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = (["kvgen.cli", "serve", "--served-model-name", "bench", "--log-level", "warning", "--dtype", dtype,
            *(["--quantization", quantization] if quantization else [])]
           if system == "kvgen" else ["llama_cpp.server", "--host", "127.0.0.1", "--n_threads", str(threads),
                                      "--model_alias", "bench", "--n_ctx", "2048"])
    proc = subprocess.Popen([sys.executable, "-m", *cmd, "--model", gguf_path, "--port", port],
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    try:
        while not _answers(url + "/v1/models"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} exited with status {proc.returncode} or did not answer within 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _answers(url: str) -> bool:
    import httpx

    with contextlib.suppress(httpx.TransportError):
        return httpx.get(url, timeout=2).status_code == 200
    return False


async def run_load(base_url: str, prompts: list[str], output_lens: list[int], concurrency: int, eos_id: int) -> LoadRun:
    """Send every request keeping ``concurrency`` in flight; the figures of the run."""
    import openai

    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=3600) as client:

        async def one(i: int) -> tuple[float, list[float]]:  # send time, arrival of each streamed chunk with text
            async with limit:
                sent = time.perf_counter()
                stream = await client.completions.create(model="bench", prompt=prompts[i], max_tokens=output_lens[i],
                                                         temperature=0.0, stream=True, logit_bias={str(eos_id): -100})
                return sent, [time.perf_counter() async for chunk in stream if chunk.choices and chunk.choices[0].text]

        start = time.perf_counter()
        sent, times = zip(*await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        elapsed = time.perf_counter() - start
    n, tokens = len(prompts), sum(output_lens)
    return LoadRun(concurrency=concurrency, elapsed_s=elapsed, num_requests=n, num_output_tokens=tokens,
                   requests_per_s=h.per_second(n, elapsed), output_tokens_per_s=h.per_second(tokens, elapsed),
                   **h.latencies(list(times), list(sent)))


def measure_system(system: str, path: str, threads: int, workloads: list[tuple[list[str], list[int]]],
                   config: ServeBenchConfig, eos_id: int, log: h.Progress) -> h.Side:
    """One server's runs keyed by the concurrency as a string (``workloads[j]``: prompts and output lengths of the
    j-th concurrency), or ``{"error": ...}`` when it fails."""
    try:
        with serving(system, path, config.dtype, threads, config.quantization) as url:
            log(f"{system}: {config.num_prompts} requests at each concurrency of {list(config.concurrency)}")
            return {str(c): h.to_json(asyncio.run(run_load(url, *w, c, eos_id)))
                    for c, w in zip(config.concurrency, workloads)}
    except (RuntimeError, OSError) as e:
        return {"error": f"{system} server failed: {e}"}


def split_workload(num_prompts: int, num_runs: int, vocab_size: int, seed: int) -> list[Workload]:
    """``num_runs`` request mixes of ``num_prompts`` each: consecutive slices of one ``make_workload``, so no run
    repeats another's prompts (a prefix cache would serve them)."""
    w, n = make_workload(num_prompts * num_runs, vocab_size, seed), num_prompts
    return [Workload(w.prompt_token_ids[j * n:(j + 1) * n], w.output_lens[j * n:(j + 1) * n]) for j in range(num_runs)]


@dataclass
class ServeReport:
    """``run_serve_bench``'s result: per server, ``LoadRun`` figures keyed by concurrency."""

    schema: str
    environment: dict[str, Any]
    model: str
    num_threads: int
    workload: dict[str, Any]
    kvgen: h.Side
    llama_cpp_server: h.Side
    ratios: dict[str, Any]


def run_serve_bench(config: ServeBenchConfig) -> ServeReport:
    """The whole bench (see the module docstring). ``ValueError`` for a Hugging Face directory or a GGUF without EOS."""
    path = resolve_model_path(config.model)
    if path.is_dir():
        raise ValueError(f"kvgen bench serve needs a GGUF file (llama.cpp serves the same file), got directory {path}")
    tokenizer = Tokenizer.from_gguf(gguf_metadata(open_gguf(path)))
    if (eos_id := tokenizer.eos_token_id) is None:
        raise ValueError(f"kvgen bench serve bans EOS by its id, but {path} names no eos_token_id")
    log, threads, env = h.start(config)
    workloads = [([tokenizer.decode(ids, skip_special_tokens=True) for ids in w.prompt_token_ids], w.output_lens)
                 for w in split_workload(config.num_prompts, len(config.concurrency), tokenizer.vocab_size, config.seed)]
    ours = measure_system("kvgen", str(path), threads, workloads, config, eos_id, log)
    missing = next((m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
                    if importlib.util.find_spec(m) is None), None)
    theirs: h.Side = (
        {"skipped": "skipped (--no-llama-cpp)"} if not config.include_llama_cpp
        else {"skipped": f"{missing} is not installed (pip install -e '.[bench]')"} if missing
        else measure_system("llama_cpp", str(path), threads, workloads, config, eos_id, log))
    ratios = {c: {"output_tokens_per_s": h.ratio(ours[c]["output_tokens_per_s"], theirs[c]["output_tokens_per_s"]),
                  "ttft_p99_s": h.ratio(theirs[c]["ttft_p99_s"], ours[c]["ttft_p99_s"])}
              for c in map(str, config.concurrency) if c in ours and c in theirs}
    described = {"num_prompts": config.num_prompts, "seed": config.seed, "concurrencies": list(config.concurrency),
                 "num_output_tokens": [sum(lens) for _, lens in workloads],
                 "prompts": "distinct per concurrency: the next num_prompts of one seeded workload"}
    return ServeReport(schema=SCHEMA, environment=env, model=str(path), num_threads=threads, workload=described,
                       kvgen=ours, llama_cpp_server=theirs, ratios={"vs_llama_cpp_server": ratios})
