"""Decode attention over a paged KV cache on CPU: which way of running it is fastest.

Workload (seeded): ``batch_size`` sequences, each with a context drawn uniformly
from ``[context/2, context]`` tokens (one sequence exactly ``context``), blocks of
``block_size`` tokens scattered over the pool at random; one query token per
sequence; every layer of the model shape (default SmolLM2-135M: 30 layers, 9
query heads, 3 KV heads of 64, float32). Reported: milliseconds of attention per
decode step (all layers; the minimum over ``repeats`` interleaved runs).

Variants:
  gather_padded     gather each sequence's blocks into [B, S_pad, Hkv, D] (one
                    index_select), fold query groups, one masked SDPA (PagedKVCache's way)
  gather_padded_reuse the same, gathering into buffers allocated once (no page faults)
  gather_padded_gqa the same as gather_padded with SDPA's ``enable_gqa`` instead of folding
  per_sequence      a Python loop: gather one sequence's blocks, SDPA, next
  contiguous        no gather: each sequence owns a contiguous [Hkv, S_max, D] slab
                    (a StaticCache-style layout, a lower bound for any gather)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

VARIANTS = ("gather_padded", "gather_padded_reuse", "gather_padded_gqa", "per_sequence", "contiguous")


def _setup(batch_size: int, context: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = -(-context // block_size)
    num_blocks = batch_size * num_blocks_per_seq + 1
    pools = [(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen),
              torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)) for _ in range(num_layers)]
    tables = torch.randperm(num_blocks, generator=gen)[: batch_size * num_blocks_per_seq].view(batch_size, -1)  # [B, nb]
    lens = torch.randint(context // 2, context + 1, (batch_size,), generator=gen)  # [B]
    lens[0] = context
    return pools, tables, lens


def make_variants(
    batch_size: int, context: int, num_layers: int = 30, num_heads: int = 9, num_kv_heads: int = 3,
    head_dim: int = 64, block_size: int = 16, seed: int = 0,
) -> dict[str, Callable[[], None]]:
    """One callable per variant; each runs decode attention of every layer once."""
    pools, tables, lens = _setup(batch_size, context, num_layers, num_kv_heads, head_dim, block_size, seed)
    b, g, d, hkv = batch_size, num_heads // num_kv_heads, head_dim, num_kv_heads
    s_pad = tables.shape[1] * block_size
    q = torch.randn(b, num_heads, 1, d)  # [B, H, 1, D]
    mask = (torch.arange(s_pad)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S_pad]
    flat = tables.flatten()  # [B * nb]

    def gather(pool: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
        return pool.view(pool.shape[0], -1).index_select(0, ids).view(rows, -1, hkv, d)  # [rows, S, Hkv, D]

    def gather_padded() -> None:
        for kp, vp in pools:
            k, v = gather(kp, flat, b).transpose(1, 2), gather(vp, flat, b).transpose(1, 2)  # [B, Hkv, S_pad, D]
            F.scaled_dot_product_attention(q.view(b, hkv, g, d), k, v, attn_mask=mask)

    k_buf, v_buf = torch.empty(b, s_pad, hkv, d), torch.empty(b, s_pad, hkv, d)

    def gather_padded_reuse() -> None:
        for kp, vp in pools:
            torch.index_select(kp.view(kp.shape[0], -1), 0, flat, out=k_buf.view(flat.shape[0], -1))
            torch.index_select(vp.view(vp.shape[0], -1), 0, flat, out=v_buf.view(flat.shape[0], -1))
            F.scaled_dot_product_attention(q.view(b, hkv, g, d), k_buf.transpose(1, 2), v_buf.transpose(1, 2), attn_mask=mask)

    def gather_padded_gqa() -> None:
        for kp, vp in pools:
            k, v = gather(kp, flat, b).transpose(1, 2), gather(vp, flat, b).transpose(1, 2)  # [B, Hkv, S_pad, D]
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    own = [tables[i, : -(-int(lens[i]) // block_size)] for i in range(b)]

    def per_sequence() -> None:
        for kp, vp in pools:
            for i in range(b):
                n = int(lens[i])
                k = gather(kp, own[i], 1)[:, :n].transpose(1, 2)  # [1, Hkv, S_i, D]
                v = gather(vp, own[i], 1)[:, :n].transpose(1, 2)  # [1, Hkv, S_i, D]
                F.scaled_dot_product_attention(q[i : i + 1].view(1, hkv, g, d), k, v)

    slabs = [(torch.randn(b, hkv, s_pad, d), torch.randn(b, hkv, s_pad, d)) for _ in range(num_layers)]

    def contiguous() -> None:
        for k, v in slabs:
            F.scaled_dot_product_attention(q.view(b, hkv, g, d), k, v, attn_mask=mask)

    return {"gather_padded": gather_padded, "gather_padded_reuse": gather_padded_reuse, "gather_padded_gqa": gather_padded_gqa,
            "per_sequence": per_sequence, "contiguous": contiguous}


def run_paged_attention_bench(
    batch_sizes: tuple[int, ...] = (8, 32), contexts: tuple[int, ...] = (256, 1024), repeats: int = 5, seed: int = 0
) -> dict[str, Any]:
    """``{"results": [{batch_size, context, <variant>_ms...}], ...}``: ms of attention per decode step (all layers)."""
    results = []
    with torch.inference_mode():
        for batch_size in batch_sizes:
            for context in contexts:
                variants = make_variants(batch_size, context, seed=seed)
                for fn in variants.values():
                    fn()  # warm-up
                best = {name: float("inf") for name in variants}
                for _ in range(repeats):  # interleaved, so a burst of load hits every variant alike
                    for name, fn in variants.items():
                        start = time.perf_counter()
                        fn()
                        best[name] = min(best[name], time.perf_counter() - start)
                results.append({"batch_size": batch_size, "context": context} | {f"{k}_ms": v * 1e3 for k, v in best.items()})
    return {"schema": "kvgen.bench.paged_attention/1", "shape": "30 layers, H=9, Hkv=3, D=64, float32, block_size=16",
            "timing": f"min over {repeats} interleaved repeats", "results": results, "torch_num_threads": torch.get_num_threads()}


def format_paged_attention_report(result: dict[str, Any]) -> str:
    """A table of ms per decode step, one row per (batch, context)."""
    header = f"{'batch':>5} {'context':>7} " + " ".join(f"{v:>18}" for v in VARIANTS)
    rows = [f"{r['batch_size']:>5} {r['context']:>7} " + " ".join(f"{r[v + '_ms']:>18.1f}" for v in VARIANTS) for r in result["results"]]
    return "\n".join([f"decode attention, ms per step ({result['shape']}; {result['timing']})", header, *rows])


if __name__ == "__main__":
    print(format_paged_attention_report(run_paged_attention_bench()))
