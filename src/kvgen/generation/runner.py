"""The model side of ``generate()``: one forward per step over a rectangular batch.

``StepRunner`` owns the growing token matrix, its attention mask and the KV
cache, so strategies only choose tokens. The first call prefills the prompt;
later calls feed only the new token (or, with ``use_cache=False``, the whole
sequence again — the slow path kept for comparison).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.models.attention import AttentionMetadata


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, S]`` int64 for a left-padded mask ``[B, S]`` (pads get 0), as HF generate."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def make_cache(model: nn.Module, kind: str, batch_size: int, max_len: int) -> DynamicCache | StaticCache:
    """A fresh KV cache of ``kind`` ("dynamic" | "static") sized for ``max_len`` tokens per row."""
    cfg = model.config
    if kind == "static":
        dtype = next(model.parameters()).dtype
        return StaticCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim, max_len, dtype)
    return DynamicCache(cfg.num_hidden_layers)


class StepRunner:
    """Feeds a batch to the model step by step and returns last-position logits.

    input_ids, attention_mask: [B, T] int64 (left-padded). ``cache_kind`` None
    disables the KV cache. ``timings`` accumulates prefill/decode seconds.
    """

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache_kind: str | None,
        max_new_tokens: int,
    ) -> None:
        self.model = model
        self.sequences = input_ids
        self.attention_mask = attention_mask
        self.has_padding = not bool(attention_mask.all())
        max_len = input_ids.shape[1] + max_new_tokens
        self.cache = make_cache(model, cache_kind, input_ids.shape[0], max_len) if cache_kind else None
        self.num_cached = 0  # columns of `sequences` already in the cache
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.num_steps = 0

    @torch.inference_mode()
    def hidden_states(self) -> torch.Tensor:
        """Run the model on the not-yet-cached columns; return hidden ``[B, T_fed, C]``."""
        start = time.perf_counter()
        first = self.num_cached if self.cache is not None else 0
        ids = self.sequences[:, first:]  # [B, T_fed]
        positions = positions_from_mask(self.attention_mask)[:, first:]  # [B, T_fed]
        meta = AttentionMetadata(self.attention_mask if self.has_padding else None)
        hidden = self.model(ids, positions, self.cache, meta)  # [B, T_fed, C]
        self.num_cached = self.sequences.shape[1]
        elapsed = time.perf_counter() - start
        if self.num_steps == 0:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed
        self.num_steps += 1
        return hidden

    def next_logits(self) -> torch.Tensor:
        """Logits ``[B, V]`` float32 for the token after the last column."""
        hidden = self.hidden_states()
        start = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[:, -1])  # [B, V]
        elapsed = time.perf_counter() - start
        if self.num_steps == 1:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed
        return logits

    def append(self, next_tokens: torch.Tensor) -> None:
        """Append one column ``next_tokens [B]`` int64 (the mask grows by ones, as HF)."""
        self.sequences = torch.cat([self.sequences, next_tokens[:, None]], dim=1)  # [B, S+1]
        self.attention_mask = torch.cat(
            [self.attention_mask, self.attention_mask.new_ones(self.attention_mask.shape[0], 1)], dim=1
        )  # [B, S+1]

    def reorder(self, row_idx: torch.Tensor) -> None:
        """Keep rows ``row_idx [B']`` (beam search), in tokens, mask and cache."""
        self.sequences = self.sequences.index_select(0, row_idx)
        self.attention_mask = self.attention_mask.index_select(0, row_idx)
        if self.cache is not None:
            self.cache.reorder(row_idx)
