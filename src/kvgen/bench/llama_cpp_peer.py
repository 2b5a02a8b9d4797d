"""The llama-cpp-python side of ``kvgen bench``: one process, no torch, so its peak RSS is its own.

The parent calls :func:`run_llama_cpp`; it runs this file as a script (importing
``kvgen`` would import torch) with the task on argv and the request (model path,
thread count, token ids) as JSON on stdin, and reads one JSON report from stdout.
Every task reports ``llama_cpp_version``, ``load_s`` (seconds to build ``Llama``)
and ``peak_rss_bytes`` (VmHWM). Tasks:

* ``decode``: batch-1 prefill and greedy decode through ``Llama.generate`` (top_k=1,
  temp=0; it never stops at EOS, each run is cut at its length), timed by the same
  harness as kvgen (``time_generation``), plus time to first token of a short prompt;
* ``throughput``: requests one at a time; raw token timestamps (seconds since the
  start) for the parent to summarize;
* ``perplexity``: ``logits_all=True``, one ``eval`` per window; summed NLL (nats)
  computed here from llama.cpp's logits, in float64.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__:
    from kvgen.bench.common import (
        RunStats,
        TokenTimer,
        peak_rss_bytes,
        time_generation,
        time_to_first_token,
        timed,
    )
else:  # run as a file by run_llama_cpp: sys.path[0] is this directory, and importing kvgen would import torch
    from common import (  # type: ignore[no-redef]
        RunStats,
        TokenTimer,
        peak_rss_bytes,
        time_generation,
        time_to_first_token,
        timed,
    )

TASKS = ("decode", "throughput", "perplexity")


def run_llama_cpp(task: str, request: dict[str, Any], log: Callable[[str], None], quiet: bool = False) -> dict[str, Any]:
    """Run ``task`` in a fresh llama-cpp-python process (see module docstring); ``{"skipped"}`` when
    llama_cpp is not importable, ``{"error"}`` when the process fails."""
    from kvgen.bench.common import run_side

    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama_cpp (llama-cpp-python) is not importable; pip install -e '.[bench]'"}
    return run_side(f"llama.cpp {task}", [str(Path(__file__).resolve()), task], log, request, quiet)


def _load(request: dict[str, Any], n_ctx: int, n_batch: int, logits_all: bool = False) -> tuple[Any, float]:
    """A ``Llama`` on ``request["model_path"]`` with ``request["num_threads"]`` threads (decode and batch);
    returns it and its load time in seconds."""
    from llama_cpp import Llama

    threads = request["num_threads"]
    return timed(lambda: Llama(model_path=request["model_path"], n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                               n_threads=threads, n_threads_batch=threads, logits_all=logits_all, verbose=False))


def _generate_fn(llm: Any) -> Callable[[list[int], int, TokenTimer | None], RunStats]:
    """kvgen's ``GenerateFn`` protocol over ``Llama.generate`` (greedy; cut at ``max_new_tokens``)."""

    def run(prompt_ids: list[int], max_new_tokens: int, streamer: TokenTimer | None) -> RunStats:
        llm.reset()  # n_tokens = 0: no prefix reuse from the previous run, the whole prompt is evaluated
        if streamer is not None:
            streamer.put(prompt_ids)
        new_ids: list[int] = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            new_ids.append(int(token))
            if streamer is not None:
                streamer.put(token)
            if len(new_ids) >= max_new_tokens:
                break
        return RunStats(len(prompt_ids), new_ids)

    return run


def task_decode(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``prompt_ids``, ``ttft_prompt_ids``, ``new_tokens``, ``num_prefill_repeats``."""
    prompt, new_tokens = request["prompt_ids"], request["new_tokens"]
    n_ctx = len(prompt) + new_tokens + 8
    llm, load_s = _load(request, n_ctx, min(n_ctx, max(512, len(prompt))))
    run = _generate_fn(llm)
    report = time_generation(run, prompt, new_tokens, request["num_prefill_repeats"])
    ttft_s = time_to_first_token(run, request["ttft_prompt_ids"], request["num_prefill_repeats"])
    return {"load_s": load_s, "configs": {"kv_cache": report}, "ttft_s": ttft_s,
            "ttft_prompt_tokens": len(request["ttft_prompt_ids"])}


def task_throughput(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``prompt_token_ids`` (one list per request) and ``output_lens``; one request at a time."""
    llm, load_s = _load(request, 1024, 512)
    run = _generate_fn(llm)
    run(request["prompt_token_ids"][0][:4], 2, None)  # warm-up, as kvgen's engine gets one
    token_times: list[list[float]] = []
    start = time.perf_counter()
    for prompt, output_len in zip(request["prompt_token_ids"], request["output_lens"]):
        timer = TokenTimer()
        run(prompt, output_len, timer)
        token_times.append([t - start for t in timer.times[1:]])  # times[0] is the prompt's put
    return {"load_s": load_s, "token_times_s": token_times, "elapsed_s": time.perf_counter() - start}


def window_nll(logits: Any, window: list[int]) -> float:
    """Summed NLL (nats, float64) of ``window[1:]`` under ``logits`` [len(window) - 1, V] (row i predicts token i + 1)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)  # [T-1, V]
    top = x.max(axis=1, keepdims=True)  # [T-1, 1]
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))  # [T-1]
    return float((log_z - x[np.arange(len(window) - 1), window[1:]]).sum())


def task_perplexity(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``windows`` (token id lists, each at most ``context_length`` long); each is scored alone."""
    n_ctx = request["context_length"]
    llm, load_s = _load(request, n_ctx, n_ctx, logits_all=True)
    total_nll, num_scored, start = 0.0, 0, time.perf_counter()
    for window in request["windows"]:
        llm.reset()
        llm.eval(window)
        total_nll += window_nll(llm.scores[: len(window) - 1], window)  # [T-1, V]
        num_scored += len(window) - 1
    return {"load_s": load_s, "total_nll": total_nll, "num_tokens_scored": num_scored,
            "num_windows": len(request["windows"]), "score_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    """``python llama_cpp_peer.py TASK < request.json``: one JSON report on stdout."""
    parser = argparse.ArgumentParser(prog="llama_cpp_peer.py", description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=TASKS)
    task = parser.parse_args(argv).task
    request = json.load(sys.stdin)
    import llama_cpp

    result = {"decode": task_decode, "throughput": task_throughput, "perplexity": task_perplexity}[task](request)
    result |= {"llama_cpp_version": llama_cpp.__version__, "num_threads": request["num_threads"],
               "peak_rss_bytes": peak_rss_bytes(), "is_torch_imported": "torch" in sys.modules}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
