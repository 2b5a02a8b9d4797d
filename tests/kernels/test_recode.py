"""GGUF's lattice and ternary types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0) recoded as IQ4_XS records and
those with a scale per 16 values (IQ2_XS, IQ2_S, IQ1_M) as XS16 records (``kvgen.kernels.recode``): the C++ op against its numpy twin, the records against the gguf package's dequantization
of the file (llama.cpp's reference decoding), and qgemm on them against the plain-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import kvgen.kernels as K
from kvgen.kernels import recode
from kvgen.kernels import reference as R

OPS, REF = K.get_ops(), K.reference_ops()
TYPES = list(recode.RECODINGS)  # IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0, IQ2_XS, IQ2_S, IQ1_M


def random_rows(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """GGUF rows [n, k / 256 * block bytes] uint8 of ``qtype``: random bits (every grid index, sign and scale; TQ2_0's
    unused code 3 included), fp16 d of either sign within 1e-3 .. 1e-1 (IQ1_M: its 4 nibbles in the scales' tops)."""
    rc, rng = recode.RECODINGS[qtype], np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // 256, rc.block_bytes), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-1, (blocks.shape[0], 1)) * rng.choice([-1.0, 1.0], (blocks.shape[0], 1))
    d = d.astype(np.float16)
    if rc.d_offset is None:  # IQ1_M: nibble j of d's bits is the top nibble of the j-th uint16 scale (bytes 48-55)
        bits = d.view(np.uint16).astype(np.int64)  # [n, 1]
        blocks[:, 49:56:2] = (blocks[:, 49:56:2] & 0x0F) | (((bits >> (4 * np.arange(4))) & 15) << 4)
    else:
        blocks[:, rc.d_offset : rc.d_offset + 2] = d.view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


@pytest.mark.parametrize("qtype", TYPES)
def test_recoded_records_hold_the_file_values(qtype: str) -> None:
    """The C++ recoding equals its numpy twin byte for byte, and the IQ4_XS records read with the type's table give
    the gguf package's dequantization exactly (dequantize_packed, and both ops' embedding lookup)."""
    raw = random_rows(qtype, 21, 512, seed=0)  # 21 rows: a partial last group
    ggml_type = Q[qtype].value
    ours = OPS.recode_gguf(raw, ggml_type, recode.grid_codes(qtype))
    rows = recode.XS16_BYTES if recode.RECODINGS[qtype].halves else recode.IQ4_XS_BYTES
    assert ours.shape == (21, 2 * rows) and torch.equal(ours, REF.recode_gguf(raw, ggml_type, recode.grid_codes(qtype)))
    dense = torch.from_numpy(dequantize(raw.numpy(), Q[qtype]))  # [21, 512]
    weight_type, packed = K.pack_gguf_rows(qtype, [raw[:5], raw[5:]])  # stacked like q, k / v
    assert weight_type == R.RECODED_TYPES[qtype] and packed.shape == (3, 2, R.RECORD_BYTES[weight_type])
    assert torch.equal(R.dequantize_packed(packed, weight_type)[:21], dense)
    ids = torch.tensor([0, 20, 7, 7, 13])
    for ops in (OPS, REF):
        assert torch.equal(ops.dequantize_rows(packed, weight_type, ids, 512), dense[ids])


@pytest.mark.parametrize("qtype", TYPES)
def test_qgemm_on_recoded_records(qtype: str) -> None:
    """qgemm (1-4-row tiles, 8-row tiles and pairs of groups) against the reference, the reference against the
    product with the file's dequantized values, and each row's bits the same alone as in the batch."""
    raw = random_rows(qtype, 45, 768, seed=1)
    weight_type, packed = K.pack_gguf_rows(qtype, [raw])
    dense = torch.from_numpy(dequantize(raw.numpy(), Q[qtype]))  # [45, 768]
    x = torch.randn(17, 768, generator=torch.Generator().manual_seed(2))
    want = R.dequantize_q8a(R.quantize_q8a(x)) @ dense.T  # [17, 45]
    scale = float(want.abs().max())
    for m in (1, 3, 8, 17):
        for ops in (OPS, REF):
            torch.testing.assert_close(ops.qgemm(x[:m], packed, weight_type, 45, None), want[:m], rtol=1e-5,
                                       atol=1e-5 * scale)
    together = OPS.qgemm(x, packed, weight_type, 45, None)
    assert torch.equal(together, torch.cat([OPS.qgemm(x[i : i + 1], packed, weight_type, 45, None) for i in range(17)]))


def test_a_mixed_weight_holds_recoded_parts() -> None:
    """Stacked q (IQ3_S), k (IQ2_S: XS16 records) and v (Q8_0) rows as one MIXED weight: the reference's product, and the rows the
    parts give packed alone."""
    q, k = random_rows("IQ3_S", 16, 256, seed=3), random_rows("IQ2_S", 8, 256, seed=4)
    v = torch.from_numpy(quantize(np.random.default_rng(5).standard_normal((5, 256)).astype(np.float32), Q.Q8_0))
    weight_type, packed = K.pack_gguf_segments([("IQ3_S", q), ("IQ2_S", k), ("Q8_0", v)])
    assert weight_type == K.MIXED
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6))
    got = OPS.qgemm(x, packed, weight_type, 29, None)  # [9, 29]
    torch.testing.assert_close(got, REF.qgemm(x, packed, weight_type, 29, None), rtol=1e-5, atol=1e-5)
    alone = []
    for qtype, rows in (("IQ3_S", q), ("IQ2_S", k), ("Q8_0", v)):
        part_type, part = K.pack_gguf_rows(qtype, [rows])
        alone.append(OPS.qgemm(x, part, part_type, rows.shape[0], None))  # [9, n_i]
    assert torch.equal(got, torch.cat(alone, dim=1))


def test_bad_input_is_refused() -> None:
    raw = random_rows("IQ3_S", 8, 256, seed=7)
    with pytest.raises(ValueError, match="recoded types are"):
        recode.recode_rows("IQ4_NL", raw)
    with pytest.raises(ValueError, match=r"IQ3_S rows must be uint8 \[N, nsb \* 110\]"):
        recode.recode_rows("IQ3_S", raw[:, :100])
    with pytest.raises(ValueError, match="kernels run .*IQ3_S"):
        K.pack_gguf_rows("NVFP4", [raw])
    if OPS.backend == "avx2":
        with pytest.raises(RuntimeError, match="ggml_type must be"):
            OPS.recode_gguf(raw, Q.IQ4_NL.value, recode.grid_codes("IQ3_S"))
        with pytest.raises(RuntimeError, match="grid must be"):
            OPS.recode_gguf(raw, Q.IQ3_S.value, recode.grid_codes("IQ3_XXS"))
