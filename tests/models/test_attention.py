"""kvgen.models.attention with gpt-oss's attention sinks: ``attend`` (float path) over no cache, the dynamic, static
and paged caches, and ``attend_rows`` (kernel path) over the same, all equal float64 attention with the sinks
(helpers.float64_attention, transformers' GptOss eager_attention_forward), with and without a sliding window, for a
prefill then decodes; leaving the sinks out moves the output."""

from __future__ import annotations

import pytest
import torch
from helpers import float64_attention

from kvgen.kernels import get_ops
from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.kv_cache.paged import PagedAttentionMetadata, PagedKVCache
from kvgen.models.attention import (
    AttentionMetadata,
    attend,
    attend_rows,
    prepare_attention,
    prepare_key_mask,
)

H, HKV, D, SCALE = 4, 2, 16, 0.25


def _steps(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A prefill of 7 tokens then 3 decodes: (q [1, H, T, D], k, v [1, Hkv, T, D]) each."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, t, D, generator=g), torch.randn(1, HKV, t, D, generator=g),
             torch.randn(1, HKV, t, D, generator=g)) for t in (7, 1, 1, 1)]


def _want(steps, sinks, window: int) -> torch.Tensor:
    """float64 attention of every step's queries over all keys so far: [N, H, D]."""
    out, ks, vs, past = [], [], [], 0
    for q, k, v in steps:
        ks.append(k)
        vs.append(v)
        out.append(float64_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), None, past, SCALE, window, sinks=sinks)[0])
        past += q.shape[2]
    return torch.cat(out)  # [N, H, D]


def _float_path(steps, cache, sinks, window: int) -> torch.Tensor:
    out, past = [], 0
    for q, k, v in steps:
        t = q.shape[2]
        if isinstance(cache, PagedKVCache):
            mask = PagedAttentionMetadata.build([t], [past], [[0, 1, 2]], cache.block_size)
        else:
            mask = prepare_attention(None, cache, t, window)
        out.append(attend(q, k, v, 0, cache, mask, SCALE, window, 0.0, sinks)[0].transpose(0, 1))  # [T, H, D]
        if isinstance(cache, StaticCache):  # dynamic too; the paged lengths live in the metadata
            cache.advance(t)
        past += t
    return torch.cat(out)


def _kernel_path(steps, cache, sinks, window: int) -> torch.Tensor:
    ops, out, past = get_ops(), [], 0
    for q, k, v in steps:
        t = q.shape[2]
        qkv = torch.cat([x[0].transpose(0, 1).reshape(t, -1) for x in (q, k, v)], -1)  # [T, (H + 2 Hkv) D]
        if isinstance(cache, PagedKVCache):
            mask = PagedAttentionMetadata.build([t], [past], [[0, 1, 2]], cache.block_size)
        else:
            mask = prepare_key_mask(None, cache, torch.Size((1, t)))
        out.append(attend_rows(qkv, 1, 0, cache, mask, ops, H, HKV, D, SCALE, window, 0.0, sinks).view(t, H, D))
        if isinstance(cache, StaticCache):  # dynamic too; the paged lengths live in the metadata
            cache.advance(t)
        past += t
    return torch.cat(out)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "paged"])
def test_attention_sinks_on_every_cache_equal_float64(cache_kind, window):
    steps = _steps(1)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(2)) + 1.5
    want = _want(steps, sinks, window)

    def cache(dtype: torch.dtype):
        if cache_kind == "dynamic":
            return DynamicCache(1, 1, HKV, D, dtype, initial_len=4)
        if cache_kind == "static":
            return StaticCache(1, 1, HKV, D, 16, dtype)
        return PagedKVCache(1, 4, 4, HKV, D, dtype)

    got = _float_path(steps, cache(torch.float32), sinks, window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    plain = _float_path(steps, cache(torch.float32), None, window)
    assert float((plain - got).abs().max()) > 0.05
    rows = _kernel_path(steps, cache(torch.float16), sinks, window)  # K and V at fp16, as the kernels read them
    torch.testing.assert_close(rows.double(), want, rtol=3e-3, atol=3e-3)
    if cache_kind == "static":  # no cache: attend_rows through kernels.attention over this forward's keys
        first = _kernel_path(steps[:1], None, sinks, window)
        torch.testing.assert_close(first.double(), want[:7], rtol=3e-3, atol=3e-3)


@pytest.mark.parametrize("cache_kind", ["static", "none"])
def test_kernel_path_key_mask_hides_left_padding_as_float64(cache_kind):
    """``prepare_key_mask`` of a left-padded batch (row 0 with 3 padding slots) then ``attend_rows``: every real query
    equals float64 attention over its real keys only, for a prefill and (static) a decode step."""
    g = torch.Generator().manual_seed(3)
    key_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])  # [B, S]: row 0 left-padded
    q, k, v = (torch.randn(2, n, 8, D, generator=g) for n in (H, HKV, HKV))  # prefill of 7, then 1 decode
    cache = StaticCache(1, 2, HKV, D, 16, torch.float16) if cache_kind == "static" else None
    ops, past = get_ops(), 0
    for t in ((7, 1) if cache is not None else (8,)):
        qs, ks, vs = (x[:, :, past : past + t] for x in (q, k, v))
        qkv = torch.cat([x.transpose(1, 2).reshape(2 * t, -1) for x in (qs, ks, vs)], -1)  # [B T, (H + 2 Hkv) D]
        meta = AttentionMetadata(key_mask[:, : past + t])
        mask = prepare_key_mask(meta, cache, torch.Size((2, t)))
        got = attend_rows(qkv, 2, 0, cache, mask, ops, H, HKV, D, SCALE).view(2, t, H, D)
        want = float64_attention(qs, k[:, :, : past + t], v[:, :, : past + t], key_mask[:, : past + t], past, SCALE)
        real = key_mask[:, past : past + t].bool()  # [B, T]: queries that are not padding
        torch.testing.assert_close(got[real].double(), want[real], rtol=3e-3, atol=3e-3)
        if cache is not None:
            cache.advance(t)
        past += t
