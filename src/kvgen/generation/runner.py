"""The model side of ``generate()``: one forward per step over a rectangular batch.

``StepRunner`` owns the growing token matrix, its attention mask and the KV
cache, so strategies only choose tokens. The first call prefills the prompt;
later calls feed only the new token (or, with ``use_cache=False``, the whole
sequence again — the slow path kept for comparison).
"""

from __future__ import annotations

import time

import torch

from kvgen.fields import check_int
from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.models import CausalLM, cache_dtype
from kvgen.models.attention import AttentionMetadata
from kvgen.models.recording import ForwardRecorder


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, S]`` int64 for a left-padded mask ``[B, S]`` (pads get 0), as HF generate."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# Tokens (rows x columns) a forward over the kernels takes at most when it fills a KV cache: a longer input goes in
# column chunks of this many tokens, one forward each, with the same results to the bit (the kernels' rows and
# attention do not depend on the batch or the chunking) in less time, as the activations of a chunk stay in cache.
# A 2,048-token prefill from one forward vs chunks of 512 / 256 / 128, tokens/s (2 threads, Zen 4): SmolLM2-135M
# Q4_1 878 / 967 / 989 / 966 (best of 6, interleaved in one process); one run each: a 3B Q4_K_M 59.5 / 63.8 / 66.0,
# a 1.1B Q4_K_M over 1,024 tokens 177 / 194 / 201 / 203.
PREFILL_CHUNK_TOKENS = 256


def chunked_forward(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor,
                    cache: DynamicCache | StaticCache | None, mask: torch.Tensor | None) -> torch.Tensor:
    """``model(ids, positions, cache, AttentionMetadata(mask))`` -> hidden [B, T, C], in column chunks of at most
    :data:`PREFILL_CHUNK_TOKENS` tokens where the model runs on its kernels and fills ``cache`` (one forward
    otherwise: without a cache a chunk could not see the earlier ones, and the float32 path's matrix products depend
    on their shapes). ids, positions: [B, T] int64; mask: None (no padding) or [B, cached + T] (1 real, 0 left
    padding)."""
    columns = max(1, PREFILL_CHUNK_TOKENS // ids.shape[0])
    if cache is None or getattr(model, "kernels", None) is None or ids.shape[1] <= columns:
        return model(ids, positions, cache, AttentionMetadata(mask))
    first, parts = cache.seq_length, []
    for start in range(0, ids.shape[1], columns):
        stop = min(start + columns, ids.shape[1])
        meta = AttentionMetadata(None if mask is None else mask[:, : first + stop])  # [B, slots so far]
        parts.append(model(ids[:, start:stop], positions[:, start:stop], cache, meta))  # [B, stop - start, C]
    return torch.cat(parts, dim=1)  # [B, T, C]


def make_cache(model: CausalLM, kind: str = "dynamic", batch_size: int = 1, max_len: int | None = None,
               kv_cache_dtype: str = "auto") -> DynamicCache | StaticCache:
    """A fresh KV cache for ``model`` of ``kind``: "static" holds ``max_len`` tokens per row (default: the model's
    context window; memory is committed only where written), "dynamic" grows as written. Pass it to
    ``generate(past_key_values=...)`` to keep a conversation's keys and values between calls.
    ``kv_cache_dtype`` (the engine's ``EngineArgs.kv_cache_dtype``): "auto" stores the model's KV dtype (float16 on
    the kernels), "int8" int8 rows and a float32 scale each (about half the bytes; a model on the kernels only).
    Raises ``ValueError`` for another ``kind`` or ``kv_cache_dtype``, or int8 for a model off the kernels."""
    if kind not in ("dynamic", "static"):
        raise ValueError(f"kind must be 'dynamic' or 'static', got {kind!r}")
    check_int("batch_size", batch_size, 1)
    if max_len is not None:
        check_int("max_len", max_len, 1)
    cfg, dtype = model.config, cache_dtype(model, kv_cache_dtype)
    shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim)
    if kind == "static":
        return StaticCache(*shape, max_len or cfg.max_position_embeddings, dtype)
    return DynamicCache(*shape, dtype)


class StepRunner:
    """Feeds a batch to the model step by step and returns last-position logits.

    input_ids, attention_mask: [B, T] int64 (left-padded). ``cache_kind`` None
    disables the KV cache. ``prefill_copies`` > 1 says the rows come in groups
    of that many identical copies (beams, samples of one prompt): with a cache,
    the prompt is run once per group and its cache rows are then copied.
    ``cache``: a caller's KV cache holding the first ``cache.seq_length`` columns of ``input_ids`` (one row per
    group); the prefill runs only the columns after them. ``prefill_s`` / ``decode_s`` accumulate seconds.
    ``recorder``: an open :class:`ForwardRecorder` that records every forward (a prefill's rows copied as its
    hidden states are), or None. ``prefill_chunk_size`` n (with a cache): the prompt's columns but the last go
    through the model n per forward first, unrecorded, and the prefill proper runs the last column (transformers'
    ``_prefill_chunking``).
    """

    def __init__(
        self,
        model: CausalLM,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache_kind: str | None,
        max_new_tokens: int,
        prefill_copies: int = 1,
        cache: DynamicCache | StaticCache | None = None,
        recorder: ForwardRecorder | None = None,
        prefill_chunk_size: int | None = None,
    ) -> None:
        assert input_ids.shape[0] % prefill_copies == 0, (input_ids.shape, prefill_copies)
        self.model = model
        self.sequences = input_ids
        self.attention_mask = attention_mask
        self.has_padding = not bool(attention_mask.all())
        self.prefill_copies = prefill_copies if cache_kind else 1
        max_len = input_ids.shape[1] + max_new_tokens
        cache_rows = input_ids.shape[0] // self.prefill_copies
        if cache is None and cache_kind:
            cache = make_cache(model, cache_kind, cache_rows, max_len)
        self.cache = cache
        self.num_cached = cache.seq_length if cache is not None else 0  # columns of `sequences` already in the cache
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.num_steps = 0
        self.recorder = recorder
        self._ones_column: torch.Tensor | None = None  # [B, 1] ones: the mask column append() adds
        self.prefill_chunk_size = prefill_chunk_size if cache is not None else None

    @torch.inference_mode()
    def hidden_states(self) -> torch.Tensor:
        """Run the model on the not-yet-cached columns; return hidden ``[B, T_fed, C]``."""
        start = time.perf_counter()
        first = self.num_cached if self.cache is not None else 0
        copies = self.prefill_copies if self.num_steps == 0 else 1
        mask = self.attention_mask[::copies]  # [B/copies, S]
        ids = self.sequences[::copies, first:]  # [B/copies, T_fed]
        positions = positions_from_mask(mask)[:, first:]  # [B/copies, T_fed]
        if self.num_steps == 0 and self.prefill_chunk_size is not None:
            ids, positions = self._prefill_chunks(ids, positions, mask, first)  # [B/copies, 1] each
        meta = AttentionMetadata(mask if self.has_padding else None)
        if self.recorder is None:  # a long prefill in chunks (same bits, less time)
            hidden = chunked_forward(self.model, ids, positions, self.cache, meta.attention_mask)  # [B/copies, T_fed, C]
        else:
            with self.recorder.forward() as record:
                hidden = self.model(ids, positions, self.cache, meta)
            self.recorder.output(record, hidden)
        if copies > 1:
            rows = torch.arange(ids.shape[0]).repeat_interleave(copies)  # [B]
            assert self.cache is not None  # copies > 1 only with a cache
            self.cache.reorder(rows)
            hidden = hidden.index_select(0, rows)  # [B, T_fed, C]
            if self.recorder is not None:
                record.select_rows(rows)
        self.num_cached = self.sequences.shape[1]
        elapsed = time.perf_counter() - start
        if self.num_steps == 0:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed
        self.num_steps += 1
        return hidden

    def _prefill_chunks(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, first: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ids [B, T] but the last column, ``prefill_chunk_size`` columns per forward, into the cache (the
        first ``first`` slots of mask [B, S] are cached already); return the last column of ids and positions."""
        end, size = ids.shape[1] - 1, self.prefill_chunk_size
        assert size is not None
        for start in range(0, end, size):
            stop = min(start + size, end)
            meta = AttentionMetadata(mask[:, : first + stop] if self.has_padding else None)  # [B, slots so far]
            self.model(ids[:, start:stop], positions[:, start:stop], self.cache, meta)
        return ids[:, end:], positions[:, end:]

    def next_logits(self, num_positions: int = 1) -> torch.Tensor:
        """Logits ``[B, V]`` float32 for the token after the last column; with ``num_positions`` n > 1,
        ``[B, n, V]`` for the tokens after each of the last n columns (verifying speculative tokens)."""
        hidden = self.hidden_states()
        start = time.perf_counter()
        with torch.inference_mode():
            if num_positions == 1:
                logits = self.model.compute_logits(hidden[:, -1])  # [B, V]
            else:
                last = hidden[:, -num_positions:].reshape(-1, hidden.shape[-1])  # [B n, C]
                logits = self.model.compute_logits(last).view(hidden.shape[0], num_positions, -1)  # [B, n, V]
        elapsed = time.perf_counter() - start
        if self.num_steps == 1:
            self.prefill_s += elapsed
        else:
            self.decode_s += elapsed
        return logits

    def append(self, next_tokens: torch.Tensor) -> None:
        """Append one column ``next_tokens [B]`` int64 (the mask grows by ones, as HF)."""
        self.sequences = torch.cat([self.sequences, next_tokens[:, None]], dim=1)  # [B, S+1]
        if self._ones_column is None or self._ones_column.shape[0] != self.attention_mask.shape[0]:
            self._ones_column = self.attention_mask.new_ones(self.attention_mask.shape[0], 1)  # [B, 1]
        self.attention_mask = torch.cat([self.attention_mask, self._ones_column], dim=1)  # [B, S+1]

    def append_columns(self, tokens: torch.Tensor) -> None:
        """Append ``tokens [B, k]`` int64 as k columns (speculative tokens to verify in one forward)."""
        self.sequences = torch.cat([self.sequences, tokens], dim=1)  # [B, S+k]
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(tokens.shape)], dim=1)

    def keep_columns(self, num_columns: int) -> None:
        """Keep the first ``num_columns`` columns of tokens and mask and forget cached slots past them (rejected
        speculative tokens). They may all be cached: append a column before the next forward."""
        self.sequences = self.sequences[:, :num_columns]  # [B, num_columns]
        self.attention_mask = self.attention_mask[:, :num_columns]  # [B, num_columns]
        self.num_cached = min(self.num_cached, num_columns)
        if self.cache is not None:
            self.cache.crop(self.num_cached)

    @torch.inference_mode()
    def reorder(self, row_idx: torch.Tensor) -> None:
        """Keep rows ``row_idx [B']`` (beam search; B' != B expands or selects), in tokens, mask and cache."""
        self.sequences = self.sequences.index_select(0, row_idx)
        self.attention_mask = self.attention_mask.index_select(0, row_idx)
        if self.cache is not None:
            self.cache.reorder(row_idx)
