"""int8 ``StaticCache`` / ``DynamicCache`` (``make_cache(..., kv_cache_dtype="int8")``, passed to ``generate`` as
``past_key_values``, and ``kvgen chat --kv-cache-dtype int8``): the kernels read them as the torch twins do, close to
float16 rows; beam search's row gathers and the dynamic cache's growth carry the scales with the rows."""

from __future__ import annotations

import pytest
import torch

import kvgen.kernels as K
from kvgen.cli import main
from kvgen.generation import GenerationConfig, generate, make_cache
from kvgen.kernels.reference import quantize_kv_rows
from kvgen.kv_cache import DynamicCache, StaticCache
from kvgen.loader import load_model

PROMPT = torch.arange(3, 303)[None]  # [1, 300]: past the dynamic cache's first 256 slots


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The tiny random Llama with Q8_0 matrices on the kernels, and the same on their torch twins."""
    ours, _ = load_model(str(tiny_model_dir), quantization="q8_0")
    twin, _ = load_model(str(tiny_model_dir), quantization="q8_0")
    twin.use_kernels(K.reference_ops())
    return ours, twin


def _first_logits(model, kind: str, kv_cache_dtype: str) -> tuple[torch.Tensor, StaticCache]:
    """The first new token's logits [V] after PROMPT through a fresh cache of ``kind`` and ``kv_cache_dtype``."""
    cache = make_cache(model, kind, kv_cache_dtype=kv_cache_dtype)
    out = generate(model, PROMPT, None, GenerationConfig(max_new_tokens=2, do_sample=False, output_logits=True),
                   past_key_values=cache)
    assert out.logits is not None
    return out.logits[0][0], cache


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_int8_caches_in_generate_match_their_twins_and_stay_near_float16(models, kind):
    ours, twin = models
    int8, cache = _first_logits(ours, kind, "int8")
    assert cache.key_cache[0].dtype == torch.int8 and cache.seq_length == PROMPT.shape[1] + 1
    assert bool((cache.key_scale[0][:, :, : cache.seq_length] > 0).all())  # every written row has its scale
    want, twin_cache = _first_logits(twin, kind, "int8")
    assert twin_cache.key_cache[0].dtype == torch.int8
    torch.testing.assert_close(int8, want, rtol=0, atol=2e-3 * float(want.abs().max()))
    fp16, _ = _first_logits(ours, kind, "auto")
    difference = float((int8 - fp16).abs().max())
    assert 0 < difference < 0.05 * float(fp16.abs().max())


def test_output_attentions_read_the_int8_rows_dequantized(models):
    ours, _ = models
    config = GenerationConfig(max_new_tokens=1, do_sample=False, output_attentions=True)
    got = generate(ours, PROMPT[:, :40], None, config, past_key_values=make_cache(ours, "static", kv_cache_dtype="int8"))
    want = generate(ours, PROMPT[:, :40], None, config, past_key_values=make_cache(ours, "static"))
    assert got.attentions is not None and want.attentions is not None
    a, b = got.attentions[0][0], want.attentions[0][0]  # layer 0 of the prefill: [1, H, 40, 40]
    torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
    assert 0 < float((a - b).abs().max()) < 0.02


def test_reorder_and_growth_carry_each_rows_scale():
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache(2, 2, 3, 16, torch.int8, initial_len=4)
    rows = [quantize_kv_rows(torch.randn(2, 3, 3, 16, generator=g)) for _ in range(4)]  # k0, k1, v0, v1: 3 slots
    for layer in range(2):
        for (values, scales), caches, scale_list in ((rows[layer], cache.key_cache, cache.key_scale),
                                                     (rows[2 + layer], cache.value_cache, cache.value_scale)):
            caches[layer][:, :, :3], scale_list[layer][:, :, :3] = values, scales
    cache.advance(3)
    cache.reserve(10)  # grows to new buffers: the filled slots and their scales move with them
    assert cache.max_cache_len >= 10 and len(cache.key_scale) == 2
    assert torch.equal(cache.key_cache[1][:, :, :3], rows[1][0]) and torch.equal(cache.key_scale[1][:, :, :3], rows[1][1])
    assert torch.equal(cache.value_scale[0][:, :, :3], rows[2][1])
    expected = cache.keys(0, 3)[[1, 0, 1]]  # [3, Hkv, 3, D] float32: rows 1, 0, 1 dequantized
    cache.reorder(torch.tensor([1, 0, 1]))  # beams: a new row count
    assert torch.equal(cache.keys(0, 3), expected) and cache.key_scale[0].shape[0] == 3
    cache.reorder(torch.tensor([2, 2, 0]))  # the same count: in place
    assert torch.equal(cache.keys(0, 3), expected[[2, 2, 0]])
    assert torch.equal(cache.value_scale[1][:, :, :3], rows[3][1][[1, 0, 1]][[2, 2, 0]])


def test_int8_caches_are_refused_where_nothing_reads_them(models, tiny_model_dir, capsys):
    ours, _ = models
    f32, _ = load_model(str(tiny_model_dir))  # float32: the torch path
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs a model on kvgen's kernels"):
        make_cache(f32, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        make_cache(ours, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kind must be 'dynamic' or 'static'"):
        make_cache(ours, "paged")
    with pytest.raises(ValueError, match="past_key_values was not made for this model"):
        generate(f32, PROMPT[:, :5], None, GenerationConfig(max_new_tokens=2),
                 past_key_values=make_cache(ours, kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="read by kvgen's kernels only"):
        make_cache(ours, "static", kv_cache_dtype="int8").update(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    assert main(["chat", "--model", str(tiny_model_dir), "--kv-cache-dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_cache_dtype='int8' needs a model on kvgen's kernels" in err
