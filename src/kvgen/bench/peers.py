"""The systems ``kvgen bench`` times (kvgen, transformers, llama-cpp-python), each a :class:`System`, and the tasks run
on them: ``decode`` (:func:`time_generation` per cache kind), ``throughput``, ``perplexity``. The peers run in their
own process, ``python peers.py PEER TASK < request.json``, printing one JSON report with ``peak_rss_bytes``
(``harness.peer_side`` is the parent side); run as a file, so that llama.cpp never imports torch."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

if __package__:
    from kvgen.bench import harness as h
else:  # run as a file: sys.path[0] is this directory, and importing kvgen would import torch
    import harness as h  # type: ignore[no-redef]


@dataclasses.dataclass
class RunStats:
    """One generation: token counts, and the engine's own model-time split (seconds) if it has one."""

    num_prompt_tokens: int
    new_token_ids: list[int]
    model_prefill_s: float | None = None
    model_decode_s: float | None = None


# (prompt: ids [1, T] for kvgen, (ids, mask) [B, T] for transformers, list[int] for llama.cpp; max_new_tokens; streamer)
GenerateFn = Callable[[Any, int, "h.TokenTimer | None"], RunStats]


@dataclasses.dataclass
class System:
    """A loaded engine: its ``GenerateFn`` per cache kind, the prompt that fn takes from token id rows (llama.cpp:
    the first row), its load seconds, and the model object."""

    generate_fn: Callable[[str], GenerateFn]
    prompt: Callable[[list[list[int]]], Any]
    load_s: float
    model: Any = None


@dataclasses.dataclass
class GenerationTiming:
    """Batch-1 prefill and decode of one configuration (seconds, tokens/s); see :func:`time_generation`."""

    num_prompt_tokens: int
    num_requested_new_tokens: int
    num_new_tokens: int
    prefill_s: float
    prefill_tokens_per_s: float | None
    total_s: float
    decode_s: float
    decode_tokens_per_s: float | None
    num_decode_steps_timed: int
    decode_step_s_median: float | None
    decode_step_s_p90: float | None
    decode_tokens_per_s_at_median_step: float | None
    new_token_ids: list[int]
    model_prefill_s: float | None = h.optional()  # the engine's own split
    model_decode_s: float | None = h.optional()
    model_decode_tokens_per_s: float | None = h.optional()


def time_to_first_token(generate_fn: GenerateFn, prompt: Any, num_repeats: int = 3, warm_up: bool = True) -> float:
    """Median seconds of ``num_repeats`` 1-token generations, after a warm-up."""
    if warm_up:
        generate_fn(prompt, 1, None)
    return h.percentile([h.timed(lambda: generate_fn(prompt, 1, None))[1] for _ in range(num_repeats)], 50) or 0.0


def time_generation(generate_fn: GenerateFn, prompt: Any, new_tokens: int, num_prefill_repeats: int = 3
                    ) -> GenerationTiming:
    """A 2-token warm-up, ``prefill_s`` = median 1-token run, one timed run whose ``decode_s`` runs from its first
    streamed token to its last (``num_new_tokens - 1`` steps; ``total_s - prefill_s`` if it streamed fewer than two).
    ``total_s - prefill_s`` took the other runs' prefill for this one's: at a 2,048-token prompt on a noisy host it
    gave 3.4x the median step's rate."""
    generate_fn(prompt, 2, None)  # allocator, oneDNN primitives, first-call paths
    prefill_s, timer = time_to_first_token(generate_fn, prompt, num_prefill_repeats, warm_up=False), h.TokenTimer()
    stats, total_s = h.timed(lambda: generate_fn(prompt, new_tokens, timer))
    num_new, steps, times = len(stats.new_token_ids), timer.gaps(), timer.times  # steps: [num_new - 1]
    decode_s = times[-1] - times[0] if len(times) > 1 else total_s - prefill_s
    median, n = h.percentile(steps, 50), stats.num_prompt_tokens
    return GenerationTiming(
        num_prompt_tokens=n, num_requested_new_tokens=new_tokens, num_new_tokens=num_new, prefill_s=prefill_s,
        prefill_tokens_per_s=h.per_second(n, prefill_s), total_s=total_s, decode_s=decode_s,
        decode_tokens_per_s=h.per_second(num_new - 1, decode_s), num_decode_steps_timed=len(steps),
        decode_step_s_median=median, decode_step_s_p90=h.percentile(steps, 90),
        decode_tokens_per_s_at_median_step=h.per_second(1, median), new_token_ids=stats.new_token_ids,
        model_prefill_s=stats.model_prefill_s, model_decode_s=stats.model_decode_s,
        model_decode_tokens_per_s=h.per_second(num_new - 1, stats.model_decode_s))


def decode(system: System, request: dict[str, Any], log: Callable[[str], None]) -> h.Side:
    """:func:`time_generation` of ``request["prompt_ids"]`` per cache kind of ``new_tokens`` ({kind: count}; a failing
    one reports ``error``), then ``ttft_s`` on ``ttft_prompt_ids`` (cache ``ttft_cache``, default dynamic)."""
    configs: dict[str, h.Side] = {}
    for cache, n in request["new_tokens"].items():
        log(f"{cache}: warm-up, prefill x{request['num_prefill_repeats']}, {n} new tokens")
        try:
            timing = time_generation(system.generate_fn(cache), system.prompt([request["prompt_ids"]]), n,
                                     request["num_prefill_repeats"])
            configs[cache] = h.to_json(timing)
        except Exception as e:  # noqa: BLE001 -- one failing configuration is reported, the others still run
            configs[cache] = {"error": f"{type(e).__name__}: {e}"}
        r = configs[cache]
        log(f"{cache}: failed: {r['error']}" if "error" in r else f"{cache}: prefill {r['prefill_tokens_per_s'] or 0:.1f}, "
            f"decode {r['decode_tokens_per_s'] or 0:.1f} tokens/s")
    ttft_s = time_to_first_token(system.generate_fn(request.get("ttft_cache", "dynamic")),
                                 system.prompt([request["ttft_prompt_ids"]]), request["num_prefill_repeats"])
    return {"load_s": system.load_s, "configs": configs, "ttft_s": ttft_s,
            "ttft_prompt_tokens": len(request["ttft_prompt_ids"])}


def kvgen_generate_fn(model: Any, cache: str) -> GenerateFn:
    """``GenerateFn`` over kvgen ``generate`` (ids [1, T]): greedy, EOS disabled (``eos_token_id=[]``), per cache kind."""
    import torch

    from kvgen.generation import GenerationConfig, generate

    cache_args: dict[str, Any] = {"use_cache": False} if cache == "no_cache" else {"cache_implementation": cache}

    def run(prompt_ids: Any, max_new_tokens: int, streamer: h.TokenTimer | None) -> RunStats:
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0,
                                  **cache_args)
        # an explicit mask: pad_token_id 0 in a prompt is a token here, not padding to infer
        out = generate(model, prompt_ids, torch.ones_like(prompt_ids), config, streamer=streamer,
                       do_sample=False)  # over the model's config
        return RunStats(out.prompt_length, out.new_token_ids[0], out.timings.prefill_s, out.timings.decode_s)

    return run


def kvgen_system(model: Any, load_s: float) -> System:
    """kvgen's loaded ``model`` as a :class:`System` (prompts as ids [1, T] int64)."""
    import torch

    return System(partial(kvgen_generate_fn, model), torch.tensor, load_s, model)


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


def transformers_generate_fn(hf_model: Any, cache: str) -> GenerateFn:
    """``GenerateFn`` over transformers ``generate`` on a left-padded batch (ids, mask [B, T]): greedy, min = max new
    tokens, per cache kind; ``RunStats`` of row 0."""
    import torch

    per_cache: dict[str, dict[str, Any]] = {"no_cache": {"use_cache": False}, "static": {"cache_implementation": "static"}}
    args = per_cache.get(cache, {})

    def run(batch: tuple[torch.Tensor, torch.Tensor], max_new_tokens: int, streamer: h.TokenTimer | None) -> RunStats:
        ids, mask = batch
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=mask, do_sample=False, streamer=streamer,
                                    max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                    pad_token_id=pad_token_id(hf_model), **args)
        return RunStats(ids.shape[1], out[0, ids.shape[1]:].tolist())  # out: [B, T + new]

    return run


def llama_generate_fn(llm: Any, cache: str) -> GenerateFn:
    """``GenerateFn`` over ``Llama.generate`` (greedy; cut at ``max_new_tokens``; no prefix reuse between runs)."""

    def run(prompt_ids: list[int], max_new_tokens: int, streamer: h.TokenTimer | None) -> RunStats:
        llm.reset()
        new_ids: list[int] = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            new_ids.append(int(token))
            if streamer is not None:
                streamer.times.append(time.perf_counter())
            if len(new_ids) >= max_new_tokens:
                break
        return RunStats(len(prompt_ids), new_ids)

    return run


def open_peer(peer: str, request: dict[str, Any], n_ctx: int, n_batch: int, logits_all: bool = False) -> System:
    """``peer`` loaded on ``request["model_path"]`` (llama.cpp: ``n_ctx`` tokens, ``n_batch`` per batch, threads)."""
    if peer == "transformers":
        from kvgen.bench.workloads import left_padded

        hf_model, load_s = h.timed(lambda: load_transformers(request["model_path"], request["dtype"]))
        return System(partial(transformers_generate_fn, hf_model),
                      lambda rows: left_padded(rows, pad_token_id(hf_model)), load_s, hf_model)
    from llama_cpp import Llama

    n = request["num_threads"]
    llm, load_s = h.timed(lambda: Llama(model_path=request["model_path"], n_ctx=n_ctx, n_batch=n_batch,
                                        n_ubatch=n_batch, n_threads=n, n_threads_batch=n, logits_all=logits_all,
                                        verbose=False))
    return System(partial(llama_generate_fn, llm), lambda rows: rows[0], load_s, llm)


def decode_task(peer: str, request: dict[str, Any]) -> h.Side:
    """:func:`decode` of ``peer``, loaded with a context that fits the longest run."""
    rss_before, prompt = h.rss_bytes(), request["prompt_ids"]
    n_ctx = len(prompt) + max(request["new_tokens"].values()) + 8
    system = open_peer(peer, request, n_ctx, min(n_ctx, max(512, len(prompt))))
    return decode(system, request, h.Progress(request.get("progress", True), f"[bench:{peer}]")) | {
        "rss_before_load_bytes": rss_before}


def throughput_task(peer: str, request: dict[str, Any]) -> h.Side:
    """Static batches of ``prompt_token_ids`` (transformers: left-padded, each decoding its longest output; llama.cpp:
    one request at a time); each token's seconds from the start."""
    prompts, lens, system = request["prompt_token_ids"], request["output_lens"], open_peer(peer, request, 1024, 512)
    run, size = system.generate_fn("dynamic"), request["static_batch_size"] if peer == "transformers" else 1
    run(system.prompt([prompts[0][:4]]), 2, None)  # warm-up, as kvgen's engine gets one
    token_times: list[list[float]] = [[] for _ in lens]
    start, waste = time.perf_counter(), 0
    for rows in (range(b, min(b + size, len(lens))) for b in range(0, len(lens), size)):
        new, timer = max(lens[i] for i in rows), h.TokenTimer()
        run(system.prompt([prompts[i] for i in rows]), new, timer)
        for i in rows:
            token_times[i] = [t - start for t in timer.times[: lens[i]]]
        waste += new * len(rows)
    extra = {"num_generated_tokens_including_waste": waste} if peer == "transformers" else {"load_s": system.load_s}
    return {"token_times_s": token_times, "elapsed_s": time.perf_counter() - start, **extra}


def window_nll(logits: Any, window: list[int]) -> float:
    """Summed NLL (nats, float64) of ``window[1:]`` under ``logits`` [len(window) - 1, V] (row i predicts i + 1)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)  # [T-1, V]
    top = x.max(axis=1, keepdims=True)  # [T-1, 1]
    return float((top[:, 0] + np.log(np.exp(x - top).sum(axis=1)) - x[np.arange(len(window) - 1), window[1:]]).sum())


def perplexity_task(peer: str, request: dict[str, Any]) -> h.Side:
    """llama.cpp's summed NLL of each of ``windows`` (token id lists), scored alone from position 0."""
    system = open_peer(peer, request, request["context_length"], request["context_length"], logits_all=True)
    llm, total_nll, start = system.model, 0.0, time.perf_counter()
    for window in request["windows"]:
        llm.reset()
        llm.eval(window)
        total_nll += window_nll(llm.scores[: len(window) - 1], window)  # [T-1, V]
    return {"load_s": system.load_s, "total_nll": total_nll, "num_windows": len(request["windows"]),
            "num_tokens_scored": sum(len(w) - 1 for w in request["windows"]), "score_s": time.perf_counter() - start}


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
        result = {"decode": decode_task, "throughput": throughput_task, "perplexity": perplexity_task}[a.task](
            a.peer, request)
    if a.peer == "llama_cpp":
        import llama_cpp

        result |= {"llama_cpp_version": llama_cpp.__version__, "num_threads": request["num_threads"],
                   "is_torch_imported": "torch" in sys.modules}
    print(json.dumps(result | {"peak_rss_bytes": h.peak_rss_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
