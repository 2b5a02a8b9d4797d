"""The peers of ``kvgen bench``: transformers and llama-cpp-python, each run in its own process.

``python peers.py PEER TASK < request.json`` prints one JSON report (``harness.run_peer``
is the parent side). It runs as a file, so the llama.cpp tasks never import torch (their
peak RSS is llama.cpp's own); every report gets ``peak_rss_bytes`` (VmHWM). Tasks:

* ``transformers decode``: batch-1 ``generate`` per cache kind, timed like kvgen; TTFT.
* ``transformers throughput``: ``generate`` on left-padded static batches, each decoding
  the batch's longest output (``min_new_tokens = max_new_tokens``); only each request's
  own tokens count as useful.
* ``llama_cpp decode``: ``Llama.generate`` (top_k=1; never stops at EOS, cut at length).
* ``llama_cpp throughput``: requests one at a time; raw token timestamps since the start.
* ``llama_cpp perplexity``: ``logits_all=True``, one ``eval`` per window; summed NLL
  (nats) computed here from llama.cpp's logits in float64.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__:
    from kvgen.bench import harness
else:  # run as a file: sys.path[0] is this directory, and importing kvgen would import torch
    import harness  # type: ignore[no-redef]


def load_transformers(model: str, dtype: str) -> Any:
    """transformers' ``AutoModelForCausalLM`` on kvgen's ``model`` (a GGUF is dequantized), in eval mode.

    It runs at ``dtype`` when that names a torch dtype, else float32 (kvgen's ``auto`` keeps blocks quantized).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from kvgen.loader import DTYPES, resolve_model_path

    path = resolve_model_path(model)
    kwargs: dict[str, Any] = {"torch_dtype": DTYPES.get(dtype, torch.float32)} | ({} if path.is_dir() else {"gguf_file": path.name})
    return AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, **kwargs).eval()


def pad_token_id(hf_model: Any) -> int:
    """The model's pad id, else its (first) EOS id."""
    eos, pad = hf_model.generation_config.eos_token_id, hf_model.generation_config.pad_token_id
    return int(pad if pad is not None else (eos[0] if isinstance(eos, list) else eos))


def transformers_generate_fn(hf_model: Any, cache: str) -> harness.GenerateFn:
    """``GenerateFn`` over transformers ``generate``: greedy, fixed length (min = max new tokens), per cache kind."""
    import torch

    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {}
    if cache == "static":
        cache_args["cache_implementation"] = "static"
    pad = pad_token_id(hf_model)

    def run(prompt_ids: torch.Tensor, max_new_tokens: int, streamer: harness.TokenTimer | None) -> harness.RunStats:
        with torch.inference_mode():
            out = hf_model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False, pad_token_id=pad,
                                    max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, streamer=streamer, **cache_args)
        return harness.RunStats(prompt_ids.shape[1], out[0, prompt_ids.shape[1]:].tolist())  # out: [1, T + new]

    return run


def transformers_decode(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``config`` (``DecodeBenchConfig`` fields), ``vocab_size``."""
    from kvgen.bench.decode import DecodeBenchConfig, measure_caches
    from kvgen.bench.workloads import seeded_prompt_ids

    config = DecodeBenchConfig(**request["config"])
    log = harness.Progress(config.progress, "[bench:transformers]")
    rss_before = harness.current_rss_bytes()
    hf_model, load_s = harness.timed(lambda: load_transformers(config.model, str(config.dtype)))
    log(f"transformers: loaded in {load_s:.2f} s")
    vocab, seed = request["vocab_size"], config.seed
    configs = measure_caches(lambda c: transformers_generate_fn(hf_model, c), seeded_prompt_ids(config.prompt_tokens, vocab, seed), config, log, "transformers")
    ttft_ids = seeded_prompt_ids(config.ttft_prompt_tokens, vocab, seed)  # [1, ttft_prompt_tokens]
    ttft_s = harness.time_to_first_token(transformers_generate_fn(hf_model, "dynamic"), ttft_ids, config.num_prefill_repeats)
    return {"load_s": load_s, "rss_before_load_bytes": rss_before, "configs": configs, "ttft_s": ttft_s}


def transformers_throughput(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``model``, ``dtype``, ``prompt_token_ids``, ``output_lens``, ``static_batch_size``."""
    import torch

    from kvgen.bench.throughput import summarize
    from kvgen.bench.workloads import left_padded

    hf_model = load_transformers(request["model"], request["dtype"])
    pad = pad_token_id(hf_model)
    prompts, lens, size = request["prompt_token_ids"], request["output_lens"], request["static_batch_size"]
    token_times: list[list[float]] = [[] for _ in lens]
    with torch.inference_mode():  # warm-up
        hf_model.generate(torch.tensor([[100, 101, 102, 103]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                          max_new_tokens=2, do_sample=False, pad_token_id=pad)
    start, waste = time.perf_counter(), 0
    for rows in (range(b, min(b + size, len(lens))) for b in range(0, len(lens), size)):
        ids, mask = left_padded([prompts[i] for i in rows], pad)  # [B, T]
        new, timer = max(lens[i] for i in rows), harness.TokenTimer()
        with torch.inference_mode():
            hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad, streamer=timer)
        for i in rows:
            token_times[i] = timer.times[: lens[i]]
        waste += new * len(rows)
    result = summarize(token_times, lens, start, time.perf_counter())
    result.num_generated_tokens_including_waste = waste
    report: dict[str, Any] = harness.to_json(result)
    return report


def _llama(request: dict[str, Any], n_ctx: int, n_batch: int, logits_all: bool = False) -> tuple[Any, float]:
    """A ``Llama`` on ``request["model_path"]`` with ``request["num_threads"]`` threads; it and its load seconds."""
    from llama_cpp import Llama

    n = request["num_threads"]
    return harness.timed(lambda: Llama(model_path=request["model_path"], n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                       n_threads=n, n_threads_batch=n, logits_all=logits_all, verbose=False))


def llama_generate_fn(llm: Any) -> harness.GenerateFn:
    """``GenerateFn`` over ``Llama.generate`` (greedy; cut at ``max_new_tokens``; no prefix reuse between runs)."""

    def run(prompt_ids: list[int], max_new_tokens: int, streamer: harness.TokenTimer | None) -> harness.RunStats:
        llm.reset()
        if streamer is not None:
            streamer.put(prompt_ids)
        new_ids: list[int] = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            new_ids.append(int(token))
            if streamer is not None:
                streamer.put(token)
            if len(new_ids) >= max_new_tokens:
                break
        return harness.RunStats(len(prompt_ids), new_ids)

    return run


def llama_cpp_decode(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``prompt_ids``, ``ttft_prompt_ids``, ``new_tokens``, ``num_prefill_repeats``."""
    prompt, new_tokens = request["prompt_ids"], request["new_tokens"]
    n_ctx = len(prompt) + new_tokens + 8
    llm, load_s = _llama(request, n_ctx, min(n_ctx, max(512, len(prompt))))
    run = llama_generate_fn(llm)
    report = harness.time_generation(run, prompt, new_tokens, request["num_prefill_repeats"])
    ttft_s = harness.time_to_first_token(run, request["ttft_prompt_ids"], request["num_prefill_repeats"])
    return {"load_s": load_s, "configs": {"kv_cache": harness.to_json(report)}, "ttft_s": ttft_s,
            "ttft_prompt_tokens": len(request["ttft_prompt_ids"])}


def llama_cpp_throughput(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``prompt_token_ids`` (one list per request) and ``output_lens``; one request at a time."""
    llm, load_s = _llama(request, 1024, 512)
    run = llama_generate_fn(llm)
    run(request["prompt_token_ids"][0][:4], 2, None)  # warm-up, as kvgen's engine gets one
    token_times: list[list[float]] = []
    start = time.perf_counter()
    for prompt, output_len in zip(request["prompt_token_ids"], request["output_lens"]):
        timer = harness.TokenTimer()
        run(prompt, output_len, timer)
        token_times.append([t - start for t in timer.times])
    return {"load_s": load_s, "token_times_s": token_times, "elapsed_s": time.perf_counter() - start}


def window_nll(logits: Any, window: list[int]) -> float:
    """Summed NLL (nats, float64) of ``window[1:]`` under ``logits`` [len(window) - 1, V] (row i predicts token i + 1)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)  # [T-1, V]
    top = x.max(axis=1, keepdims=True)  # [T-1, 1]
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))  # [T-1]
    return float((log_z - x[np.arange(len(window) - 1), window[1:]]).sum())


def llama_cpp_perplexity(request: dict[str, Any]) -> dict[str, Any]:
    """Request: ``windows`` (token id lists, each at most ``context_length`` long); each is scored alone."""
    n_ctx = request["context_length"]
    llm, load_s = _llama(request, n_ctx, n_ctx, logits_all=True)
    total_nll, num_scored, start = 0.0, 0, time.perf_counter()
    for window in request["windows"]:
        llm.reset()
        llm.eval(window)
        total_nll += window_nll(llm.scores[: len(window) - 1], window)  # [T-1, V]
        num_scored += len(window) - 1
    return {"load_s": load_s, "total_nll": total_nll, "num_tokens_scored": num_scored,
            "num_windows": len(request["windows"]), "score_s": time.perf_counter() - start}


TASKS: dict[tuple[str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {
    ("transformers", "decode"): transformers_decode, ("transformers", "throughput"): transformers_throughput,
    ("llama_cpp", "decode"): llama_cpp_decode, ("llama_cpp", "throughput"): llama_cpp_throughput,
    ("llama_cpp", "perplexity"): llama_cpp_perplexity,
}


def main(argv: list[str] | None = None) -> int:
    """``python peers.py PEER TASK < request.json``: one JSON report on stdout (progress on stderr)."""
    parser = argparse.ArgumentParser(prog="peers.py", description=__doc__.split("\n")[0])
    parser.add_argument("peer", choices=["transformers", "llama_cpp"])
    parser.add_argument("task", choices=["decode", "throughput", "perplexity"])
    a = parser.parse_args(argv)
    request = json.load(sys.stdin)
    if a.peer == "transformers":
        harness.set_threads(request["num_threads"])
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON report
        result = TASKS[a.peer, a.task](request)
    if a.peer == "llama_cpp":
        import llama_cpp

        result |= {"llama_cpp_version": llama_cpp.__version__, "num_threads": request["num_threads"],
                   "is_torch_imported": "torch" in sys.modules}
    print(json.dumps(result | {"peak_rss_bytes": harness.peak_rss_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
