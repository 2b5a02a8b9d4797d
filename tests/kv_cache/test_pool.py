"""kvgen.kv_cache.pool: zero KV buffers that take resident memory only where written."""

from pathlib import Path

import pytest
import torch

from kvgen.kv_cache import PagedKVCache, StaticCache
from kvgen.kv_cache.pool import lazy_zeros


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096  # resident pages


def test_views_are_zero_separate_and_writable() -> None:
    k, v = lazy_zeros(2, (3, 5, 7), torch.float32)
    assert k.shape == v.shape == (3, 5, 7) and k.dtype == torch.float32 and k.is_contiguous()
    assert not k.any() and not v.any()
    k[1, 2] = 4.0
    assert k.sum() == 28.0 and not v.any()  # v is a separate view


def test_resident_memory_grows_only_where_written() -> None:
    before = rss_bytes()
    cache = PagedKVCache(num_layers=4, num_blocks=1024, block_size=16, num_kv_heads=4, head_dim=256)
    assert cache.nbytes() == 512 << 20
    assert rss_bytes() - before < 64 << 20  # torch.zeros would make all 512 MiB resident
    cache.key_cache[0][:768].fill_(1.0)  # 48 MiB written (64 KiB per block)
    assert rss_bytes() - before > 40 << 20
    assert cache.value_cache[3].abs().sum() == 0 and cache.key_cache[0][768:].abs().sum() == 0


def test_static_cache_starts_at_zero() -> None:
    cache = StaticCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=8, max_cache_len=16)
    assert len(cache.key_cache) == len(cache.value_cache) == 2
    assert all(not t.any() for t in cache.key_cache + cache.value_cache)
    assert len({t.data_ptr() for t in cache.key_cache + cache.value_cache}) == 4


def test_rejects_empty() -> None:
    with pytest.raises(ValueError, match="count >= 1"):
        lazy_zeros(0, (4,), torch.float32)
    with pytest.raises(ValueError, match="non-empty shape"):
        lazy_zeros(1, (0, 4), torch.float32)
