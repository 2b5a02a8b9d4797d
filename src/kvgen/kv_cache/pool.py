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


class PoolMappingError(ValueError):
    """The system refused the anonymous mapping :func:`lazy_zeros` asked for (more bytes than the memory, or than an
    address holds)."""


def lazy_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
               ) -> list[torch.Tensor]:
    """``count`` zero tensors of ``shape`` and ``dtype`` as views of one anonymous mapping (CPU), committed page by
    page on first write; ``torch.zeros`` on other devices. Raises ``ValueError`` for an empty shape or count < 1,
    ``PoolMappingError`` (a ``ValueError``) when the system cannot map that many bytes."""
    numel = math.prod(shape)
    if count < 1 or numel < 1:
        raise ValueError(f"lazy_zeros needs count >= 1 and a non-empty shape, got {count} x {shape}")
    with torch.inference_mode(False):  # normal tensors even when grown inside generate(): a later write outside
        return _lazy_zeros(count, numel, shape, dtype, device)  # inference mode must still be able to update them


def _lazy_zeros(count: int, numel: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
                ) -> list[torch.Tensor]:
    """:func:`lazy_zeros` once checked: ``count`` tensors of ``shape`` (``numel`` elements each)."""
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    elem = torch.empty((), dtype=dtype).element_size()
    try:
        mapping = mmap.mmap(-1, count * numel * elem)
    except (OSError, OverflowError) as e:
        raise PoolMappingError(f"cannot map {count * numel * elem:,} bytes for {count} x {list(shape)} {dtype}: {e}") from None
    flat = torch.frombuffer(mapping, dtype=dtype)  # [count * numel], holds the mapping
    return [flat[i * numel : (i + 1) * numel].view(shape) for i in range(count)]


def row_scales(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An int8 cache's scales: per layer one float32 for each row of its K and V tensors of ``shape`` [..., D]
    (``lazy_zeros`` of ``shape[:-1]``), as (key scales, value scales); both lists empty for other dtypes."""
    scales = lazy_zeros(2 * num_layers, shape[:-1], torch.float32, device) if dtype == torch.int8 else []
    return scales[:num_layers], scales[num_layers:]


def refuse_int8(scales: list[torch.Tensor]) -> None:
    """Raise ``ValueError`` on a cache's torch path when it holds int8 rows (``scales`` non-empty): only the kernels
    read them."""
    if scales:
        raise ValueError("an int8 KV cache is read by kvgen's kernels only (a model on dtype 'auto')")
