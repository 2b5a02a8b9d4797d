"""int8 KV caches (``EngineArgs.kv_cache_dtype="int8"``): ``static_attention`` and ``paged_attention_qkv`` store each
row (a token's K or V in one KV head) as ``reference.quantize_kv_rows`` does, the same int8 values and scales, and
attend over the rows' values times their scales: as their torch twins, and as plain float64 attention over the
dequantized rows."""

from __future__ import annotations

import pytest
import torch
from helpers import float64_attention, paged_inputs

import kvgen.kernels as K
from kvgen.kernels.reference import dequantize_kv_rows, quantize_kv_rows

OPS = K.get_ops()
REF = K.reference_ops()


def test_quantize_kv_rows_keeps_each_row_within_half_a_step():
    """A row's largest magnitude becomes +-127 and every value comes back within half its scale; a zero row is zeros
    with scale 0 (no division by zero)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-3, 2, 5)[:, None, None]  # rows of very different sizes
    x[1, 2] = 0.0
    values, scales = quantize_kv_rows(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (5, 3)
    at_max = values.abs().amax(-1) == 127  # [5, 3]
    assert int((~at_max).sum()) == 1 and not bool(at_max[1, 2])  # every row but the zero one
    assert torch.equal(values[1, 2], torch.zeros(64, dtype=torch.int8)) and float(scales[1, 2]) == 0.0
    error = (dequantize_kv_rows(values, scales) - x.double()).abs()  # [5, 3, 64]
    assert bool((error <= scales.double()[..., None] * 0.5 * (1 + 1e-6)).all())


def _int8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float cache's rows quantized: (values int8, scales float32 [cache.shape[:-1]])."""
    return quantize_kv_rows(cache.float())


# (B, H, Hkv, D, T, past, window, softcap, sinks, padded): a decode over 3 chunks of keys; prefills whose queries run
# in groups (G 3, 8 and 1; D 72 with a softcap and sinks); a window over a left-padded batch
CASES = [(1, 9, 3, 64, 1, 600, 0, 0.0, False, False), (1, 9, 3, 64, 40, 10, 0, 0.0, False, False),
         (1, 16, 2, 64, 37, 0, 0, 0.0, False, False), (1, 4, 4, 64, 33, 270, 0, 0.0, False, False),
         (1, 4, 2, 72, 40, 3, 0, 50.0, True, False), (2, 6, 2, 64, 5, 9, 6, 0.0, False, True)]


@pytest.mark.parametrize("b,h,h_kv,d,t,past,window,softcap,with_sinks,padded", CASES)
def test_static_attention_on_int8_caches_matches_its_twin_and_float64(b, h, h_kv, d, t, past, window, softcap,
                                                                     with_sinks, padded):
    g = torch.Generator().manual_seed(past + t + d)
    qkv = torch.randn(b * t, (h + 2 * h_kv) * d, generator=g) * 2  # [B*T, (H + 2 Hkv) D]
    float_caches = [torch.randn(b, h_kv, past + t + 3, d, generator=g) for _ in range(2)]  # the cached rows: K, V
    (kc, ks), (vc, vs) = (_int8(c) for c in float_caches)
    sinks = torch.randn(h, generator=g) if with_sinks else None
    mask = None
    if padded:
        mask = torch.ones(b, past + t, dtype=torch.bool)
        mask[-1, :3] = False
    scale = d**-0.5
    mine, theirs = [x.clone() for x in (kc, vc, ks, vs)], [x.clone() for x in (kc, vc, ks, vs)]
    got = OPS.static_attention(qkv, mine[0], mine[1], mask, past, h, scale, window, softcap, sinks, mine[2], mine[3])
    want = REF.static_attention(qkv, theirs[0], theirs[1], mask, past, h, scale, window, softcap, sinks, theirs[2],
                                theirs[3])
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))  # the new rows' values and scales, to the bit
    new_k = qkv.view(b, t, -1)[..., h * d : (h + h_kv) * d].reshape(b, t, h_kv, d).transpose(1, 2)  # [B, Hkv, T, D]
    assert torch.equal(mine[0][:, :, past : past + t], quantize_kv_rows(new_k)[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    end = past + t
    k64, v64 = (dequantize_kv_rows(c[:, :, :end], s[:, :, :end]) for c, s in ((mine[0], mine[2]), (mine[1], mine[3])))
    q = qkv.view(b, t, -1)[..., : h * d].reshape(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
    exact = float64_attention(q, k64, v64, mask, past, scale, window, softcap, sinks)  # [B, T, H, D]
    torch.testing.assert_close(got.double().view(exact.shape), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    # int8 rows are not float16 rows: the same attention over float16 caches differs, by little
    fp16 = OPS.static_attention(qkv, *(c.half() for c in float_caches), mask, past, h, scale, window, softcap, sinks)
    difference = float((fp16 - got.view(fp16.shape)).abs().max())
    assert 0 < difference < 0.05 * float(fp16.abs().max())


def test_paged_attention_qkv_on_int8_pools_matches_its_twin_and_float64():
    """Sequence 0 (a 3-token chunk after 9 cached positions over blocks 3, 0, 5) and a decode; the written rows' values
    and scales are the twin's; every query's output is float64 attention over its dequantized rows."""
    g = torch.Generator().manual_seed(7)
    h, h_kv, d = 6, 2, 64
    qkv = torch.randn(4, (h + 2 * h_kv) * d, generator=g)
    rows, pools, slots, tables, qsl, seq_lens, bs = paged_inputs(qkv, h_kv, d, g)
    (kp, ks), (vp, vs) = (_int8(p) for p in pools)
    mine, theirs = [x.clone() for x in (kp, vp, ks, vs)], [x.clone() for x in (kp, vp, ks, vs)]
    got = OPS.paged_attention_qkv(rows, mine[0], mine[1], slots, tables, qsl, seq_lens, h, 0.125, 0, 0.0, None,
                                  mine[2], mine[3])
    want = REF.paged_attention_qkv(rows, theirs[0], theirs[1], slots, tables, qsl, seq_lens, h, 0.125, 0, 0.0, None,
                                   theirs[2], theirs[3])
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for r, (first, last) in enumerate(((0, 3), (3, 4))):
        length = int(seq_lens[r])
        positions = torch.arange(length)
        where = (tables[r][positions // bs], slice(None), positions % bs)
        k64, v64 = (dequantize_kv_rows(p[where], s[where]).transpose(0, 1)[None]  # [1, Hkv, L, D]
                    for p, s in ((mine[0], mine[2]), (mine[1], mine[3])))
        q = rows[first:last, : h * d].view(last - first, h, d).transpose(0, 1)[None]  # [1, H, T, D]
        exact = float64_attention(q, k64, v64, None, length - (last - first), 0.125)  # [1, T, H, D]
        torch.testing.assert_close(got[first:last].double(), exact.reshape(last - first, h * d), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(OPS.backend != "avx2", reason=f"C++ kernels unavailable (backend {OPS.backend})")
def test_int8_caches_need_their_scales_and_only_they_take_scales():
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(2, 8 * 16, generator=g)
    k8, v8 = (torch.zeros(1, 2, 8, 16, dtype=torch.int8) for _ in range(2))
    scales = [torch.zeros(1, 2, 8) for _ in range(2)]
    with pytest.raises(RuntimeError, match="int8 caches take k_scale and v_scale"):
        OPS.static_attention(qkv, k8, v8, None, 0, 4, 0.25)
    with pytest.raises(RuntimeError, match="int8 caches take k_scale and v_scale"):
        OPS.static_attention(qkv, k8.half(), v8.half(), None, 0, 4, 0.25, 0, 0.0, None, *scales)
    with pytest.raises(RuntimeError, match="must be contiguous float32"):
        OPS.static_attention(qkv, k8, v8, None, 0, 4, 0.25, 0, 0.0, None, scales[0][:, :, :4], scales[1])
    with pytest.raises(RuntimeError, match="must be contiguous float32"):
        OPS.static_attention(qkv, k8, v8, None, 0, 4, 0.25, 0, 0.0, None, scales[0].double(), scales[1])
    with pytest.raises(RuntimeError, match="int8 caches take k_scale and v_scale"):
        OPS.paged_attention_qkv(qkv, k8, v8, torch.tensor([0, 1]), torch.tensor([[0]]), torch.tensor([0, 2]),
                                torch.tensor([2]), 4, 0.25)
    assert float(OPS.static_attention(qkv, k8, v8, None, 0, 4, 0.25, 0, 0.0, None, *scales).abs().sum()) > 0
