"""DynamicCache: grows on demand and holds exactly what was written, like a concatenation of every write."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad

from kvgen.generation.runner import make_cache, positions_from_mask
from kvgen.kv_cache import DynamicCache
from kvgen.models import AttentionMetadata


def test_writes_past_the_capacity_keep_every_slot_and_double_it():
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=4, initial_len=4)
    written_k, written_v, capacities = [], [], []
    for t in [3, 1, 1, 1, 1, 1, 1, 5, 30]:
        k, v = torch.randn(2, 3, t, 4, generator=gen), torch.randn(2, 3, t, 4, generator=gen)  # [B, Hkv, T, D]
        written_k.append(k)
        written_v.append(v)
        for layer in range(2):
            keys, values = cache.update(layer, k * (layer + 1), v)
            assert torch.equal(keys, torch.cat(written_k, 2) * (layer + 1))  # [B, Hkv, S, D]
            assert torch.equal(values, torch.cat(written_v, 2))
        cache.advance(t)
        capacities.append(cache.max_cache_len)
    assert capacities == [4, 4, 8, 8, 8, 8, 16, 16, 44]  # doubled, or grown to the write when doubling is short
    assert cache.layer_shape(1) == (2, 3, 44, 4)
    assert cache.nbytes() == 2 * 2 * (2 * 3 * 44 * 4) * 4


def test_grown_cache_reorders_crops_and_overwrites():
    cache = DynamicCache(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, initial_len=1)
    k = torch.arange(12.0).view(2, 1, 3, 2)  # [B, Hkv, T, D]
    cache.update(0, k, -k)
    cache.advance(3)
    cache.reorder(torch.tensor([1, 1, 0]))  # B' = 3
    assert torch.equal(cache.key_cache[0][:, :, :3], k[[1, 1, 0]])
    cache.crop(2)
    keys, values = cache.update(0, torch.full((3, 1, 4, 2), 7.0), torch.zeros(3, 1, 4, 2))
    assert keys.shape == (3, 1, 6, 2) and cache.max_cache_len == 6
    assert torch.equal(keys[:, :, :2], k[[1, 1, 0]][:, :, :2]) and bool((keys[:, :, 2:] == 7).all())
    assert torch.equal(values[:, :, :2], -k[[1, 1, 0]][:, :, :2]) and not values[:, :, 2:].any()


def test_bad_sizes_are_refused():
    for bad in (0, 2.5, "4"):  # a float or str died with a TypeError from the allocation
        with pytest.raises(ValueError, match=f"initial_len must be an int >= 1, got {bad!r}"):
            DynamicCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, initial_len=bad)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1, got 2.0"):
        DynamicCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2.0)


@pytest.mark.slow
@pytest.mark.parametrize("one_op", [True, False], ids=["one-op-decoder", "layer-by-layer"])
def test_growing_during_decode_gives_the_static_cache_bits(ours_default_auto, one_op):
    """The default model's kernel path over a padded batch: a dynamic cache that starts at 2 slots and grows
    four times gives the hidden states and cache contents of a static cache sized up front, bit for bit."""
    model, tok = ours_default_auto
    ids, mask = left_pad([tok.encode(t) for t in ["The capital of France is", "Once upon a time"]], pad_id=0)
    static = make_cache(model, "static", 2, ids.shape[1] + 24)
    cfg = model.config
    dynamic = DynamicCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim, static.key_cache[0].dtype,
                           initial_len=2)
    outs = []
    model.one_op_decoder = one_op
    try:
        for cache in (static, dynamic):
            out, step_mask = [], mask
            with torch.inference_mode():
                out.append(model(ids, positions_from_mask(mask), cache, AttentionMetadata(mask)))
                for step in range(24):
                    step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
                    positions = positions_from_mask(step_mask)[:, -1:]
                    out.append(model(torch.full((2, 1), 42 + step), positions, cache, AttentionMetadata(step_mask)))
            outs.append(out)
    finally:
        model.one_op_decoder = True
    assert dynamic.max_cache_len > ids.shape[1] + 24 > 2
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    end = static.seq_length
    assert all(torch.equal(a[:, :, :end], b[:, :, :end]) for a, b in zip(static.key_cache + static.value_cache,
                                                                          dynamic.key_cache + dynamic.value_cache))


@pytest.mark.parametrize("settings", [{}, {"num_beams": 3}])
def test_a_cache_grown_or_gathered_inside_generate_takes_writes_outside_inference_mode(tiny_model, settings):
    """Buffers that generate() allocates (growth, beams' rows) are normal tensors: reorder and a model forward outside
    ``torch.inference_mode`` write them in place as they would a fresh cache's."""
    from helpers import random_ids

    from kvgen.generation import GenerationConfig, generate

    ours = tiny_model("llama").ours
    cfg = ours.config
    cache = DynamicCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, initial_len=4)
    generate(ours, random_ids(1, 1, 10, 97), None, GenerationConfig(max_new_tokens=3, eos_token_id=[], **settings),
             past_key_values=cache)
    rows, before = cache.layer_shape()[0], cache.key_cache[0][:, :, : cache.seq_length].clone()  # [B, Hkv, S, D]
    flip = torch.arange(rows).flip(0)
    cache.reorder(flip)
    assert torch.equal(cache.key_cache[0][:, :, : cache.seq_length], before[flip])
    seq_length, ids = cache.seq_length, random_ids(2, rows, 2, 97)  # [B, 2]
    with torch.no_grad():
        ours(ids, torch.arange(seq_length, seq_length + 2).repeat(rows, 1), cache, AttentionMetadata(None))
    assert cache.seq_length == seq_length + 2 and torch.equal(cache.key_cache[0][:, :, :seq_length], before[flip])
