"""KV-cache memory committed as it is written: zeros from one anonymous ``mmap``.

``torch.zeros`` writes every byte, so a 1 GiB pool is resident from the start. An anonymous
mapping reads as zeros and the kernel commits each page on its first write, so a cache costs
resident memory only for the tokens stored so far (``kvgen serve`` idles near the model's size,
not the pool's). Freed with the last tensor that views it.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
               ) -> list[torch.Tensor]:
    """``count`` zero tensors of ``shape`` and ``dtype`` as views of one anonymous mapping (CPU), committed page by
    page on first write; ``torch.zeros`` on other devices. Raises ``ValueError`` for an empty shape or count < 1."""
    numel = math.prod(shape)
    if count < 1 or numel < 1:
        raise ValueError(f"lazy_zeros needs count >= 1 and a non-empty shape, got {count} x {shape}")
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    elem = torch.empty((), dtype=dtype).element_size()
    flat = torch.frombuffer(mmap.mmap(-1, count * numel * elem), dtype=dtype)  # [count * numel], holds the mapping
    return [flat[i * numel : (i + 1) * numel].view(shape) for i in range(count)]
