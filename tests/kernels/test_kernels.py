"""kvgen's C++ kernels against their plain-torch twins and against gguf.quants dequantization.

The reference for a quantized GEMM is dequantize-then-matmul: weights dequantized by
``gguf.quants`` (llama.cpp's numpy reference), activations by the twin of the Q8 activation
quantizer. The fast path (C++) and the portable path (kvgen.kernels.reference) must agree.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import kvgen.kernels as K
from kvgen.kernels import reference as R

OPS = K.get_ops()
REF = K.reference_ops()
needs_avx2 = pytest.mark.skipif(OPS.backend != "avx2", reason=f"C++ kernels unavailable (backend {OPS.backend})")
GGUF_CODE = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q8_0: 2, Q.F16: 3, Q.BF16: 4, Q.Q6_K: 5, Q.Q5_0: 6, Q.Q5_1: 7, Q.IQ4_NL: 8,
             Q.Q2_K: 9, Q.Q3_K: 10, Q.MXFP4: 11, Q.Q4_K: 12, Q.Q5_K: 13, Q.IQ4_XS: 14}
WEIGHT_TYPE = {Q.Q4_0: K.Q4_0, Q.Q4_1: K.Q4, Q.Q8_0: K.Q8, Q.F16: K.F16, Q.BF16: K.BF16, Q.Q6_K: K.Q6, Q.Q5_0: K.Q5_0,
               Q.Q5_1: K.Q5, Q.IQ4_NL: K.IQ4, Q.Q2_K: K.Q2, Q.Q3_K: K.Q3, Q.MXFP4: K.MXFP4, Q.Q4_K: K.Q4_K,
               Q.Q5_K: K.Q5_K, Q.IQ4_XS: K.IQ4_XS}
KERNEL_QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.MXFP4,
                 Q.Q4_K, Q.Q5_K, Q.IQ4_XS]
# types the gguf package cannot quantize: random blocks, (values per block, bytes per block, offsets of fp16 scales)
RANDOM_BLOCKS = {Q.Q6_K: (256, 210, (208,)), Q.IQ4_NL: (32, 18, (0,)), Q.Q2_K: (256, 84, (80, 82)),
                 Q.Q3_K: (256, 110, (108,)), Q.Q4_K: (256, 144, (0, 2)),
                 Q.Q5_K: (256, 176, (0, 2)), Q.IQ4_XS: (256, 136, (0,))}
FLOAT16_QTYPES = (Q.F16, Q.BF16)  # weights that take the activations unquantized


def _cols(qtype: Q, k: int) -> int:
    """k rounded up to whole blocks of ``qtype`` (the K types: 256 columns)."""
    return -(-k // 256) * 256 if qtype in (Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.IQ4_XS) else k


def _gguf_matrix(qtype: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF bytes [n, row_bytes] uint8, their gguf.quants dequantization [n, k] float32). Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
    IQ4_NL and IQ4_XS (which the gguf package cannot quantize): random values (indices) and scales, fp16 d ~ 1e-3 (some
    negative)."""
    if qtype in RANDOM_BLOCKS:
        values, size, offsets = RANDOM_BLOCKS[qtype]
        gen = torch.Generator().manual_seed(seed)
        blocks = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, generator=gen)
        for at in offsets:
            d = (torch.randn(n, k // values, 1, generator=gen) * 1e-3).half()
            blocks[..., at : at + 2] = d.view(torch.uint8)
        raw = blocks.reshape(n, -1).numpy()
        return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, qtype))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = quantize(w, qtype)  # F16 as float16 values: the file's bytes are their bits
    return torch.from_numpy(raw.view("uint8")), torch.from_numpy(dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_repack_round_trips_to_gguf_dequantization(qtype):
    raw, dense = _gguf_matrix(qtype, 21, _cols(qtype, 96), seed=1)  # 21 rows: a partial last group
    parts = [raw[:5].contiguous(), raw[5:13].contiguous(), raw[13:].contiguous()]  # stacked like q, k, v
    for ops in (OPS, REF):
        packed = ops.repack_gguf(parts, GGUF_CODE[qtype])
        weight_type = WEIGHT_TYPE[qtype]
        torch.testing.assert_close(R.dequantize_packed(packed, weight_type)[:21], dense, rtol=0, atol=0)
    assert torch.equal(OPS.repack_gguf(parts, GGUF_CODE[qtype]), REF.repack_gguf(parts, GGUF_CODE[qtype]))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.Q4_K])
def test_repack_writes_into_a_given_out_and_refuses_a_wrong_one(qtype):
    """``out`` (a weight arena's memory, ``pack_gguf_rows``'s ``empty``) receives the records the op would return,
    whatever it held; an out of another shape or dtype is refused by both."""
    raw, _ = _gguf_matrix(qtype, 21, _cols(qtype, 96), seed=2)
    want = REF.repack_gguf([raw], GGUF_CODE[qtype])  # [G, nb, R]
    for ops in (OPS, REF):
        out = torch.full(want.shape, 0xA5, dtype=torch.uint8)
        got = ops.repack_gguf([raw], GGUF_CODE[qtype], out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
        for bad in (torch.empty(want.shape[0] + 1, *want.shape[1:], dtype=torch.uint8), want.to(torch.int8)):
            with pytest.raises((ValueError, RuntimeError), match="out must be a contiguous uint8"):
                ops.repack_gguf([raw], GGUF_CODE[qtype], bad)



@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_repack_on_two_threads_is_the_twins(qtype):
    """Repacking splits the 8-row groups over threads (load time): 301 rows (38 groups, a partial last one) in three
    parts, on 2 threads, give the twin's bytes."""
    raw, _ = _gguf_matrix(qtype, 301, _cols(qtype, 64), seed=3)
    parts = [raw[:130].contiguous(), raw[130:131].contiguous(), raw[131:].contiguous()]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed = OPS.repack_gguf(parts, GGUF_CODE[qtype])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(packed, REF.repack_gguf(parts, GGUF_CODE[qtype]))

@needs_avx2
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.F16])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_qgemm_on_two_threads_is_one_threads(qtype, m):
    """qgemm splits the 8-row groups over threads (from 512 blocks a thread: here 72 groups of 18 blocks at M = 1,
    the default model's o_proj); each output is one thread's sum in one order, so 2 threads give 1's bits."""
    k = _cols(qtype, 576)
    raw, _ = _gguf_matrix(qtype, 576, k, seed=4)
    weight_type, packed = K.pack_gguf_rows(qtype.name, [raw])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(OPS.qgemm(x, packed, weight_type, 576, None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_activation_quantizer_matches_plain_torch():
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :32] = 0  # an all-zero block: scale 0, no division by zero
    x[1, 5] = 127 / 2 * x[1, :32].abs().max() / 127  # a value near a rounding tie
    got, want = OPS.quantize_q8a(x), R.quantize_q8a(x)
    assert torch.equal(got, want)
    blocks = want.view(7, -1, 40)
    qs = blocks[..., 8:].contiguous().view(torch.int8)
    assert int(qs.abs().max()) == 127  # every block's largest value maps to +-127
    torch.testing.assert_close(R.dequantize_q8a(want), x, rtol=0, atol=float(x.abs().max()) / 127)



def test_activation_quantizer_on_blocks_too_small_for_their_scale():
    """A block whose largest |x| is below 127 / FLT_MAX (127 / amax overflows to inf): the kernel's bytes (those of
    llama.cpp's x86 quantize_row_q8_1: every value -128, the sum s 0) are the plain-torch reference's too."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)) * 1e-39
    x[0, :5] = 0  # 0 * inf is NaN
    x[2, 32:] *= 1e30  # a block of ordinary values beside one
    got, want = OPS.quantize_q8a(x), R.quantize_q8a(x)
    assert torch.equal(got, want)
    blocks = want.view(3, 2, 40)
    assert bool((blocks[:, 0, 8:].contiguous().view(torch.int8) == -128).all())
    assert int(blocks[2, 1, 8:].contiguous().view(torch.int8).abs().max()) == 127

@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 21, 96), (17, 200, 320), (64, 72, 1536)])
def test_qgemm_matches_dequantize_then_matmul(qtype, m, n, k):
    k = _cols(qtype, k)
    raw, dense = _gguf_matrix(qtype, n, k, seed=m + n + k)
    weight_type, packed = K.pack_gguf_rows(qtype.name, [raw])
    assert weight_type == WEIGHT_TYPE[qtype]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    xq = x if qtype in FLOAT16_QTYPES else R.dequantize_q8a(R.quantize_q8a(x))  # 16-bit weights take x as it is
    want = xq @ dense.T + bias  # [M, N]
    scale = float(want.abs().max())
    for ops in (OPS, REF):
        got = ops.qgemm(x, packed, weight_type, n, bias)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    # and close to the unquantized product: per-block int8 activations keep ~1 % accuracy
    exact = x @ dense.T + bias
    assert float((OPS.qgemm(x, packed, weight_type, n, bias) - exact).abs().max()) < 0.05 * scale


@needs_avx2
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.Q6_K, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.MXFP4,
                                   Q.Q4_K, Q.Q5_K, Q.IQ4_XS])
def test_qgemm_rows_do_not_depend_on_the_batch(qtype):
    """Batch invariance: each row's bits are the same alone, in any tile of 1-4 rows, or among 33."""
    raw, _ = _gguf_matrix(qtype, 64, 256, seed=3)
    weight_type, packed = K.pack_gguf_rows(qtype.name, [raw])
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(4))
    together = OPS.qgemm(x, packed, weight_type, 64, None)
    alone = torch.cat([OPS.qgemm(x[i : i + 1], packed, weight_type, 64, None) for i in range(33)])
    assert torch.equal(together, alone)
    assert torch.equal(OPS.qgemm(x[5:7], packed, weight_type, 64, None), together[5:7])


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_dequantize_rows_is_an_embedding_lookup(qtype):
    k = _cols(qtype, 64)
    raw, dense = _gguf_matrix(qtype, 50, k, seed=5)
    weight_type, packed = K.pack_gguf_rows(qtype.name, [raw])
    ids = torch.tensor([0, 49, 7, 7, 31])
    for ops in (OPS, REF):
        assert torch.equal(ops.dequantize_rows(packed, weight_type, ids, k), dense[ids])


def test_float_index_operands_are_refused_as_the_reference_refuses_them():
    """The C++ ops cast ids and block tables to int64: a float id 1.7 read row 1 (block 1.0: block 1); the
    reference's indexing refuses floats."""
    raw, _ = _gguf_matrix(Q.Q8_0, 16, 64, seed=12)
    weight_type, packed = K.pack_gguf_rows("Q8_0", [raw])
    q, pool = torch.randn(2, 4, 16), torch.randn(4, 2, 4, 16)
    tables, qsl, seq_lens = torch.tensor([[0.0, 1.0]]), torch.tensor([0, 2]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="Expected dtype int32 or int64 for index"):
        REF.dequantize_rows(packed, weight_type, torch.tensor([1.7]), 64)
    with pytest.raises(IndexError, match="tensors used as indices must be long"):
        REF.paged_attention(q, pool, pool, tables, qsl, seq_lens, 0.25)
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match="ids must be an integer tensor, got Float"):
            OPS.dequantize_rows(packed, weight_type, torch.tensor([1.7]), 64)
        with pytest.raises(RuntimeError, match="block_tables, query_start_loc and seq_lens must be integer tensors"):
            OPS.paged_attention(q, pool, pool, tables, qsl, seq_lens, 0.25)
        assert torch.equal(OPS.dequantize_rows(packed, weight_type, torch.tensor([1], dtype=torch.int32), 64),
                           REF.dequantize_rows(packed, weight_type, torch.tensor([1]), 64))


def _attention_inputs(b, h, h_kv, t, s, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # [B, H, T, D], strided like the model's
    k = torch.randn(b, h_kv, s + 3, d, generator=g).to(dtype)[:, :, :s]  # a view into a longer cache
    v = torch.randn(b, h_kv, s + 3, d, generator=g).to(dtype)[:, :, :s]
    return q, k, v


@pytest.mark.parametrize("b,h,h_kv,t,s,d,dtype", [
    (1, 9, 3, 1, 77, 64, torch.float16), (3, 4, 2, 5, 12, 16, torch.float32), (2, 6, 2, 7, 7, 80, torch.float16),
    (2, 6, 2, 40, 40, 64, torch.float16), (2, 4, 2, 37, 300, 16, torch.float32),  # >= 16 queries: shared K/V rows
])
def test_attention_matches_reference_with_padding(b, h, h_kv, t, s, d, dtype):
    q, k, v = _attention_inputs(b, h, h_kv, t, s, d, dtype, seed=s)
    key_mask = torch.ones(b, s, dtype=torch.bool)
    key_mask[-1, :2] = False  # left padding in the last row
    for mask in (None, key_mask):
        want = REF.attention(q, k, v, mask, s - t, d**-0.5)
        torch.testing.assert_close(OPS.attention(q, k, v, mask, s - t, d**-0.5), want, rtol=1e-5, atol=1e-5)
    # against plain softmax attention in float64 on fp16-rounded K/V (the kernels' contract)
    qd, kd, vd = q.double(), k.half().double(), v.half().double()
    scores = (qd @ kd.repeat_interleave(h // h_kv, 1).transpose(-1, -2)) * d**-0.5  # [B, H, T, S]
    causal = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    want64 = (probs @ vd.repeat_interleave(h // h_kv, 1)).transpose(1, 2)  # [B, T, H, D]
    torch.testing.assert_close(OPS.attention(q, k, v, None, s - t, d**-0.5).double(), want64, rtol=1e-5, atol=1e-5)


@needs_avx2
@pytest.mark.parametrize("h,h_kv", [(9, 3), (4, 4), (8, 4)])  # prefill groups: 2, 8, 4 queries (AVX2: 1, 6, 3)
@pytest.mark.parametrize("s,t", [(20, 6), (600, 6), (600, 40), (300, 300)])  # 600: several 256-key chunks per query;
def test_attention_query_does_not_depend_on_chunking_or_padding(s, t, h, h_kv):  # t >= 16: blocks share K/V rows
    q, k, v = _attention_inputs(1, h, h_kv, t, s, 64, torch.float16, seed=7)
    past = s - t
    whole = OPS.attention(q, k, v, None, past, 0.125)  # [1, t, H, 64]
    for i in sorted({0, 1, t // 2, t - 17, t - 16, t - 1} & set(range(t))):  # as a one-token decode over its prefix
        one = OPS.attention(q[:, :, i : i + 1], k[:, :, : past + 1 + i], v[:, :, : past + 1 + i], None, past + i, 0.125)
        assert torch.equal(one[:, 0], whole[:, i])
    pad = 5  # the same row left-padded by 5 slots
    kp = torch.cat([torch.zeros(1, h_kv, pad, 64, dtype=k.dtype), k], dim=2)
    vp = torch.cat([torch.zeros(1, h_kv, pad, 64, dtype=v.dtype), v], dim=2)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, s, dtype=torch.bool)], dim=1)
    assert torch.equal(OPS.attention(q, kp, vp, mask, past + pad, 0.125), whole)
    if past == 0:  # and with its padding as queries too (they see no key: their own slot, as the twin's)
        qp = torch.cat([torch.randn(1, h, pad, 64), q], dim=2)
        padded = OPS.attention(qp, kp, vp, mask, 0, 0.125)
        assert torch.equal(padded[:, pad:], whole)
        torch.testing.assert_close(padded, REF.attention(qp, kp, vp, mask, 0, 0.125), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, REF.attention(q, k, v, None, past, 0.125), rtol=1e-5, atol=1e-5)


@needs_avx2
def test_paged_prefill_chunk_equals_its_queries_one_by_one():
    """A 40-query prefill chunk over 600 positions (blocks of queries share K/V rows) gives each query the bits of
    that query attending alone, and of contiguous attention over the gathered blocks."""
    g = torch.Generator().manual_seed(9)
    bs, h, h_kv, d, n, length = 16, 9, 3, 64, 40, 600
    k_pool = torch.randn(40, h_kv, bs, d, generator=g).half()
    v_pool = torch.randn(40, h_kv, bs, d, generator=g).half()
    tables = torch.randperm(40, generator=g)[None, : length // bs + 1]  # [1, 38]
    q = torch.randn(n, h, d, generator=g)
    got = OPS.paged_attention(q, k_pool, v_pool, tables, torch.tensor([0, n]), torch.tensor([length]), 0.125)
    for i in (0, 15, 16, 33, n - 1):
        pos = length - n + i
        one = OPS.paged_attention(q[i : i + 1], k_pool, v_pool, tables, torch.tensor([0, 1]), torch.tensor([pos + 1]),
                                  0.125)
        assert torch.equal(one[0], got[i])
    blocks, rows = tables[0][torch.arange(length) // bs], torch.arange(length) % bs
    k = k_pool[blocks, :, rows].transpose(0, 1)[None]  # [1, Hkv, S, D]
    v = v_pool[blocks, :, rows].transpose(0, 1)[None]
    contiguous = OPS.attention(q.transpose(0, 1)[None], k, v, None, length - n, 0.125)[0]  # [n, H, D]
    assert torch.equal(got, contiguous)


def test_paged_attention_matches_reference_and_contiguous_attention():
    g = torch.Generator().manual_seed(8)
    bs, h, h_kv, d = 4, 9, 3, 64
    k_pool = torch.randn(20, h_kv, bs, d, generator=g).half()
    v_pool = torch.randn(20, h_kv, bs, d, generator=g).half()
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]])
    seq_lens, qsl = torch.tensor([6, 15]), torch.tensor([0, 1, 5])  # a decode, then a 4-token chunk
    q = torch.randn(5, h, d, generator=g)
    got = OPS.paged_attention(q, k_pool, v_pool, tables, qsl, seq_lens, 0.125)
    torch.testing.assert_close(got, REF.paged_attention(q, k_pool, v_pool, tables, qsl, seq_lens, 0.125), rtol=1e-5, atol=1e-5)
    # sequence 1 alone gives the same bits, and so does contiguous attention over its gathered blocks
    alone = OPS.paged_attention(q[1:], k_pool, v_pool, tables[1:], torch.tensor([0, 4]), seq_lens[1:], 0.125)
    if OPS.backend == "avx2":
        assert torch.equal(alone, got[1:])
    blocks, rows = tables[1][torch.arange(15) // bs], torch.arange(15) % bs  # [15] each
    k = k_pool[blocks, :, rows].transpose(0, 1)[None]  # [15, Hkv, D] -> [1, Hkv, 15, D]
    v = v_pool[blocks, :, rows].transpose(0, 1)[None]
    contiguous = OPS.attention(q[1:].transpose(0, 1)[None], k, v, None, 11, 0.125)[0]  # [4, H, D]
    torch.testing.assert_close(alone, contiguous, rtol=0, atol=0)


@pytest.mark.parametrize("rotary_dim", [48, 40, 2])
def test_partial_rope_rotates_the_first_rotary_dims_of_each_q_and_k_head(rotary_dim):
    """cos, sin [N, R] with R < D = 64 (Phi-4-mini rotates 96 of 128): the first R dims of every q and k head are
    rotated as the model's float path (``apply_rope``, HF Phi3's form) and the twin; the other D - R dims and v are
    left alone. R / 2 = 24, 20, 1: whole 8-lane steps, steps and a scalar tail, the tail alone."""
    from kvgen.models.layers import apply_rope

    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(5, (4 + 2 * 2) * 64, generator=g)
    cos, sin = torch.randn(5, rotary_dim, generator=g), torch.randn(5, rotary_dim, generator=g)
    got, want = qkv.clone(), qkv.clone()
    OPS.rope_qkv_(got, cos, sin, 4, 2)
    REF.rope_qkv_(want, cos, sin, 4, 2)
    torch.testing.assert_close(got, want)
    heads = qkv.view(5, 8, 64).transpose(0, 1)[None, :6]  # [1, H + Hkv, N, D]: the q and k heads
    rotated = apply_rope(heads, cos[None, None], sin[None, None])[0].transpose(0, 1)  # [N, H + Hkv, D]
    torch.testing.assert_close(got.view(5, 8, 64)[:, :6], rotated)
    assert torch.equal(got.view(5, 8, 64)[:, :6, rotary_dim:], qkv.view(5, 8, 64)[:, :6, rotary_dim:])
    assert torch.equal(got.view(5, 8, 64)[:, 6:], qkv.view(5, 8, 64)[:, 6:])  # v untouched
    assert not torch.equal(got.view(5, 8, 64)[:, :6, :rotary_dim], qkv.view(5, 8, 64)[:, :6, :rotary_dim])
    with pytest.raises((RuntimeError, ValueError), match="R even and <= D"):
        OPS.rope_qkv_(qkv.clone(), torch.randn(5, 66), torch.randn(5, 66), 4, 2)


@needs_avx2
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("c", [2048, 2880, 37])  # Qwen3-30B-A3B's and gpt-oss's hidden sizes; a tail past 16 columns
def test_linear_f64_is_float64_linear_rounded_once_and_batch_invariant(with_bias, c):
    """A router's logits: the op gives float64 F.linear rounded to float32 (its twin) and float32 F.linear within
    float32's rounding; a row alone gives the bits it gets among 37 others (the float64 sum's order is fixed)."""
    g = torch.Generator().manual_seed(c)
    x, w = torch.randn(37, c, generator=g), torch.randn(128, c, generator=g) * 0.05  # [N, C], [E, C]
    b = torch.randn(128, generator=g) if with_bias else None
    for ops in (OPS, REF):
        got = ops.linear_f64(x, w, b)  # [N, E]
        assert got.dtype == torch.float32 and got.shape == (37, 128)
        assert torch.equal(got, REF.linear_f64(x, w, b))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert all(torch.equal(ops.linear_f64(x[i : i + 1], w, b), got[i : i + 1]) for i in (0, 17, 36))


def test_moe_experts_row_is_the_loop_of_ops_it_replaces():
    """A decode row's k = 5 routed experts (Q4_0 and Q8_0 weights mixed) in one op: bit for bit the torch loop of
    qgemm, silu_mul, product and add in the given order (kvgen.models.moe's loop before it), near the twin;
    experts_on_kernels takes it for one row (called once); bad lengths are refused."""
    import dataclasses

    from kvgen.models.moe import experts_on_kernels

    g = torch.Generator().manual_seed(11)
    c, i, k = 96, 64, 5
    experts = []
    for e in range(8):
        qtype = "Q4_0" if e % 2 else "Q8_0"
        gu = quantize(torch.randn(2 * i, c, generator=g).numpy(), Q[qtype])
        dn = quantize(torch.randn(c, i, generator=g).numpy(), Q[qtype])
        (t1, p1), (t2, p2) = K.pack_gguf_rows(qtype, [torch.from_numpy(gu)]), K.pack_gguf_rows(qtype, [torch.from_numpy(dn)])
        experts.append(((p1, t1, 2 * i, None), (p2, t2, c, None)))
    h = torch.randn(1, c, generator=g)
    ids = torch.tensor([[6, 1, 3, 0, 5]])
    weights = torch.softmax(torch.randn(1, k, generator=g), -1)
    order = sorted(zip(ids[0].tolist(), range(k)))
    args = (h, [experts[e][0][0] for e, _ in order], [v for e, _ in order for v in experts[e][0][1:3]],
            [experts[e][1][0] for e, _ in order], [v for e, _ in order for v in experts[e][1][1:3]],
            [float(weights[0, j]) for _, j in order], [], 0)
    got = OPS.moe_experts_row(*args)
    loop = torch.zeros_like(h)
    for e, j in order:
        loop.add_(OPS.qgemm(OPS.silu_mul(OPS.qgemm(h, *experts[e][0])), *experts[e][1]) * weights[0, j])
    assert torch.equal(got, loop)
    torch.testing.assert_close(got, REF.moe_experts_row(*args), rtol=1e-3, atol=1e-3 * float(got.abs().max()))
    calls = []

    def counted(*a):
        calls.append(1)
        return OPS.moe_experts_row(*a)

    ops = dataclasses.replace(OPS, moe_experts_row=counted)
    assert torch.equal(experts_on_kernels(ops, h, weights, ids, experts, ops.silu_mul), loop) and calls == [1]
    with pytest.raises((RuntimeError, ValueError), match="k >= 1 experts"):
        OPS.moe_experts_row(h, args[1], args[2], args[3][:-1], args[4], args[5], [], 0)
    # gpt-oss: biases on both projections (one left out) and the clamped GLU, as its loop computes them
    biases = [torch.randn(2 * i if n % 2 == 0 else c, generator=g) for n in range(2 * k)]
    biases[3] = None
    got = OPS.moe_experts_row(*args[:6], biases, 1)
    loop = torch.zeros_like(h)
    for n, (e, j) in enumerate(order):
        gu, dn = experts[e]
        y = OPS.qgemm(OPS.gpt_oss_glu(OPS.qgemm(h, *gu[:3], biases[2 * n])), *dn[:3], biases[2 * n + 1])
        loop.add_(y * weights[0, j])
    assert torch.equal(got, loop)
    torch.testing.assert_close(got, REF.moe_experts_row(*args[:6], biases, 1), rtol=1e-3,
                               atol=1e-3 * float(got.abs().max()))


def test_gpt_oss_glu_matches_the_twin():
    """(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7): gates and ups past both limits, a NaN gate
    stays NaN (torch.clamp's rule)."""
    g = torch.Generator().manual_seed(12)
    gate_up = torch.randn(3, 2 * 40, generator=g) * 6  # values well past +-7
    gate_up[1, 3] = float("nan")
    got, want = OPS.gpt_oss_glu(gate_up), REF.gpt_oss_glu(gate_up)
    assert got.shape == (3, 40) and bool(got[1, 3].isnan()) and int(got.isnan().sum()) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert float(gate_up[:, :40].nan_to_num().max()) > 7 and float(gate_up[:, 40:].min()) < -7  # both clamps reached


def test_fused_small_ops_match_reference():
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (576,), w, 1e-5))
    qkv = torch.randn(7, (9 + 2 * 3) * 64, generator=g)
    cos, sin = torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g)
    got, want = qkv.clone(), qkv.clone()
    OPS.rope_qkv_(got, cos, sin, 9, 3)
    REF.rope_qkv_(want, cos, sin, 9, 3)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[:, 12 * 64 :], qkv[:, 12 * 64 :])  # v untouched
    q_w, k_w = torch.rand(64, generator=g) + 0.5, torch.rand(64, generator=g) + 0.5
    got, want = qkv.clone(), qkv.clone()
    OPS.rms_norm_heads_(got, q_w, k_w, 1e-6, 9, 3)
    REF.rms_norm_heads_(want, q_w, k_w, 1e-6, 9, 3)
    torch.testing.assert_close(got, want)
    heads = qkv.view(7, 15, 64)  # [N, H + 2 Hkv, D]: the q heads by q_w, the k heads by k_w, v untouched
    torch.testing.assert_close(got.view(7, 15, 64)[:, :9], torch.nn.functional.rms_norm(heads[:, :9], (64,), q_w, 1e-6))
    torch.testing.assert_close(got.view(7, 15, 64)[:, 9:12], torch.nn.functional.rms_norm(heads[:, 9:12], (64,), k_w, 1e-6))
    assert torch.equal(got[:, 12 * 64 :], qkv[:, 12 * 64 :])
    gate_up = torch.randn(6, 2 * 1536, generator=g) * 5
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)
    gelu = torch.nn.functional.gelu(gate, approximate="tanh") * up  # Gemma's GeGLU, gates far into both tails
    torch.testing.assert_close(OPS.gelu_tanh_mul(gate_up), gelu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(REF.gelu_tanh_mul(gate_up), gelu, rtol=0, atol=0)


def test_bad_inputs_raise_clear_errors():
    raw, _ = _gguf_matrix(Q.Q4_1, 16, 64, seed=10)
    weight_type, packed = K.pack_gguf_rows("Q4_1", [raw])
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match="K=96"):
            OPS.qgemm(torch.randn(2, 96), packed, weight_type, 16, None)
    with pytest.raises(ValueError, match="Q6_K"):
        K.pack_gguf_rows("Q6_K", [raw])
    with pytest.raises(ValueError, match="nb \\* 20"):
        K.pack_gguf_rows("Q4_1", [raw[:, :30].contiguous()])


def test_fused_cache_write_and_attention_match_reference():
    g = torch.Generator().manual_seed(11)
    b, t, h, h_kv, d, past = 2, 3, 6, 2, 32, 5
    qkv = torch.randn(b * t, (h + 2 * h_kv) * d, generator=g)
    mask = torch.ones(b, past + t, dtype=torch.bool)
    mask[1, :2] = False
    for dtype in (torch.float16, torch.float32):
        caches = [torch.randn(b, h_kv, 16, d, generator=g).to(dtype) for _ in range(2)]
        mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
        got = OPS.static_attention(qkv, mine[0], mine[1], mask, past, h, d**-0.5)
        want = REF.static_attention(qkv, theirs[0], theirs[1], mask, past, h, d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])  # the same slots written
    tables, seq_lens, qsl = torch.tensor([[2, 5], [7, 1]]), torch.tensor([3, 6]), torch.tensor([0, 3, 6])
    slots = torch.tensor([8, 9, 10, 29, 30, 31])  # seq 0: positions 0-2 (block 2); seq 1: positions 3-5 (blocks 7, 1)
    slots[3:] = torch.tensor([7 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1])
    for dtype in (torch.float16, torch.float32):
        pools = [torch.randn(8, h_kv, 4, d, generator=g).to(dtype) for _ in range(2)] * 2
        pools[2:] = [p.clone() for p in pools[:2]]
        got = OPS.paged_attention_qkv(qkv, pools[0], pools[1], slots, tables, qsl, seq_lens, h, d**-0.5)
        want = REF.paged_attention_qkv(qkv, pools[2], pools[3], slots, tables, qsl, seq_lens, h, d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3]), dtype  # the same slots written
    if OPS.backend == "avx2":  # the C++ op checks its index operands instead of converting them
        with pytest.raises(RuntimeError, match="slot 32 outside the pool of 32"):
            OPS.paged_attention_qkv(qkv, pools[0], pools[1], slots + 1, tables, qsl, seq_lens, h, d**-0.5)
        with pytest.raises(RuntimeError, match="must be contiguous int64"):
            OPS.paged_attention_qkv(qkv, pools[0], pools[1], slots.int(), tables, qsl, seq_lens, h, d**-0.5)
        with pytest.raises(RuntimeError, match="query_start_loc must run from 0 to N=6"):
            OPS.paged_attention_qkv(qkv, pools[0], pools[1], slots, tables, qsl - 1, seq_lens, h, d**-0.5)
        with pytest.raises(RuntimeError, match="sequence 1 reads block 8 outside the pool of 8"):
            OPS.paged_attention_qkv(qkv, pools[0], pools[1], slots, torch.tensor([[2, 5], [8, 1]]), qsl, seq_lens, h,
                                    d**-0.5)


class DecoderInputs(NamedTuple):
    """Random operands of ``decoder_layers`` (see :func:`_decoder_inputs`)."""

    x: torch.Tensor
    weights: list[torch.Tensor]
    linears: list[int]
    eps: list[float]
    extras: list[torch.Tensor | None]
    layer_args: list[int]
    rope: list[torch.Tensor]
    caches: list[torch.Tensor]
    mask: torch.Tensor
    heads: tuple[int, int, float, int, float]  # H, Hkv, scale, activation, softcap

    def layers(self) -> tuple:
        return self.x, self.weights, self.linears, self.eps, self.extras, self.layer_args, self.rope


def _decoder_inputs(b: int, t: int, past: int, seed: int, variant: str = "llama", c: int = 64, inter: int = 96
                    ) -> DecoderInputs:
    """Random operands of two layers of ``decoder_layers``: C ``c`` (64), H 4, Hkv 2, D 16, I ``inter`` (96), Q4_1 /
    Q8_0 / F16 / BF16 projections. ``variant``: ``llama`` (no extras); ``qwen``: layer 0 has the four biases and q/k norms (Qwen2,
    Qwen3), layer 1 a qkv bias only; ``gemma``: q/k norms and post-attention / post-feedforward norms on both layers,
    layer 0 full attention on RoPE table 1, layer 1 a 3-token window on table 2, GeGLU, scores capped at 2."""
    h, h_kv, d = 4, 2, 16
    g, g_extra = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    weights, linears, eps, extras = [], [], [], []
    for layer in range(2):
        for j, (n, k) in enumerate((((h + 2 * h_kv) * d, c), (c, h * d), (2 * inter, c), (c, inter))):
            qtype = (Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16)[(layer + j) % 4]
            raw, _ = _gguf_matrix(qtype, n, k, seed=seed + n + k + layer)
            weight_type, packed = K.pack_gguf_rows(qtype.name, [raw])
            weights.append(packed)
            linears += [weight_type, n]
            has_bias = variant == "qwen" and (layer == 0 or j == 0)
            extras.append(torch.randn(n, generator=g_extra) if has_bias else None)
        eps += [1e-5, 1e-6, 1e-6]
        has_qk_norm = variant == "gemma" or (variant == "qwen" and layer == 0)
        extras += [torch.rand(d, generator=g_extra) + 0.5 if has_qk_norm else None for _ in range(2)]  # q_norm, k_norm
        extras += [torch.rand(c, generator=g_extra) + 0.5 if variant == "gemma" else None for _ in range(2)]  # post
    for layer in range(2):  # norms go at 6 l and 6 l + 3, around the four projections
        weights.insert(6 * layer, torch.rand(c, generator=g) + 0.5)
        weights.insert(6 * layer + 3, torch.rand(c, generator=g) + 0.5)
    x = torch.randn(b * t, c, generator=g)
    rope = []
    for _ in range(2 if variant == "gemma" else 1):
        angles = torch.randn(b * t, d // 2, generator=g)
        rope += [torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)]  # cos, sin [N, D]
    caches = [torch.randn(b, h_kv, past + t + 3, d, generator=g).half() for _ in range(4)]
    mask = torch.ones(b, past + t, dtype=torch.bool)
    mask[-1, :2] = False  # a left-padded row
    gemma = variant == "gemma"
    return DecoderInputs(x, weights, linears, eps, extras if variant != "llama" else [], [1, 0, 2, 3] if gemma else [],
                         rope, caches, mask, (h, h_kv, d**-0.5, int(gemma), 2.0 if gemma else 0.0))


def _op_by_op(inputs: DecoderInputs, attend) -> torch.Tensor:
    """``LlamaDecoderLayer.forward_kernels`` (``Gemma3DecoderLayer.forward_kernels`` where the layer has post norms),
    op by op, over every layer; ``attend(l, qkv, window)`` -> [N, H D]."""
    rows, (h, h_kv, _, activation, _) = inputs.x, inputs.heads
    for layer in range(len(inputs.weights) // 6):
        norm1, qkv, o, norm2, gate_up, down = inputs.weights[6 * layer : 6 * layer + 6]
        lin, e = inputs.linears[8 * layer : 8 * layer + 8], inputs.eps[3 * layer : 3 * layer + 3]
        qkv_b, o_b, gate_up_b, down_b, q_norm, k_norm, post_attn, post_ff = (
            inputs.extras[8 * layer : 8 * layer + 8] if inputs.extras else [None] * 8)
        table, window = inputs.layer_args[2 * layer : 2 * layer + 2] if inputs.layer_args else (1, 0)
        hid = OPS.qgemm(OPS.rms_norm(rows, norm1, e[0]), qkv, lin[0], lin[1], qkv_b)
        if q_norm is not None:
            OPS.rms_norm_heads_(hid, q_norm, k_norm, e[2], h, h_kv)
        if table:
            OPS.rope_qkv_(hid, inputs.rope[2 * table - 2], inputs.rope[2 * table - 1], h, h_kv)
        hid = attend(layer, hid, window)
        rows = (OPS.qgemm(hid, o, lin[2], lin[3], o_b, rows) if post_attn is None
                else rows + OPS.rms_norm(OPS.qgemm(hid, o, lin[2], lin[3], o_b), post_attn, e[0]))
        hid = OPS.qgemm(OPS.rms_norm(rows, norm2, e[1]), gate_up, lin[4], lin[5], gate_up_b)
        hid = OPS.gelu_tanh_mul(hid) if activation else OPS.silu_mul(hid)
        rows = (OPS.qgemm(hid, down, lin[6], lin[7], down_b, rows) if post_ff is None
                else rows + OPS.rms_norm(OPS.qgemm(hid, down, lin[6], lin[7], down_b), post_ff, e[1]))
    return rows


def _clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


@needs_avx2
@pytest.mark.parametrize("b,t,past,variant", [(1, 1, 9, "llama"), (2, 3, 5, "llama"), (2, 3, 5, "qwen"),
                                              (2, 3, 5, "gemma"), (1, 1, 9, "gemma")])
def test_decoder_layers_is_the_layer_ops_in_order_and_matches_its_twin(b, t, past, variant):
    # a decode step; a chunk over a padded batch; the same with biases and q/k norms, and with Gemma's layer
    inputs = _decoder_inputs(b, t, past, seed=12, variant=variant)
    ks, vs, mask, (h, _, scale, _, softcap) = _clones(inputs.caches[0::2]), _clones(inputs.caches[1::2]), inputs.mask, inputs.heads
    got = OPS.decoder_layers(*inputs.layers(), ks, vs, mask, past, *inputs.heads, [], [])
    mine_k, mine_v = _clones(inputs.caches[0::2]), _clones(inputs.caches[1::2])
    rows = _op_by_op(inputs, lambda layer, hid, window: OPS.static_attention(
        hid, mine_k[layer], mine_v[layer], mask, past, h, scale, window, softcap))
    assert torch.equal(got, rows)
    assert all(torch.equal(a, c) for a, c in zip(ks + vs, mine_k + mine_v))  # the same slots written
    ref_k, ref_v = _clones(inputs.caches[0::2]), _clones(inputs.caches[1::2])
    want = REF.decoder_layers(*inputs.layers(), ref_k, ref_v, mask, past, *inputs.heads, [], [])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))

    def changed(**what) -> bool:  # the op's output with an operand replaced differs from got
        args = inputs._replace(**{k: v for k, v in what.items() if k != "heads"})
        out = OPS.decoder_layers(*args.layers(), _clones(inputs.caches[0::2]), _clones(inputs.caches[1::2]), mask,
                                 past, *what.get("heads", inputs.heads), [], [])
        return not torch.allclose(out, got, atol=1e-2)

    if variant != "llama":  # the extras count: without them the numbers change
        assert changed(extras=[])
        with pytest.raises(RuntimeError, match="extras must be empty or 8 per layer"):
            OPS.decoder_layers(*inputs._replace(extras=inputs.extras[:-1]).layers(), ks, vs, mask, past, *inputs.heads, [], [])
    if variant == "gemma":  # so do the second RoPE table, the window (past > 3), GeGLU and the softcap
        assert changed(layer_args=[1, 0, 1, 3]) and changed(layer_args=[1, 0, 2, 0]) == (past > 0)
        assert changed(heads=(*inputs.heads[:3], 0, softcap)) and changed(heads=(*inputs.heads[:4], 0.0))
        with pytest.raises(RuntimeError, match="names rope table 3 of 2"):
            OPS.decoder_layers(*inputs._replace(layer_args=[1, 0, 3, 0]).layers(), ks, vs, mask, past, *inputs.heads, [], [])
    with pytest.raises(RuntimeError, match="6 weights"):
        OPS.decoder_layers(*inputs._replace(weights=inputs.weights[:-1]).layers(), ks, vs, mask, past, *inputs.heads, [], [])


@needs_avx2
@pytest.mark.parametrize("variant,layer_args", [("llama", []), ("qwen", []), ("llama", [1, 0, 0, 0]),  # NoPE layer 1
                                                ("gemma", [1, 0, 2, 3])])
def test_paged_decoder_layers_is_the_layer_ops_in_order_and_matches_its_twin(variant, layer_args):
    inputs = _decoder_inputs(1, 6, 0, seed=13, variant=variant)._replace(layer_args=layer_args)
    h, h_kv, scale, _, softcap = inputs.heads
    g = torch.Generator().manual_seed(14)
    pools = [torch.randn(8, h_kv, 4, 16, generator=g).half() for _ in range(4)]  # k, v of two layers [8, Hkv, 4, D]
    tables, seq_lens, qsl = torch.tensor([[2, 5], [7, 1]]), torch.tensor([3, 6]), torch.tensor([0, 3, 6])
    slots = torch.tensor([8, 9, 10, 7 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1])  # seq 0: positions 0-2; seq 1: positions 3-5
    meta = (slots, tables, qsl, seq_lens)
    mine = _clones(pools)
    got = OPS.paged_decoder_layers(*inputs.layers(), mine[0::2], mine[1::2], *meta, *inputs.heads, [], [])
    steps = _clones(pools)
    rows = _op_by_op(inputs, lambda layer, hid, window: OPS.paged_attention_qkv(
        hid, steps[2 * layer], steps[2 * layer + 1], *meta, h, scale, window, softcap))
    assert torch.equal(got, rows) and all(torch.equal(a, b) for a, b in zip(mine, steps))
    ref = _clones(pools)
    want = REF.paged_decoder_layers(*inputs.layers(), ref[0::2], ref[1::2], *meta, *inputs.heads, [], [])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))
    if layer_args:  # the layer args count: with RoPE table 1 and no window everywhere the numbers change
        every = OPS.paged_decoder_layers(*inputs._replace(layer_args=[]).layers(), *[_clones(pools)[k::2] for k in (0, 1)],
                                         *meta, *inputs.heads, [], [])
        assert not torch.allclose(every, got, atol=1e-2)
        with pytest.raises(RuntimeError, match="layer_args must be empty or 2 per layer"):
            OPS.paged_decoder_layers(*inputs._replace(layer_args=[1]).layers(), mine[0::2], mine[1::2], *meta,
                                     *inputs.heads, [], [])


@needs_avx2
@pytest.mark.parametrize("paged", [False, True])
def test_one_op_decoders_on_int8_caches_pass_each_layers_scales(paged):
    """int8 caches (k_scales, v_scales: one tensor per layer): the one-op decoders give the bits of the layer ops in
    order over the same caches, write the same values and scales, and agree with their torch twins."""
    inputs = _decoder_inputs(2 if not paged else 1, 3 if not paged else 6, 5 if not paged else 0, seed=17)
    h, h_kv, scale, _, softcap = inputs.heads
    if paged:
        g = torch.Generator().manual_seed(18)
        floats = [torch.randn(8, h_kv, 4, 16, generator=g) for _ in range(4)]  # k, v of two layers [8, Hkv, 4, D]
        meta = (torch.tensor([8, 9, 10, 7 * 4 + 3, 4, 5]), torch.tensor([[2, 5], [7, 1]]), torch.tensor([0, 3, 6]),
                torch.tensor([3, 6]))  # as the paged test above
    else:
        floats = [c.float() for c in inputs.caches]
    caches = [R.quantize_kv_rows(c) for c in floats]  # (values, scales) of k0, v0, k1, v1

    def fresh() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [c[0].clone() for c in caches], [c[1].clone() for c in caches]

    (mine, mine_s), (steps, steps_s), (ref, ref_s) = fresh(), fresh(), fresh()
    if paged:
        got = OPS.paged_decoder_layers(*inputs.layers(), mine[0::2], mine[1::2], *meta, *inputs.heads, mine_s[0::2],
                                       mine_s[1::2])
        rows = _op_by_op(inputs, lambda layer, hid, window: OPS.paged_attention_qkv(
            hid, steps[2 * layer], steps[2 * layer + 1], *meta, h, scale, window, softcap, None, steps_s[2 * layer],
            steps_s[2 * layer + 1]))
        want = REF.paged_decoder_layers(*inputs.layers(), ref[0::2], ref[1::2], *meta, *inputs.heads, ref_s[0::2],
                                        ref_s[1::2])
    else:
        mask = inputs.mask
        got = OPS.decoder_layers(*inputs.layers(), mine[0::2], mine[1::2], mask, 5, *inputs.heads, mine_s[0::2],
                                 mine_s[1::2])
        rows = _op_by_op(inputs, lambda layer, hid, window: OPS.static_attention(
            hid, steps[2 * layer], steps[2 * layer + 1], mask, 5, h, scale, window, softcap, None, steps_s[2 * layer],
            steps_s[2 * layer + 1]))
        want = REF.decoder_layers(*inputs.layers(), ref[0::2], ref[1::2], mask, 5, *inputs.heads, ref_s[0::2],
                                  ref_s[1::2])
    assert torch.equal(got, rows)
    assert all(torch.equal(a, b) for a, b in zip(mine + mine_s, steps + steps_s))
    assert not all(torch.equal(a, c[0]) for a, c in zip(mine, caches))  # the layers wrote their rows
    for a, sa, c, sc in zip(mine, mine_s, ref, ref_s):  # the twin's rows: a rounding step apart at most
        step = float(torch.maximum(sa, sc).max())
        assert float((R.dequantize_kv_rows(a, sa) - R.dequantize_kv_rows(c, sc)).abs().max()) <= 2 * step
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))
    with pytest.raises(RuntimeError, match="one tensor per layer"):
        if paged:
            OPS.paged_decoder_layers(*inputs.layers(), mine[0::2], mine[1::2], *meta, *inputs.heads, mine_s[0::2], [])
        else:
            OPS.decoder_layers(*inputs.layers(), mine[0::2], mine[1::2], mask, 5, *inputs.heads, mine_s[:1],
                               mine_s[1:2])


@needs_avx2
@pytest.mark.parametrize("paged", [False, True])
def test_decoder_layers_in_a_thread_team_is_one_threads(paged):
    """A forward of at most 16 rows runs its layers in one thread team (team.h). With C 512 and I 1024 on 2 threads,
    gate_up's and down's row groups, 400 keys' attention chunks and (static: 6 rows) the activation rows' quantization
    go to the team's second thread; every output is still one thread's sum in one order, so 2 threads (and 3: a team
    of 3, or with more threads than CPUs one OpenMP region per op) give 1's bits. A bad operand raises out of the
    team."""
    inputs = _decoder_inputs(2 if paged else 6, 1, 400, seed=15, c=512, inter=1024)
    h_kv = inputs.heads[1]
    tables, qsl, seq_lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1, 2]), torch.tensor([401, 300])
    slots = torch.tensor([400, 2 * 256 + 299])  # each sequence's last position, in blocks of 256

    def forward(weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = _clones(inputs.caches)
        layers = inputs._replace(weights=weights).layers()
        if not paged:
            return OPS.decoder_layers(*layers, caches[0::2], caches[1::2], None, 400, *inputs.heads, [], []), caches
        pools = [torch.randn(4, h_kv, 256, 16, generator=torch.Generator().manual_seed(16 + i)).half() for i in range(4)]
        out = OPS.paged_decoder_layers(*layers, pools[0::2], pools[1::2], slots, tables, qsl, seq_lens, *inputs.heads, [], [])
        return out, pools

    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):  # 3: a team of 3, or (more threads than CPUs) one OpenMP region per op
            torch.set_num_threads(n)
            runs.append(forward(inputs.weights))
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="6 weights"):
            forward(inputs.weights[:-1])
        assert torch.equal(forward(inputs.weights)[0], runs[1][0])  # the team still works after the error
    finally:
        torch.set_num_threads(threads)
    (one, one_caches), *more = runs
    for out, caches in more:
        assert torch.equal(one, out) and all(torch.equal(a, b) for a, b in zip(one_caches, caches))
    assert one.abs().max() > 0


@pytest.mark.parametrize("vocab_size", [49_152, 1_003, 7])  # whole blocks of 256; a partial block and vector; one vector
def test_softmax_draw_matches_reference(vocab_size):
    """The C++ draw equals its twin (softmax, then ops.inverse_cdf_at) id for id, over temperatures, -inf runs
    (never drawn) and uniforms at the ends of [0, 1)."""
    g = torch.Generator().manual_seed(21)
    rows = 96
    logits = torch.randn(rows, vocab_size, generator=g) * 4
    logits[::3, : vocab_size // 2] = float("-inf")  # a filtered row: only the upper half may be drawn
    temperature = torch.rand(rows, generator=g, dtype=torch.float64) * 2 + 0.05
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1e-12, 1 - 1e-12, 0.5], dtype=torch.float64)
    got = OPS.softmax_draw(logits, temperature, u)
    assert got.dtype == torch.long and got.shape == (rows,)
    assert torch.equal(got, REF.softmax_draw(logits, temperature, u))
    assert bool((got[::3] >= vocab_size // 2).all())
    assert torch.equal(OPS.softmax_draw(logits[5:6], temperature[5:6], u[5:6]), got[5:6])  # a row alone


@needs_avx2
@pytest.mark.parametrize("vocab_size", [49_152, 1_003, 7])
def test_argmax_is_torch_argmax(vocab_size):
    """The C++ argmax equals torch.argmax id for id: ties go to the lowest id (rounded rows), the max in the tail
    lanes, all -inf rows, +inf, -0.0 before +0.0, and a NaN counts as the largest (its first index)."""
    g = torch.Generator().manual_seed(vocab_size)
    x = torch.randn(64, vocab_size, generator=g) * 3
    x[::4] = x[::4].round()  # ties at the max
    x[1, -1] = 100.0  # the max in the last (tail) lanes
    x[2] = float("-inf")
    x[3, vocab_size // 2] = float("inf")
    x[5, :] = -1.0
    x[5, min(2, vocab_size - 1)], x[5, min(3, vocab_size - 1)] = -0.0, 0.0
    x[6, vocab_size - 1] = float("nan")
    x[7, [0, vocab_size // 2]] = float("nan")
    got = OPS.argmax(x)
    assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, dim=-1)) and torch.equal(got, REF.argmax(x))
    assert torch.equal(OPS.argmax(x[1:2]), got[1:2])  # a row alone
    with pytest.raises(RuntimeError, match="x must be float32"):
        OPS.argmax(x.double())


def _filter_params(rows: int, g: torch.Generator, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """Per-row temperature, min_p, top_k, top_p, u [rows], each filter on in about half the rows, with edge values."""
    f64 = torch.float64
    some = lambda p: torch.rand(rows, generator=g) < p
    temperature = torch.rand(rows, generator=g, dtype=f64) * 2 + 0.05
    min_p = torch.where(some(0.4), torch.rand(rows, generator=g, dtype=f64) * 0.5, torch.zeros(rows, dtype=f64))
    top_k = torch.where(some(0.4), torch.randint(1, 3 * vocab_size, (rows,), generator=g), torch.zeros(rows, dtype=torch.long))
    top_p = torch.where(some(0.6), torch.rand(rows, generator=g, dtype=f64) * 0.99 + 0.01, torch.ones(rows, dtype=f64))
    u = torch.rand(rows, generator=g, dtype=f64)
    min_p[:2], top_k[2:4], top_p[4:6], u[6:9] = 1.0, 1, 1e-6, torch.tensor([0.0, 1e-12, 1 - 1e-12], dtype=f64)
    return temperature, min_p, top_k, top_p, u


@needs_avx2
@pytest.mark.parametrize("vocab_size", [49_152, 1_003, 7])
def test_filter_draw_matches_reference(vocab_size):
    """The C++ sampling stages + draw equal their twin (ops' temperature, min_p, top_k, top_p, then softmax_draw) id
    for id on every row they decide, over peaked and flat rows, ties (rounded logits), -inf runs and edge values;
    the rows left undecided (-1, for the torch ops) are a minority, and a row alone gets its id in the batch."""
    g = torch.Generator().manual_seed(vocab_size)
    rows = 240
    logits = torch.randn(rows, vocab_size, generator=g) * torch.rand(rows, 1, generator=g) * 6
    logits[::2, : min(40, vocab_size - 1)] += 10  # a real distribution's head
    logits[::7] = logits[::7].round()  # ties
    logits[::11, : vocab_size // 2] = float("-inf")
    params = _filter_params(rows, g, vocab_size)
    got, want = OPS.filter_draw(logits, *params), REF.filter_draw(logits, *params)
    decided = got >= 0
    assert torch.equal(got[decided], want[decided])
    assert int(decided.sum()) >= 0.7 * rows and int(decided[::2].sum()) >= 0.8 * (rows // 2)  # peaked rows: most
    assert not torch.equal(want, REF.softmax_draw(logits, params[0], params[4]))  # the filters changed draws
    i = int(decided.nonzero()[-1])
    assert torch.equal(OPS.filter_draw(logits[i:i + 1], *(p[i:i + 1] for p in params)), got[i:i + 1])


@needs_avx2
def test_filter_draw_leaves_undecidable_rows_and_refuses_bad_inputs():
    """A flat row whose top-p cut lies beyond the largest 1,024 logits, or a min_p line through a logit, returns -1;
    out-of-range parameters raise naming them."""
    f64 = torch.float64
    flat = torch.randn(1, 49_152, generator=torch.Generator().manual_seed(5))
    one, zero = torch.ones(1, dtype=f64), torch.zeros(1, dtype=f64)
    assert int(OPS.filter_draw(flat, one, zero, torch.zeros(1, dtype=torch.long), torch.tensor([0.9], dtype=f64), zero)) == -1
    on_line = torch.tensor([[0.0, -1.0, 5.0]])  # min_p = e^-5: logit 0.0 lies on m + log(min_p)
    min_p = torch.tensor([float(torch.tensor(-5.0).exp())], dtype=f64)
    assert int(OPS.filter_draw(on_line, one, min_p, torch.zeros(1, dtype=torch.long), one, zero)) == -1
    assert int(OPS.filter_draw(on_line, one, min_p * 0.5, torch.zeros(1, dtype=torch.long), one, zero)) >= 0
    with pytest.raises(RuntimeError, match="top_k >= 0 and top_p in \\(0, 1\\]"):
        OPS.filter_draw(on_line, one, zero, torch.zeros(1, dtype=torch.long), zero, zero)
    with pytest.raises(RuntimeError, match="must be \\[B=2\\]"):
        OPS.filter_draw(torch.zeros(2, 8), one, zero, torch.zeros(1, dtype=torch.long), one, zero)


@needs_avx2
def test_softmax_draw_frequencies_and_bad_inputs():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = OPS.softmax_draw(probs.log().expand(n, -1).contiguous(), torch.ones(n, dtype=torch.float64), u)
    freq = torch.bincount(ids, minlength=4).double() / n
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.01)
    assert freq[1] == 0  # a zero-probability id is never drawn
    with pytest.raises(RuntimeError, match="temperature > 0 and u in \\[0, 1\\)"):
        OPS.softmax_draw(torch.zeros(1, 8), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="temperature and u must be \\[B=2\\]"):
        OPS.softmax_draw(torch.zeros(2, 8), torch.ones(1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no finite logit"):
        OPS.softmax_draw(torch.full((1, 8), float("-inf")), torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("m,types", [(1, (Q.Q4_K, Q.Q5_K, Q.Q6_K)), (5, (Q.IQ4_XS, Q.IQ4_NL, Q.Q6_K)),
                                     (3, (Q.Q3_K, Q.Q2_K, Q.Q6_K)), (2, (Q.MXFP4, Q.Q8_0, Q.IQ4_NL))],
                         ids=["Q4_K_M", "IQ4_XS", "Q2_K_Q3_K", "MXFP4"])
def test_mixed_weight_is_its_segments_stacked(m, types):
    """A stacked matrix of parts of different types (as a Q4_K_M, IQ4_XS or Q3_K_M file's q, k, v) in one MIXED
    weight: qgemm equals the dequantized parts stacked then multiplied, on the kernels and their twins, with one
    activation quantization."""
    k = 256
    parts = [_gguf_matrix(qtype, n, k, seed=30 + n) for qtype, n in zip(types, (16, 8, 13))]
    weight_type, blob = K.pack_gguf_segments([(q.name, raw) for q, (raw, _) in zip(types, parts)])
    assert weight_type == K.MIXED and blob.dim() == 1
    dense = torch.cat([d for _, d in parts])  # [37, 256]
    torch.testing.assert_close(R.dequantize_packed(blob, K.MIXED)[:37], dense, rtol=0, atol=0)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = R.dequantize_q8a(R.quantize_q8a(x)) @ dense.T  # [M, 37]
    for ops in (OPS, REF):
        got = ops.qgemm(x, blob, weight_type, 37, None)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    if OPS.backend == "avx2":  # each segment's rows as their own single-type weight, bit for bit
        alone = []
        for q, n, (raw, _) in zip(types, (16, 8, 13), parts):
            single_type, packed = K.pack_gguf_rows(q.name, [raw])
            alone.append(OPS.qgemm(x, packed, single_type, n, None))
        assert torch.equal(OPS.qgemm(x, blob, weight_type, 37, None), torch.cat(alone, dim=1))
    with pytest.raises(ValueError, match="multiple of 8 rows, part 0 has 13"):
        K.pack_gguf_segments([("Q6_K", parts[2][0]), ("Q4_1", parts[0][0])])
    with pytest.raises((RuntimeError, ValueError), match="its header describes"):
        OPS.qgemm(x, blob[:-1], weight_type, 37, None)


def test_mxfp4_records_hold_every_exponent_float16_can():
    """MXFP4 blocks with random indices and exponents over the whole range float16 holds exactly (104 .. 143, both
    ends): repacked to the same bytes as the twin, values equal to gguf's dequantization, qgemm and the embedding
    lookup on them; an exponent beyond the range is refused by both (the loader re-encodes such files as Q8_0)."""
    from kvgen.weights.quantized import mxfp4_fits_float16

    gen = torch.Generator().manual_seed(23)
    raw = torch.randint(0, 256, (19, 4, 17), dtype=torch.uint8, generator=gen)  # 19 rows of 128 values
    raw[..., 0] = torch.randint(104, 144, (19, 4), dtype=torch.uint8, generator=gen)
    raw[0, :2, 0] = torch.tensor([104, 143], dtype=torch.uint8)
    raw = raw.view(19, 68)
    dense = torch.from_numpy(dequantize(raw.numpy(), Q.MXFP4))  # [19, 128]
    packed = OPS.repack_gguf([raw], 11)
    assert torch.equal(packed, REF.repack_gguf([raw], 11)) and mxfp4_fits_float16(raw)
    torch.testing.assert_close(R.dequantize_packed(packed, K.MXFP4)[:19], dense, rtol=0, atol=0)
    x = torch.randn(3, 128, generator=gen)
    want = R.dequantize_q8a(R.quantize_q8a(x)) @ dense.T  # [3, 19]
    for ops in (OPS, REF):
        torch.testing.assert_close(ops.qgemm(x, packed, K.MXFP4, 19, None), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))
        assert torch.equal(ops.dequantize_rows(packed, K.MXFP4, torch.tensor([18, 0]), 128), dense[[18, 0]])
    for e in (103, 144):
        bad = raw.clone()
        bad.view(19, 4, 17)[5, 2, 0] = e
        assert not mxfp4_fits_float16(bad)
        with pytest.raises(ValueError, match="outside float16"):
            REF.repack_gguf([bad], 11)
        if OPS.backend == "avx2":
            with pytest.raises(RuntimeError, match="outside float16"):
                OPS.repack_gguf([bad], 11)


def test_rms_norm_reads_a_strided_weight_as_its_values():
    """A weight that is a view with a stride (every other value of a longer vector) is read value by value, as
    torch's rms_norm reads it (the C++ op read the first C floats behind its data pointer instead)."""
    g = torch.Generator().manual_seed(40)
    x, longer = torch.randn(3, 64, generator=g), torch.randn(128, generator=g)
    weight = longer[::2]  # [64], stride 2
    want = torch.nn.functional.rms_norm(x, (64,), weight.contiguous(), 1e-5)
    for ops in (OPS, REF):
        torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), want)


@needs_avx2
def test_head_ops_refuse_negative_head_counts():
    """rms_norm_heads_ and rope_qkv_ with a negative head count whose (H + 2 Hkv) D still matches the row width (6 and
    -1 heads: 4 x 16 = 64) raise instead of walking H + Hkv = 5 heads of 16 over rows of 64 (heap corruption)."""
    qkv = torch.randn(3, 64)
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="num_heads and num_kv_heads must be >= 0, got 6 and -1"):
        OPS.rms_norm_heads_(qkv, torch.ones(16), torch.ones(16), 1e-6, 6, -1)
    with pytest.raises(RuntimeError, match="num_heads and num_kv_heads must be >= 0, got 6 and -1"):
        OPS.rope_qkv_(qkv, torch.randn(3, 16), torch.randn(3, 16), 6, -1)
    assert torch.equal(qkv, before)


@needs_avx2
def test_attention_ops_refuse_empty_kv_heads_blocks_or_batch():
    """Zero KV heads, a zero block size, an empty batch of caches or a negative num_heads raise a RuntimeError
    naming the shapes (they divided by zero or wrote outside the output: the process died)."""
    q, none = torch.randn(1, 2, 1, 8), torch.randn(1, 0, 1, 8)  # q [B, H, T, D]; k, v with no KV head
    with pytest.raises(RuntimeError, match="kvgen.attention: shapes"):
        OPS.attention(q, none, none, None, 0, 1.0)
    one_kv = torch.zeros(1, 1, 4, 8)  # caches [B, Hkv, S_max, D]
    for caches, heads in ((torch.zeros(0, 1, 4, 8), 2), (torch.zeros(1, 0, 4, 8), 2), (one_kv, -2)):
        qkv = torch.randn(caches.shape[0], max(0, (heads + 2 * caches.shape[1]) * 8))
        with pytest.raises(RuntimeError, match="need B >= 1 and Hkv >= 1, and num_heads >= 1"):
            OPS.static_attention(qkv, caches, caches.clone(), None, 0, heads, 1.0)
    table, qsl, lens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([1])
    for pool in (torch.zeros(1, 0, 4, 8), torch.zeros(1, 1, 0, 8)):  # pools [num_blocks, Hkv, block_size, D]
        with pytest.raises(RuntimeError, match="do not fit 2 heads of 8"):
            OPS.paged_attention(torch.randn(1, 2, 8), pool, pool, table, qsl, lens, 1.0)
    with pytest.raises(RuntimeError, match="do not fit -2 heads of 8"):
        OPS.paged_attention_qkv(torch.randn(1, 0), one_kv, one_kv.clone(), torch.tensor([0]), table, qsl, lens, -2, 1.0)


def test_mixed_weight_refuses_a_header_walking_outside_its_bytes():
    """A MIXED header whose byte total matches but whose first segment has -1 groups: the C++ op placed the second
    segment 272 bytes back and read before the data; now it raises naming the segment (the twin: torch's split)."""
    head = torch.tensor([2, 1, K.Q8, -1, K.Q4, 3, 0, 0], dtype=torch.int64)  # 2 segments of 1 block: Q8 x -1, Q4 x 3
    blob = torch.cat([head.view(torch.uint8), torch.zeros(3 * 160 - 272, dtype=torch.uint8)])
    with pytest.raises(RuntimeError, match="non-negative"):
        REF.qgemm(torch.randn(1, 32), blob, K.MIXED, 16, None)
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match="mixed weight segment 0 has -1 groups of 1 blocks"):
            OPS.qgemm(torch.randn(1, 32), blob, K.MIXED, 16, None)
