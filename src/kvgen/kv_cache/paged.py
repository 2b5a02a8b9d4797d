"""The engine's paged KV cache: a fixed pool of blocks per layer, addressed by block tables.

A block holds ``block_size`` consecutive positions of one sequence. Slot
``block_id * block_size + offset`` stores position ``i`` of a sequence whose
block table has ``block_id`` at index ``i // block_size`` (``offset = i % block_size``).
The ``BlockManager`` (engine/) decides which blocks a sequence holds; this module
only owns the tensors and runs attention over them.

One engine step packs every scheduled token into one row ``[1, N]``. Sequences
whose chunk is a single token ("decodes") come first and attend together: their
blocks are gathered (into a reused workspace) as a padded ``[B, S_pad, Hkv, D]``
tensor and one masked ``scaled_dot_product_attention`` call covers them —
measured fastest on CPU against a per-sequence loop and SDPA's ``enable_gqa``
(a paged-attention experiment, since removed from kvgen.bench). Longer chunks (prefills) attend one sequence at
a time. Source: Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention" (vLLM); the decode-first packing as vLLM v1.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from kvgen.config import ModelConfig
from kvgen.fields import check_int
from kvgen.kv_cache.pool import lazy_zeros, refuse_int8, row_scales
from kvgen.kv_cache.sdpa import sdpa


SCALE_BYTES = 4  # an int8 row's float32 scale


def num_blocks_for_memory(config: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks of ``block_size`` tokens fit in ``memory_bytes`` of K and V over all layers.

    Raises ValueError for a non-positive size or a budget below one block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per_block = block_nbytes(config, block_size, dtype)
    if memory_bytes < per_block:
        raise ValueError(f"kv_cache_memory must hold at least one block of block_size={block_size} tokens "
                         f"({per_block} bytes): raise kv_cache_memory or lower block_size, got {memory_bytes}")
    return memory_bytes // per_block


def block_nbytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V for ``block_size`` tokens in every layer (int8: and a float32 scale per row)."""
    elem = torch.empty((), dtype=dtype).element_size()
    assert config.num_key_value_heads is not None and config.head_dim is not None  # set by ModelConfig.__post_init__
    row = config.head_dim * elem + (SCALE_BYTES if dtype == torch.int8 else 0)
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * row


@dataclass
class PrefillChunk:
    """One multi-token chunk of a step: tokens ``[token_start, token_end)`` of the packed row.

    ``num_context``: positions already in the cache before this chunk; ``block_ids``: [nb]
    long covering the chunk's whole context; ``mask``: [1, 1, T, S_pad] bool, or None when
    ``num_context == 0`` (plain causal attention over the chunk itself).
    """

    token_start: int
    token_end: int
    num_context: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PagedAttentionMetadata:
    """Where one packed step's tokens go and what each sequence attends to.

    slot_mapping: [N] long, the cache slot of every packed token. query_start_loc: [R+1]
    long; seq_lens: [R] long, context length after this step; block_tables: [R, nb_max]
    long (padded with block 0). The first ``num_decodes`` sequences have one token each and
    are tokens ``[0, num_decodes)`` (their batched torch attention reads :attr:`decode_inputs`);
    ``prefills`` the rest, one chunk each.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    prefills: list[PrefillChunk]
    block_size: int

    @functools.cached_property
    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' flat padded block ids [num_decodes * nb] long and key mask [num_decodes, 1, 1, nb * block_size]
        bool, made on first use (the kernels read the block tables instead). Needs ``num_decodes > 0``."""
        assert self.num_decodes > 0, "no decodes in this step"
        lens = self.seq_lens[: self.num_decodes]  # [B]
        num_blocks = -(-int(lens.max()) // self.block_size)
        ids = self.block_tables[: self.num_decodes, :num_blocks]  # [B, nb], padded with block 0
        mask = torch.arange(num_blocks * self.block_size)[None, :] < lens[:, None]  # [B, S_pad]
        return ids.reshape(-1), mask[:, None, None, :]  # [B * nb], [B, 1, 1, S_pad]

    @classmethod
    def build(
        cls, query_lens: list[int], start_positions: list[int], block_tables: list[list[int]], block_size: int
    ) -> PagedAttentionMetadata:
        """Metadata for sequences packed in order; every one-token sequence must come first.

        query_lens[i] tokens at positions ``start_positions[i] + t`` of a sequence with
        block table ``block_tables[i]``. Raises ValueError for a decode after a prefill
        or a block table too short for its positions.
        """
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if any(n == 1 for n in query_lens[num_decodes:]):
            raise ValueError("one-token sequences must be packed before every longer chunk")
        seq_lens = [s + n for s, n in zip(start_positions, query_lens)]
        for i, (length, table) in enumerate(zip(seq_lens, block_tables)):
            if len(table) * block_size < length:
                raise ValueError(f"block_table of sequence {i} covers {len(table) * block_size} positions, needs {length}")
        slots = [
            table[p // block_size] * block_size + p % block_size
            for start, n, table in zip(start_positions, query_lens, block_tables)
            for p in range(start, start + n)
        ]
        max_blocks = max((len(t) for t in block_tables), default=0)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        tables = tables.view(len(block_tables), max_blocks)  # [R, nb_max]
        lens = torch.tensor(seq_lens, dtype=torch.long)  # [R]
        starts = list(itertools.accumulate(query_lens, initial=0))  # each sequence's first packed token, then N
        qsl = torch.tensor(starts, dtype=torch.long)  # [R+1]
        prefills = [
            _prefill_chunk(starts[i], query_lens[i], start_positions[i], block_tables[i], block_size)
            for i in range(num_decodes, len(query_lens))
        ]
        slot_mapping = torch.tensor(slots, dtype=torch.long)  # [N]
        return cls(slot_mapping, qsl, lens, tables, num_decodes, prefills, block_size)


def _prefill_chunk(token_start: int, num_tokens: int, start: int, table: list[int], block_size: int) -> PrefillChunk:
    end = start + num_tokens
    num_blocks = -(-end // block_size)
    block_ids = torch.tensor(table[:num_blocks], dtype=torch.long)  # [nb]
    mask = None
    if start > 0:
        q_pos = torch.arange(start, end)[:, None]  # [T, 1]
        k_pos = torch.arange(num_blocks * block_size)[None, :]  # [1, S_pad]
        mask = (k_pos <= q_pos)[None, None]  # [1, 1, T, S_pad]
    return PrefillChunk(token_start, token_start + num_tokens, start, block_ids, mask)


class PagedKVCache:
    """Per-layer K and V pools ``[num_blocks, Hkv, block_size, D]``, written in place by slot (slot s: row
    ``s % block_size`` of block ``s // block_size``, in each head's part of the block: a head's rows of a block are
    contiguous, as vLLM's PagedAttention lays them out, which the kernels read faster than slots of interleaved heads).

    ``dtype=torch.int8`` stores each row (a token's K or V in one KV head) as int8 values and a float32 scale, in
    ``key_scale`` / ``value_scale`` [num_blocks, Hkv, block_size] per layer (``kernels.reference.quantize_kv_rows``:
    symmetric, the row's largest magnitude to 127), about half the bytes of float16 rows; only the kernels read them
    (:meth:`attend_rows`; :meth:`attend` raises ``ValueError``). Other dtypes have empty scale lists.

    The pool is allocated once as zeros (padding slots read as finite values) that take resident memory only
    where written (``pool.lazy_zeros``). Raises
    ValueError for sizes that are no ints >= 1.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(name, value, 1)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        pool = lazy_zeros(2 * num_layers, shape, dtype, device)  # resident only where written
        self.key_cache, self.value_cache = pool[:num_layers], pool[num_layers:]
        self.key_scale, self.value_scale = row_scales(num_layers, shape, dtype, device)
        # Gather targets reused by every layer and step: a fresh multi-MB tensor per gather costs
        # page faults that made decode attention ~2x slower (a paged-attention experiment).
        self._workspace = {name: torch.empty(0, dtype=dtype, device=device) for name in ("k", "v", "k_heads", "v_heads")}

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> PagedKVCache:
        """A pool for ``config`` sized by ``num_blocks`` or by ``kv_cache_memory_bytes`` (exactly one).

        Raises ValueError when both or neither are given.
        """
        if (num_blocks is None) == (kv_cache_memory_bytes is None):
            raise ValueError("pass exactly one of num_blocks and kv_cache_memory_bytes")
        if num_blocks is None:
            assert kv_cache_memory_bytes is not None  # exactly one of the two, checked above
            num_blocks = num_blocks_for_memory(config, kv_cache_memory_bytes, block_size, dtype)
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim, dtype)

    def nbytes(self) -> int:
        """Bytes allocated for K and V over all layers (int8: with their scales)."""
        tensors = self.key_cache + self.value_cache + self.key_scale + self.value_scale
        return sum(t.numel() * t.element_size() for t in tensors)

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: PagedAttentionMetadata,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's k, v to their slots, then attend every sequence over its blocks.

        q: [1, H, N, D]; k, v: [1, Hkv, N, D] (one packed row). ``window`` > 0 (a sliding-window layer): a query at
        position p sees positions p - window + 1 .. p only; ``softcap`` > 0 (Gemma 2): scores capped to
        ``softcap * tanh(s / softcap)``; ``sinks`` [H] float32 (gpt-oss): one more logit in each head's softmax, dropped
        (:func:`~kvgen.kv_cache.sdpa.sdpa`). Returns [1, H, N, D], q's dtype.
        Raises ``ValueError`` for int8 pools (the kernels' :meth:`attend_rows` reads them).
        """
        refuse_int8(self.key_scale)
        k_new, v_new = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [N, Hkv, D]
        k_pool, v_pool = self.key_cache[layer_idx], self.value_cache[layer_idx]
        blocks, rows = meta.slot_mapping // self.block_size, meta.slot_mapping % self.block_size  # [N] each
        k_pool[blocks, :, rows] = k_new  # [N, Hkv, D] at (block, every head, row)
        v_pool[blocks, :, rows] = v_new
        num_heads, num_tokens = q.shape[1], q.shape[2]
        out = q.new_empty(num_tokens, num_heads, self.head_dim)  # [N, H, D]
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode_attention(q[0, :, : meta.num_decodes], k_pool, v_pool, meta, scale,
                                                             window, softcap, sinks)
        for chunk in meta.prefills:
            out[chunk.token_start : chunk.token_end] = self._prefill_attention(q, k_new, v_new, k_pool, v_pool, chunk,
                                                                               scale, window, softcap, sinks)
        return out.transpose(0, 1).unsqueeze(0)  # [1, H, N, D]

    def attend_rows(
        self, layer_idx: int, qkv: torch.Tensor, meta: PagedAttentionMetadata, num_heads: int, scale: float, kernels,
        window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Kernel path: write the step's k, v from stacked rows qkv [N, (H + 2 Hkv) D] to their slots,
        then attend every sequence straight from the pool through its block table (no gather;
        ``kernels.paged_attention_qkv``; ``window``, ``softcap``, ``sinks`` as :meth:`attend`; int8 pools with their
        scales). Returns [N, H D] float32."""
        scales = (self.key_scale[layer_idx], self.value_scale[layer_idx]) if self.key_scale else ()
        return kernels.paged_attention_qkv(
            qkv, self.key_cache[layer_idx], self.value_cache[layer_idx], meta.slot_mapping, meta.block_tables,
            meta.query_start_loc, meta.seq_lens, num_heads, scale, window, softcap, sinks, *scales,
        )

    def _gather(self, which: str, pool: torch.Tensor, block_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Blocks ``block_ids`` [B * nb] of ``pool`` as ``[B, Hkv, nb * block_size, D]``, in the ``which`` ("k" or
        "v") workspaces: valid until the next gather into them. The blocks are gathered whole (``index_select`` of
        contiguous rows; over a transposed view of the pool it copied the whole pool first), then each head's rows
        put in order."""
        numel = block_ids.numel() * pool[0].numel()
        for key in (which, which + "_heads"):
            if self._workspace[key].numel() < numel:
                self._workspace[key] = pool.new_empty(numel)
        blocks = self._workspace[which][:numel].view(block_ids.numel(), -1)  # [B * nb, Hkv * bs * D]
        torch.index_select(pool.view(self.num_blocks, -1), 0, block_ids, out=blocks)
        shape = (num_rows, -1, self.num_kv_heads, self.block_size, self.head_dim)  # [B, nb, Hkv, bs, D]
        heads = self._workspace[which + "_heads"][:numel].view(num_rows, self.num_kv_heads, -1, self.block_size,
                                                                  self.head_dim)  # [B, Hkv, nb, bs, D]
        heads.copy_(blocks.view(shape).transpose(1, 2))
        return heads.view(num_rows, self.num_kv_heads, -1, self.head_dim)  # [B, Hkv, S_pad, D]

    def _decode_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PagedAttentionMetadata,
        scale: float | None, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [H, B, D] one query per sequence -> [B, H, D].

        Grouped-query heads are folded into the query axis (``[B, Hkv, H/Hkv, D]``), so no
        key or value is repeated; with ``sinks`` (one per query head) ``sdpa``'s eager path groups them instead.
        """
        num_heads, batch, d = q.shape
        group = num_heads // self.num_kv_heads
        if sinks is None:
            qg = q.transpose(0, 1).reshape(batch, self.num_kv_heads, group, d)  # [B, Hkv, G, D]
        else:
            qg = q.transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        block_ids, decode_mask = meta.decode_inputs  # [B * nb], [B, 1, 1, S_pad]
        if window > 0:  # each sequence's last `window` positions: those >= its length - window
            first = meta.seq_lens[: meta.num_decodes] - window  # [B]
            near = torch.arange(decode_mask.shape[-1])[None, :] >= first[:, None]  # [B, S_pad]
            decode_mask = decode_mask & near[:, None, None, :]  # [B, 1, 1, S_pad]
        k = self._gather("k", k_pool, block_ids, batch)  # [B, Hkv, S_pad, D]
        v = self._gather("v", v_pool, block_ids, batch)  # [B, Hkv, S_pad, D]
        out = sdpa(qg, k, v, decode_mask, scale=scale, softcap=softcap, sinks=sinks)  # [B, Hkv, G, D] | [B, H, 1, D]
        return out.reshape(batch, num_heads, d)  # [B, H, D]

    def _prefill_attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        chunk: PrefillChunk,
        scale: float | None,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One chunk's attention: q [1, H, N, D]; k_new, v_new [N, Hkv, D] -> [T, H, D]; ``window``, ``softcap`` and
        ``sinks`` as ``attend``."""
        qc = q[:, :, chunk.token_start : chunk.token_end]  # [1, H, T, D]
        if chunk.num_context == 0:  # nothing cached: causal attention within the chunk
            k = k_new[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
            v = v_new[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
        else:
            k = self._gather("k", k_pool, chunk.block_ids, 1)  # [1, Hkv, S_pad, D]
            v = self._gather("v", v_pool, chunk.block_ids, 1)  # [1, Hkv, S_pad, D]
        mask = chunk.mask
        if window > 0:  # keys at positions (p - window, p] of the query at position p; key slot i is position i
            q_pos = torch.arange(chunk.num_context, chunk.num_context + qc.shape[2])[:, None]  # [T, 1]
            k_pos = torch.arange(k.shape[2])[None, :]  # [1, S]
            mask = ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]  # [1, 1, T, S]
        is_causal = mask is None and qc.shape[2] > 1
        out = sdpa(qc, k, v, mask, is_causal, scale, softcap, sinks)  # [1, H, T, D]
        return out[0].transpose(0, 1)  # [T, H, D]
