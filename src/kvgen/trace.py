"""``--trace``: show prefill once, then a cache growing by one token per step.

A forward hook on the model records, per call, the input shape, one layer's K
and V cache shapes and the latency; nothing in the model changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class StepTrace:
    """One forward: input ``[B, T]``, layer-0 K/V cache shape after it, latency in seconds."""

    input_shape: tuple[int, ...]
    k_cache_shape: tuple[int, ...]
    v_cache_shape: tuple[int, ...]
    latency_s: float


@dataclass
class Tracer:
    """Context manager that records a :class:`StepTrace` per model forward."""

    model: nn.Module
    steps: list[StepTrace] = field(default_factory=list)

    def __enter__(self) -> Tracer:
        self._start = 0.0
        self._pre = self.model.register_forward_pre_hook(self._before)
        self._post = self.model.register_forward_hook(self._after)
        return self

    def __exit__(self, *exc: object) -> None:
        self._pre.remove()
        self._post.remove()

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._start = time.perf_counter()

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        latency = time.perf_counter() - self._start
        cache = args[2] if len(args) > 2 else None
        kv_shape = cache.layer_shape(0) if cache is not None else ()
        self.steps.append(StepTrace(tuple(args[0].shape), kv_shape, kv_shape, latency))


def format_step(i: int, step: StepTrace) -> str:
    """One human line per step."""
    phase = "prefill" if i == 0 else "decode "
    kv = "no cache" if not step.k_cache_shape else f"K {list(step.k_cache_shape)} V {list(step.v_cache_shape)}"
    return f"[trace] step {i:3d} {phase} input {list(step.input_shape)}  {kv}  {step.latency_s * 1000:.1f} ms"


def plot_latencies(with_cache: list[float], without_cache: list[float], path: str) -> None:
    """Save a PNG of per-token latency (ms) against step, with and without the KV cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(with_cache)), [s * 1000 for s in with_cache], label="with KV cache")
    ax.plot(range(len(without_cache)), [s * 1000 for s in without_cache], label="without cache (recompute)")
    ax.set_xlabel("step (0 = prefill)")
    ax.set_ylabel("latency per token (ms)")
    ax.set_title("kvgen: per-step latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
