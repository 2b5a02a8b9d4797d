"""Packed weights in 2 MiB transparent huge pages: one arena of anonymous mappings per loaded model.

A decode step streams every weight matrix once from DRAM, one after the other. Allocated one by one (torch's CPU
allocator, glibc) each matrix sits on its own 4 KiB pages: SmolLM2-135M's 121 packed matrices span ~23,000 pages,
and a small matrix read cold paid for its TLB misses (576 x 576 Q4_1, 0.2 MB: ~24 us cold vs ~8 us warm). Copied
back to back into mappings advised ``MADV_HUGEPAGE`` they span ~46 huge pages: a static-cache decode step at 512
tokens of context went 5.0-5.3 -> 4.1-4.7 ms (same process, interleaved, 2 threads; only the 30 MB LM head in huge
pages: 4.7-5.3 ms). Where the kernel has no transparent huge pages (``never``, or not Linux) weights stay where they
were allocated.

The loader packs each matrix straight into the arena. Packed elsewhere and copied in, the freed packings (up to the
30 MB LM head) raised glibc's dynamic mmap threshold, and a prefill's activations then stayed in the heap: +19 MiB
resident after a 512-token generation.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 64 << 20  # one mapping's size: a larger tensor gets its own mapping
ALIGN_BYTES = 64  # a cache line: each tensor starts on its own
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` can give this process transparent huge pages: Python's ``mmap`` has the
    advice and the kernel's mode (``THP_MODE``) is ``always`` or ``madvise``, not ``never``."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


class WeightArena:
    """Tensors back to back (64-byte aligned, from a 2 MiB boundary) in anonymous mappings advised ``MADV_HUGEPAGE``:
    :meth:`empty` gives a new one to write (the loader packs each weight straight into it), :meth:`adopt` a copy. A
    mapping lives as long as a tensor views it; its pages are committed as they are written, so an arena holds what
    it was given plus at most one huge page per mapping. Disabled (plain ``torch.empty``, ``adopt`` returns its
    argument) where :func:`huge_pages_available` is false or ``enabled=False``."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = huge_pages_available() if enabled is None else enabled
        self._chunk: torch.Tensor | None = None  # [bytes] uint8 view of the current mapping, from a huge page
        self._used = 0  # bytes of _chunk given out

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A new contiguous tensor of ``shape`` and ``dtype`` in the arena (zeros until written; ``torch.empty`` when
        disabled): what the loader packs a weight into. Raises ``OSError`` where the kernel refuses a new mapping (out
        of memory)."""
        if not self.enabled:
            return torch.empty(shape, dtype=dtype)
        return self._take(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (CPU, any dtype and shape) in the arena, contiguous, or ``t`` itself when disabled or
        not on the CPU. The caller drops ``t`` for the copy: its memory goes back to the allocator. Raises ``OSError``
        as :meth:`empty`."""
        if not self.enabled or t.device.type != "cpu" or t.numel() == 0:
            return t
        return self.empty(tuple(t.shape), t.dtype).copy_(t)

    def _take(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` of the arena: uint8 [nbytes], 64-byte aligned."""
        if nbytes > CHUNK_BYTES // 2:  # its own mapping: the current one keeps its free room
            return self._map(nbytes)[:nbytes]
        start = -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = self._map(CHUNK_BYTES), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes]

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        """A fresh mapping's bytes from its first 2 MiB boundary, at least ``nbytes`` of them: uint8 [bytes]."""
        size = -(-(nbytes + HUGE_PAGE_BYTES) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory takes no THP
        with contextlib.suppress(OSError):  # refused (a seccomp policy): the mapping still serves, in 4 KiB pages
            region.madvise(mmap.MADV_HUGEPAGE)
        flat = torch.frombuffer(region, dtype=torch.uint8)  # [size], holds the mapping
        head = -flat.data_ptr() % HUGE_PAGE_BYTES
        return flat[head : head + size - HUGE_PAGE_BYTES]
