"""Where a decode step's time goes, and where dense GEMM would beat the quantized kernels.

``step_breakdown``: batch-1 decode steps over a static cache after a prompt; wall seconds
per step, then (in a second, profiled run) the seconds per step inside linear layers
(``kvgen::qgemm``, or ``aten::linear`` on the float path). ``outside_linear_ms`` is the
difference: attention, norms, RoPE, cache writes, Python and dispatch.
``qgemm_crossover``: one Q4_1 matrix of the model's MLP shape, quantized kernel vs float32
``F.linear`` on the dequantized weight, for growing M; ``crossover_m`` is the smallest M at
which dense wins (None: the kernel wins everywhere measured, so it serves every M).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_OPS = ("kvgen::qgemm", "aten::linear")


@torch.inference_mode()
def step_breakdown(model: nn.Module, prompt_ids: torch.Tensor, num_steps: int = 32) -> dict[str, Any]:
    """prompt_ids [1, T] int64; returns ms per decode step: total, in linear layers, outside them."""
    from torch.profiler import ProfilerActivity, profile

    from kvgen.generation.runner import make_cache

    cache = make_cache(model, "static", 1, prompt_ids.shape[1] + 2 * num_steps + 2)
    model(prompt_ids, torch.arange(prompt_ids.shape[1])[None], cache)
    token = torch.tensor([[1]])
    lm_head = cast("Callable[[torch.Tensor], torch.Tensor]", model.compute_logits)

    def step() -> None:
        hidden = model(token, torch.tensor([[cache.seq_length]]), cache)  # [1, 1, C]
        lm_head(hidden[:, -1])  # [1, V]

    step()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    total_ms = (time.perf_counter() - start) / num_steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    linear_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in LINEAR_OPS)
    linear_ms = linear_us / num_steps / 1e3
    return {
        "context_tokens": prompt_ids.shape[1],
        "num_steps": num_steps,
        "step_ms": total_ms,
        "linear_ms": linear_ms,
        "outside_linear_ms": total_ms - linear_ms,
        "note": "linear_ms from a profiled run (profiler overhead included); outside = step - linear",
    }


def _time_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


@torch.inference_mode()
def qgemm_crossover(out_features: int = 3072, in_features: int = 576, ms: tuple[int, ...] = (1, 4, 16, 64, 256, 512)) -> dict[str, Any]:
    """µs per call of the Q4_1 kernel vs dense float32 on the dequantized weight, per M (rows)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kvgen.kernels import get_ops, pack_gguf_rows

    ops = get_ops()
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    raw = quantize(w.numpy(), GGMLQuantizationType.Q4_1)
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))  # [N, K] float32
    weight_type, packed = pack_gguf_rows("Q4_1", [torch.from_numpy(raw)])
    rows = []
    for m in ms:
        x = torch.randn(m, in_features)
        repeats = max(3, 2000 // m)
        q_us = _time_us(partial(ops.qgemm, x, packed, weight_type, out_features, None), repeats)
        d_us = _time_us(partial(F.linear, x, dense), repeats)
        rows.append({"m": m, "qgemm_us": q_us, "dense_fp32_us": d_us, "qgemm_speedup": d_us / q_us})
    crossover = next((r["m"] for r in rows if r["dense_fp32_us"] < r["qgemm_us"]), None)
    return {"shape": [out_features, in_features], "backend": ops.backend, "rows": rows, "crossover_m": crossover}
