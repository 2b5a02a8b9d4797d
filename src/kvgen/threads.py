"""CPU threads: kvgen's default is one torch intra-op thread per physical core (hyper-threads share a core's FMA
units, and the kernels are bound by them), within the process's affinity mask."""

from __future__ import annotations

import os

import psutil

# The most threads kvgen starts (llama.cpp's GGML_MAX_N_THREADS): far past any core count, short of the thousands
# that exhaust a process's thread limit.
MAX_THREADS = 512


def available_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    has_affinity = hasattr(psutil.Process, "cpu_affinity")  # not on macOS
    return len(psutil.Process().cpu_affinity() or []) if has_affinity else os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores, at most :func:`available_cpus` (one thread per core)."""
    return min(psutil.cpu_count(logical=False) or available_cpus(), available_cpus())


def set_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``num_threads``, else keep ``$OMP_NUM_THREADS`` where it is set (torch follows
    it already), else :func:`physical_cores`; returns the count. ``ValueError`` outside [1, :data:`MAX_THREADS`]."""
    import torch

    if num_threads is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    n = physical_cores() if num_threads is None else num_threads
    if not 1 <= n <= MAX_THREADS:
        raise ValueError(f"num_threads must be in [1, {MAX_THREADS}], got {n}")
    torch.set_num_threads(n)
    return n
