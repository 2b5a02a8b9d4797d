"""A preallocated KV cache written in place (the Flax seeds' way, as gpt-fast)."""

from __future__ import annotations

import torch

from kvgen.errors import ContextLengthError
from kvgen.fields import check_int
from kvgen.kv_cache.pool import lazy_zeros, refuse_int8, row_scales


class StaticCache:
    """Per-layer K and V ``[B, Hkv, S_max, D]`` allocated once, written in place.

    ``seq_length`` slots (tokens) are filled, the same for every row; attention
    reads the view ``[:, :, :seq_length]``, so no step copies old entries.
    ``dtype=torch.int8`` stores each row (a token's K or V in one KV head) as int8 values and a float32 scale in
    ``key_scale`` / ``value_scale`` [B, Hkv, S_max] per layer (``kernels.reference.quantize_kv_rows``), read by the
    kernels only (:meth:`attend_rows`; :meth:`update` raises ``ValueError``); other dtypes have empty scale lists.
    Raises ``ValueError`` naming a size that is no int >= 1, ``ContextLengthError`` when a write would pass
    ``max_cache_len``.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("max_cache_len", max_cache_len)):
            check_int(name, value, 1)  # a float died in the allocation ("cannot be interpreted as an integer")
        shape = (batch_size, num_kv_heads, max_cache_len, head_dim)
        self.num_layers = num_layers
        self.max_cache_len = max_cache_len
        pool = lazy_zeros(2 * num_layers, shape, dtype, device)  # zeros, resident only where written
        self.key_cache, self.value_cache = pool[:num_layers], pool[num_layers:]
        self.key_scale, self.value_scale = row_scales(num_layers, shape, dtype, device)
        self.seq_length = 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ``[B, Hkv, T, D]`` at slots ``[seq_length, seq_length+T)``; return views ``[B, Hkv, S+T, D]``.
        Raises ``ValueError`` for an int8 cache (the kernels' :meth:`attend_rows` writes and reads it)."""
        refuse_int8(self.key_scale)
        start, end = self.seq_length, self.seq_length + k.shape[2]
        self.reserve(end)
        kc, vc = self.key_cache[layer_idx], self.value_cache[layer_idx]
        kc[:, :, start:end] = k
        vc[:, :, start:end] = v
        return kc[:, :, :end], vc[:, :, :end]  # [B, Hkv, S+T, D]

    def static_buffers(self, num_new: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """For a forward writing ``num_new`` tokens per row at slots ``seq_length..``: the per-layer K and V
        buffers [B, Hkv, S_max, D] and ``seq_length`` (the kernels write and read them in place).
        Raises ``ContextLengthError`` when the write would pass ``max_cache_len``."""
        self.reserve(self.seq_length + num_new)
        return self.key_cache, self.value_cache, self.seq_length

    def reserve(self, end: int) -> None:
        """Check that slots up to ``end`` (exclusive) fit. Raises ``ContextLengthError`` past ``max_cache_len``."""
        if end > self.max_cache_len:
            raise ContextLengthError(f"StaticCache holds {self.max_cache_len} tokens; writing up to slot {end} overflows it")

    def attend_rows(self, layer_idx: int, qkv: torch.Tensor, key_mask: torch.Tensor | None, num_heads: int,
                    scale: float, kernels, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Kernel path: write this forward's k, v from stacked rows qkv [B*T, (H + 2 Hkv) D] at slots
        ``seq_length..`` and attend (``kernels.static_attention``; ``window`` > 0: each query sees its last
        ``window`` slots; ``softcap`` > 0: scores capped to ``softcap * tanh(s / softcap)``; ``sinks`` [H] float32: one
        more logit per head's softmax, dropped). Returns [B*T, H D] float32.
        Raises ``ContextLengthError`` when the write would pass ``max_cache_len``."""
        keys, values, past = self.static_buffers(qkv.shape[0] // self.key_cache[0].shape[0])
        scales = (self.key_scale[layer_idx], self.value_scale[layer_idx]) if self.key_scale else ()
        return kernels.static_attention(qkv, keys[layer_idx], values[layer_idx], key_mask, past, num_heads, scale,
                                        window, softcap, sinks, *scales)

    def keys(self, layer_idx: int, end: int) -> torch.Tensor:
        """Layer ``layer_idx``'s keys in slots ``[0, end)``: [B, Hkv, end, D] as stored, int8 rows times their scales
        (float32)."""
        keys = self.key_cache[layer_idx][:, :, :end]
        return keys if not self.key_scale else keys.float() * self.key_scale[layer_idx][:, :, :end, None]

    def advance(self, num_new: int) -> None:
        """Record that ``num_new`` tokens were written by every layer."""
        self.seq_length += num_new

    def reorder(self, row_idx: torch.Tensor) -> None:
        """Gather rows ``row_idx [B']`` (beam search: follow each beam's parent).

        With B' == B the rows are rewritten in place; a different B' (expanding a
        prompt into beams or candidates, or selecting among them) reallocates
        ``[B', Hkv, S_max, D]`` per layer.
        """
        end = self.seq_length
        if row_idx.numel() != self.key_cache[0].shape[0]:
            self.key_cache = [_gather_rows(kc, row_idx, end) for kc in self.key_cache]
            self.value_cache = [_gather_rows(vc, row_idx, end) for vc in self.value_cache]
            self.key_scale = [_gather_rows(s, row_idx, end) for s in self.key_scale]
            self.value_scale = [_gather_rows(s, row_idx, end) for s in self.value_scale]
            return
        for t in self.key_cache + self.value_cache + self.key_scale + self.value_scale:
            t[:, :, :end] = t[:, :, :end].index_select(0, row_idx)

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (tokens); the memory stays allocated. ``ValueError`` unless
        ``length`` is an int >= 0."""
        check_int("length", length, 0)
        self.seq_length = min(self.seq_length, length)

    def layer_shape(self, layer_idx: int = 0) -> tuple[int, ...]:
        """Shape of the filled part of one layer's K cache ``[B, Hkv, S, D]``."""
        b, h, _, d = self.key_cache[layer_idx].shape
        return (b, h, self.seq_length, d)

    def nbytes(self) -> int:
        """Bytes allocated for K and V over all layers (int8: with their scales)."""
        tensors = self.key_cache + self.value_cache + self.key_scale + self.value_scale
        return sum(t.numel() * t.element_size() for t in tensors)


def _gather_rows(cache: torch.Tensor, row_idx: torch.Tensor, end: int) -> torch.Tensor:
    """A new ``[B', Hkv, S_max, ...]`` tensor (a cache's [.., D] or its scales') holding rows ``row_idx`` of
    ``cache``'s first ``end`` slots."""
    with torch.inference_mode(False):  # a normal tensor, so that writes outside inference mode may update it later
        out = cache.new_empty((row_idx.numel(), *cache.shape[1:]))  # slots past `end` are written before read
    out[:, :, :end] = cache[:, :, :end].index_select(0, row_idx)  # [B', Hkv, end, D]
    return out
