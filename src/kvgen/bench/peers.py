"""The peers of ``kvgen bench``, each in its own process: ``python peers.py PEER TASK < request.json`` prints one
JSON report with ``peak_rss_bytes`` (``harness.peer_side`` is the parent side). Run as a file, so that llama.cpp
never imports torch."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

if __package__:
    from kvgen.bench import harness
else:  # run as a file: sys.path[0] is this directory, and importing kvgen would import torch
    import harness  # type: ignore[no-redef]


def load_transformers(model: str, dtype: str) -> Any:
    """transformers' ``AutoModelForCausalLM`` on kvgen's ``model`` (a GGUF is dequantized), eval mode, at ``dtype``
    if it is a torch dtype, else float32 (kvgen's ``auto`` keeps blocks quantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvgen.loader import DTYPES, resolve_model_path

    path = resolve_model_path(model)
    kwargs = {"torch_dtype": DTYPES.get(dtype, torch.float32)} | ({} if path.is_dir() else {"gguf_file": path.name})
    return AutoModelForCausalLM.from_pretrained(path if path.is_dir() else path.parent, **kwargs).eval()


def pad_token_id(hf_model: Any) -> int:
    """The model's pad id, else its (first) EOS id."""
    eos, pad = hf_model.generation_config.eos_token_id, hf_model.generation_config.pad_token_id
    return int(pad if pad is not None else (eos[0] if isinstance(eos, list) else eos))


def transformers_generate_fn(hf_model: Any, cache: str) -> harness.GenerateFn:
    """``GenerateFn`` over transformers ``generate`` on a left-padded batch (ids, mask [B, T]): greedy, min = max new
    tokens, per cache kind; ``RunStats`` of row 0."""
    import torch

    per_cache: dict[str, dict[str, Any]] = {"no_cache": {"use_cache": False},
                                            "static": {"cache_implementation": "static"}}
    args = per_cache.get(cache, {})

    def run(batch: tuple[torch.Tensor, torch.Tensor], max_new_tokens: int, streamer: harness.TokenTimer | None
            ) -> harness.RunStats:
        ids, mask = batch
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, do_sample=False, streamer=streamer,
                                    max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                    pad_token_id=pad_token_id(hf_model), **args)
        return harness.RunStats(ids.shape[1], out[0, ids.shape[1]:].tolist())  # out: [B, T + new]

    return run


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
        new_ids: list[int] = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            new_ids.append(int(token))
            if streamer is not None:
                streamer.times.append(time.perf_counter())
            if len(new_ids) >= max_new_tokens:
                break
        return harness.RunStats(len(prompt_ids), new_ids)

    return run


def _open(peer: str, request: dict[str, Any], n_ctx: int, n_batch: int
          ) -> tuple[Callable[[str], harness.GenerateFn], Callable[[list[list[int]]], Any], float]:
    """``peer`` loaded for ``request`` (llama.cpp: ``n_ctx`` tokens, ``n_batch`` per batch): its ``GenerateFn`` per
    cache kind, the prompt that fn takes from token id rows (llama.cpp: the first row), the load seconds."""
    if peer == "transformers":
        from kvgen.bench.workloads import left_padded

        hf_model, load_s = harness.timed(lambda: load_transformers(request["model_path"], request["dtype"]))
        return (partial(transformers_generate_fn, hf_model), lambda rows: left_padded(rows, pad_token_id(hf_model)),
                load_s)
    llm, load_s = _llama(request, n_ctx, n_batch)
    run = llama_generate_fn(llm)
    return (lambda _: run), (lambda rows: rows[0]), load_s


def decode(peer: str, request: dict[str, Any]) -> dict[str, Any]:
    """``harness.time_generation`` per cache kind of ``new_tokens`` ({kind: count}), and TTFT."""
    prompt, ttft_prompt, rss_before = request["prompt_ids"], request["ttft_prompt_ids"], harness.current_rss_bytes()
    n_ctx = len(prompt) + max(request["new_tokens"].values()) + 8
    generate_fn, batch, load_s = _open(peer, request, n_ctx, min(n_ctx, max(512, len(prompt))))
    log, repeats = harness.Progress(request.get("progress", True), f"[bench:{peer}]"), request["num_prefill_repeats"]
    runs = {c: (generate_fn(c), n) for c, n in request["new_tokens"].items()}
    report = {"load_s": load_s, "configs": harness.measure_caches(runs, batch([prompt]), repeats, log, peer),
              "ttft_s": harness.time_to_first_token(generate_fn("dynamic"), batch([ttft_prompt]), repeats)}
    is_hf = peer == "transformers"
    return report | ({"rss_before_load_bytes": rss_before} if is_hf else {"ttft_prompt_tokens": len(ttft_prompt)})


def throughput(peer: str, request: dict[str, Any]) -> dict[str, Any]:
    """Static batches of ``prompt_token_ids`` (transformers: left-padded, each decoding its longest output; llama.cpp:
    one request at a time); each token's seconds from the start."""
    prompts, lens = request["prompt_token_ids"], request["output_lens"]
    generate_fn, batch, load_s = _open(peer, request, 1024, 512)
    run, size = generate_fn("dynamic"), request["static_batch_size"] if peer == "transformers" else 1
    run(batch([prompts[0][:4]]), 2, None)  # warm-up, as kvgen's engine gets one
    token_times: list[list[float]] = [[] for _ in lens]
    start, waste = time.perf_counter(), 0
    for rows in (range(b, min(b + size, len(lens))) for b in range(0, len(lens), size)):
        new, timer = max(lens[i] for i in rows), harness.TokenTimer()
        run(batch([prompts[i] for i in rows]), new, timer)
        for i in rows:
            token_times[i] = [t - start for t in timer.times[: lens[i]]]
        waste += new * len(rows)
    extra = {"num_generated_tokens_including_waste": waste} if peer == "transformers" else {"load_s": load_s}
    return {"token_times_s": token_times, "elapsed_s": time.perf_counter() - start, **extra}


def window_nll(logits: Any, window: list[int]) -> float:
    """Summed NLL (nats, float64) of ``window[1:]`` under ``logits`` [len(window) - 1, V] (row i predicts i + 1)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)  # [T-1, V]
    top = x.max(axis=1, keepdims=True)  # [T-1, 1]
    return float((top[:, 0] + np.log(np.exp(x - top).sum(axis=1)) - x[np.arange(len(window) - 1), window[1:]]).sum())


def perplexity(peer: str, request: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's summed NLL of each of ``windows`` (token id lists), scored alone from position 0."""
    llm, load_s = _llama(request, request["context_length"], request["context_length"], logits_all=True)
    total_nll, start = 0.0, time.perf_counter()
    for window in request["windows"]:
        llm.reset()
        llm.eval(window)
        total_nll += window_nll(llm.scores[: len(window) - 1], window)  # [T-1, V]
    return {"load_s": load_s, "total_nll": total_nll, "num_tokens_scored": sum(len(w) - 1 for w in request["windows"]),
            "num_windows": len(request["windows"]), "score_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    """``python peers.py PEER TASK < request.json``: one JSON report on stdout (progress on stderr)."""
    parser = argparse.ArgumentParser(prog="peers.py", description="a kvgen bench peer")
    parser.add_argument("peer", choices=["transformers", "llama_cpp"])
    parser.add_argument("task", choices=["decode", "throughput", "perplexity"])
    a, request = parser.parse_args(argv), json.load(sys.stdin)
    if a.peer == "transformers":
        from kvgen.threads import set_threads

        set_threads(request["num_threads"])
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON report
        result = {"decode": decode, "throughput": throughput, "perplexity": perplexity}[a.task](a.peer, request)
    if a.peer == "llama_cpp":
        import llama_cpp

        result |= {"llama_cpp_version": llama_cpp.__version__, "num_threads": request["num_threads"],
                   "is_torch_imported": "torch" in sys.modules}
    print(json.dumps(result | {"peak_rss_bytes": harness.peak_rss_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
