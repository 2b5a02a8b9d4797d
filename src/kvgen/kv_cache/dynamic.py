"""A KV cache that grows by concatenation (the PyTorch seeds' way)."""

from __future__ import annotations

import torch


class DynamicCache:
    """Per-layer K and V ``[B, Hkv, S, D]`` that grow by ``torch.cat`` each forward.

    Every row holds the same number of slots ``seq_length`` (tokens); padding of
    left-padded batches is described by the attention mask, not here. Each
    step copies the whole cache (O(S) per token): kept as the simple reference
    that ``StaticCache`` is measured against.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.key_cache: list[torch.Tensor | None] = [None] * num_layers
        self.value_cache: list[torch.Tensor | None] = [None] * num_layers
        self.seq_length = 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v ``[B, Hkv, T, D]`` at slot ``seq_length``; return all keys/values ``[B, Hkv, S+T, D]``."""
        old_k, old_v = self.key_cache[layer_idx], self.value_cache[layer_idx]
        if old_k is None or old_v is None:
            new_k, new_v = k, v
        else:
            new_k = torch.cat([old_k, k], dim=2)  # [B, Hkv, S+T, D]
            new_v = torch.cat([old_v, v], dim=2)  # [B, Hkv, S+T, D]
        self.key_cache[layer_idx], self.value_cache[layer_idx] = new_k, new_v
        return new_k, new_v

    def advance(self, num_new: int) -> None:
        """Record that ``num_new`` tokens were written by every layer."""
        self.seq_length += num_new

    def reorder(self, row_idx: torch.Tensor) -> None:
        """Gather rows ``row_idx [B']`` (beam search: follow each beam's parent); B' may differ from B."""
        for i in range(self.num_layers):
            k, v = self.key_cache[i], self.value_cache[i]
            if k is not None and v is not None:
                self.key_cache[i] = k.index_select(0, row_idx)
                self.value_cache[i] = v.index_select(0, row_idx)

    def crop(self, length: int) -> None:
        """Drop every slot from ``length`` on (tokens)."""
        for i in range(self.num_layers):
            k, v = self.key_cache[i], self.value_cache[i]
            if k is not None and v is not None:
                self.key_cache[i], self.value_cache[i] = k[:, :, :length], v[:, :, :length]
        self.seq_length = min(self.seq_length, length)

    def layer_shape(self, layer_idx: int = 0) -> tuple[int, ...]:
        """Shape of one layer's K cache ``[B, Hkv, S, D]`` (empty tuple before the first write)."""
        k = self.key_cache[layer_idx]
        return tuple(k.shape) if k is not None else ()

    def nbytes(self) -> int:
        """Bytes held by K and V over all layers."""
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache if t is not None)
