"""kvgen.kv_cache.static: ``StaticCache``'s constructor checks its sizes; ``crop`` past the filled length is a no-op."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv_cache import DynamicCache, StaticCache

SIZES = {"num_layers": 2, "batch_size": 1, "num_kv_heads": 2, "head_dim": 16, "max_cache_len": 8}


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("bad", [0, 8.5, "8", True])
def test_a_size_that_is_no_positive_int_is_named(name: str, bad: object) -> None:
    """A float or str died in the allocation with a TypeError naming no argument ("'float' object cannot be
    interpreted as an integer", "'<' not supported between instances of 'str' and 'int'")."""
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {bad!r}"):
        StaticCache(**{**SIZES, name: bad})
    assert StaticCache(**SIZES).layer_shape() == (1, 2, 0, 16)


@pytest.mark.parametrize("cache_cls", [StaticCache, DynamicCache])
def test_crop_past_the_filled_length_keeps_every_slot_as_transformers(cache_cls: type[StaticCache]) -> None:
    """``crop(n)`` with n past ``seq_length`` is a no-op in transformers' ``DynamicCache.crop``: a later write
    lands right after the filled slots and attention reads only written keys (not n - seq_length zero slots)."""
    from transformers import DynamicCache as HFDynamicCache

    gen = torch.Generator().manual_seed(0)
    k, k_new = torch.randn(1, 2, 5, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen)  # [B, Hkv, T, D]
    ref = HFDynamicCache()
    ref.update(k, -k, 0)
    ref.crop(9)
    want_length = ref.get_seq_length()
    want, _ = ref.update(k_new, -k_new, 0)  # [B, Hkv, 6, D]
    sizes = {**SIZES, "num_layers": 1}
    cache = StaticCache(**sizes) if cache_cls is StaticCache else DynamicCache(1, 1, 2, 16, initial_len=4)
    cache.update(0, k, -k)
    cache.advance(5)
    cache.crop(9)
    assert cache.seq_length == want_length
    got, _ = cache.update(0, k_new, -k_new)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
