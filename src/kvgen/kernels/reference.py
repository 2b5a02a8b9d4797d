"""Plain-torch twins of the C++ kernels: the spec they are tested against, and the
portable path used where the extension cannot be built or the CPU lacks AVX2/FMA/F16C.

Layouts (see ``csrc/common.h``): weights are repacked at load from GGUF blocks into
8-row groups, one record per (group, 32-column block):

* Q4 record, 160 bytes (from ``block_q4_1``): fp16 ``d[8]``, fp16
  ``m[8]``, then ``qs[t][r][i]`` = byte ``4t+i`` of row ``r``'s GGUF block (low nibble:
  column ``4t+i``, high nibble: column ``16+4t+i``); value = q * d + m.
* Q4_0 record, 144 bytes (from ``block_q4_0``): the Q4 record without ``m`` (``qs`` at byte 16); value = q * d + m
  with m = -8 d computed (the file's 4.5 bits a weight, not the Q4 record's 5).
* Q8 record, 272 bytes (from ``block_q8_0``): fp16 ``d[8]``, then uint8 ``u[j][r][i]`` = q + 128 (``q ^ 0x80``) of
  row ``r``, column ``4j+i``; value = (u - 128) * d.
* Q5 record, 192 bytes (from ``block_q5_1``): the Q4 record, then
  ``qh[r][i]``: bit t = the fifth bit of column ``4t+i``, bit 4+t = that of column ``16+4t+i``.
* Q5_0 record, 176 bytes (from ``block_q5_0``): the Q5 record without ``m`` (``qs`` at byte 16, ``qh`` at 144); value
  = u * d + m with m = -16 d computed (the file's 5.5 bits a weight, not the Q5 record's 6).
* Q6 record, 1680 bytes per 8 rows x 256 columns (one ``block_q6_K`` super-block per row): fp16 ``d[8]``, then per
  32-column block k at ``208 k`` (offsets from there): int8 ``sc[2][8]`` at 16 (per 16 columns), the 6-bit
  ``u = q + 32`` as low nibbles ``lo[t][r][i]`` at 32 (columns ``4t+i`` and ``16+4t+i``, as Q4) and top bits
  ``hi[v][r][i]`` at 160 (columns ``8v+i``, ``16+8v+i``, ``8v+4+i``, ``16+8v+4+i`` at bits 0, 2, 4, 6); value =
  d * sc * (u - 32).
* Q2 / Q3 records, 672 / 912 bytes per 8 rows x 256 columns (one ``block_q2_K`` / ``block_q3_K`` super-block per
  row; ``csrc/common.h``): fp16 ``d[8]`` (Q2: and ``dmin[8]``), the scales per 16 columns ``[16][8]`` (Q2: the
  file's ``sc | m << 4`` bytes; Q3: int8 ``s - 32``), 2-bit planes (per block k and half h: bits 2s of byte
  ``4r+i`` = column ``32k + 16h + 4s + i``) and, for Q3, third bits (bit ``4h + s`` of byte ``4r+i`` per block);
  value = d sc u - dmin m (Q2), d sc (u - 4) (Q3).
* Q4_K record, 1152 bytes per 8 rows x 256 columns (one ``block_q4_K`` super-block per row): fp16 ``d[8]``, fp16
  ``dmin[8]``, block k's 6-bit scale ``sc[k][r]`` and min ``m[k][r]`` as ``low[k][r]`` at 32 (their low 4 bits:
  ``sc & 15 | (m & 15) << 4``) and ``top[k % 4][r]`` at 96 (their top 2 bits: those of ``sc`` at bits
  ``2 (k // 4)``, those of ``m`` at ``4 + 2 (k // 4)``), then per block k the Q4 record's ``qs``; value =
  d sc q - dmin m (the file's 4.5 bits a weight).
* Q5_K record, 1408 bytes per 8 rows x 256 columns (from ``block_q5_K``): the Q4_K record's first 128 bytes, then per
  block k the Q5 record's ``qs`` and ``qh``; value = d sc u - dmin m.
* IQ4 record, 144 bytes (from ``block_iq4_nl``): fp16 ``d[8]``, then ``qs`` as the Q4 record's; value =
  d * IQ4_VALUES[nibble].
* IQ4_XS record, 1088 bytes per 8 rows x 256 columns (from ``block_iq4_xs``): fp16 ``d[8]``, block k's 6-bit scale
  ``ls[k][r]`` as ``low[k % 4][r]`` at 16 (low 4 bits, at bits ``4 (k // 4)``) and ``top[k % 2][r]`` at 48 (top 2
  bits, at bits ``2 (k // 2)``), then per block k the IQ4 record's ``qs``; value = d * (ls - 32) *
  IQ4_VALUES[nibble] (the file's 4.25 bits a weight).
* MXFP4 record, 144 bytes (from ``block_mxfp4``: an E8M0 exponent e, 16 bytes of FP4 indices): the IQ4 record with
  d = 2^(e - 128) (exact in fp16 for e in 104 .. 143) and value = d * MXFP4_VALUES[nibble].
* IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S and TQ (TQ1_0, TQ2_0) records: IQ4_XS records of the file's blocks recoded by
  ``recode.py`` (``recode_gguf``), read with their own table (``XS_TABLES``) in place of IQ4_VALUES.
* XS16 record (IQ2_XS for IQ2_XS and IQ2_S, IQ1_M), 1168 bytes per 8 rows x 256 columns (from ``recode.py``'s XS16
  rows): fp16 ``d[8]``, int8 ``sc[k][h][r]`` at 16 (block k's columns 16 h .. 16 h + 15), then per block k the IQ4
  record's ``qs`` at 144; value = d * sc * table[nibble] (``XS16_TABLES``).

Activations are quantized per 32 values (llama.cpp's ``block_q8_1`` with fp32 fields):
40-byte blocks ``{float d; float s; int8 qs[32]}``, d = max|x| / 127,
qs = round_half_even(x * (127 / max|x|)), s = d * sum(qs).
Source: llama.cpp ``ggml/src/ggml-cpu/arch/x86/quants.c`` (``quantize_row_q8_1``,
``ggml_vec_dot_q4_1_q8_1``, ``ggml_vec_dot_q8_0_q8_0``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.kernels import recode
from kvgen.sampling import ops
from kvgen.sampling.ops import inverse_cdf_at

BLOCK = 32  # values per quantization block
ROWS = 8  # rows per interleaved group
# weight_type codes of the ops
Q4, Q8, F16, BF16, Q6, MIXED, Q5, IQ4, Q2, Q3, MXFP4, Q4_0, Q4_K, Q5_K, IQ4_XS, Q5_0 = range(16)
IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ = range(16, 21)  # IQ4_XS records of recoded blocks (recode.py), own tables
IQ2_XS, IQ1_M = 21, 22  # XS16 records of recoded blocks (a scale per 16 values)
MIXED_HEADER = 64  # bytes of int64 {S, nb, (weight_type, groups) x S} before a mixed weight's segments
RECORD_BYTES = {Q4: 160, Q8: 272, Q6: 1680, F16: 512, BF16: 512, Q5: 192, IQ4: 144, Q2: 672, Q3: 912, MXFP4: 144,
                Q4_0: 144, Q4_K: 1152, Q5_K: 1408, IQ4_XS: 1088, Q5_0: 176, IQ3_XXS: 1088, IQ3_S: 1088,
                IQ2_XXS: 1088, IQ1_S: 1088, TQ: 1088, IQ2_XS: 1168, IQ1_M: 1168}
# 32-column blocks per record: one 256-column super-block (1 for the other types)
RECORD_BLOCKS = {Q2: 8, Q3: 8, Q4_K: 8, Q5_K: 8, Q6: 8, IQ4_XS: 8, IQ3_XXS: 8, IQ3_S: 8, IQ2_XXS: 8, IQ1_S: 8, TQ: 8,
                 IQ2_XS: 8, IQ1_M: 8}
# bit 4h + t of a Q5 / Q5_K record's qh byte (r, i): the fifth bit of column 16h + 4t + i, as [h, t, 1]
_QH_SHIFTS = 4 * torch.arange(2).view(2, 1, 1) + torch.arange(4).view(1, 4, 1)
# The values of IQ4_NL / IQ4_XS's 4-bit indices (ggml-common.h kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The values of an MXFP4 index: FP4 E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) doubled (ggml-common.h
# kvalues_mxfp4), with the block scale halved to match: 2^(e - 128)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# GGUF types recoded as IQ4_XS records -> their weight_type, and each IQ4_XS-record type's 16 values
RECODED_TYPES = {"IQ3_XXS": IQ3_XXS, "IQ3_S": IQ3_S, "IQ2_XXS": IQ2_XXS, "IQ1_S": IQ1_S, "TQ1_0": TQ, "TQ2_0": TQ,
                 "IQ2_XS": IQ2_XS, "IQ2_S": IQ2_XS, "IQ1_M": IQ1_M}
_TABLES = {t: recode.RECODINGS[name].table for name, t in RECODED_TYPES.items()}
XS_TABLES = {IQ4_XS: IQ4_VALUES, **{t: v for t, v in _TABLES.items() if RECORD_BYTES[t] == 1088}}
XS16_TABLES = {t: v for t, v in _TABLES.items() if RECORD_BYTES[t] == 1168}
MXFP4_EXPONENTS = (104, 143)  # the E8M0 exponents whose scale 2^(e - 128) float16 holds exactly
# GGUF block sizes in bytes: (scale bytes, has min, quant bytes)
_Q4_0_BYTES, _Q4_1_BYTES, _Q8_0_BYTES = 18, 20, 34


def _pad_rows(raw: torch.Tensor) -> torch.Tensor:
    """raw [N, ...] -> [ceil(N / 8) * 8, ...], zero rows appended (a zero scale reads as 0)."""
    pad = -raw.shape[0] % ROWS
    return raw if pad == 0 else torch.cat([raw, raw.new_zeros(pad, *raw.shape[1:])])


def repack_q4(raw: torch.Tensor, has_min: bool, zero_point: float = 8.0) -> torch.Tensor:
    """GGUF Q4_1 (``has_min``) or Q4_0 rows -> Q4 records ``[G, nb, 160]`` uint8.

    raw: [N, nb * 20] (Q4_1) or [N, nb * 18] (Q4_0) uint8, one matrix row per row; without a min, value =
    (q - zero_point) d, stored as m = -zero_point d (16 for Q5_0's blocks, :func:`repack_q5`).
    Raises ValueError on a byte count that is not whole blocks.
    """
    size = _Q4_1_BYTES if has_min else _Q4_0_BYTES
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"Q4 rows must be uint8 [N, nb * {size}], got {raw.dtype} {list(raw.shape)}")
    blocks = _pad_rows(raw).view(-1, ROWS, raw.shape[1] // size, size)  # [G, 8, nb, size]
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [G, 8, nb]
    if has_min:
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]  # [G, 8, nb]
    else:
        m = d * -zero_point  # exact in fp16: a power-of-two multiple
        m.view(-1, m.shape[-1])[raw.shape[0] :] = 0  # padding rows stay all-zero bytes
    qs = blocks[..., size - 16 :]  # [G, 8, nb, 16]
    g, _, nb, _ = qs.shape
    qs = qs.reshape(g, ROWS, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 128)  # [G, nb, t*r*i]
    d = d.transpose(1, 2).contiguous().view(torch.uint8)  # [G, nb, 16]
    m = m.transpose(1, 2).contiguous().view(torch.uint8)  # [G, nb, 16]
    return torch.cat([d, m, qs], dim=-1).contiguous()  # [G, nb, 160]


# gguf_type codes 0-14 of repack_gguf
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "MXFP4", "Q4_K",
              "Q5_K", "IQ4_XS")
XS16_ROWS = 15  # repack_gguf's code of recode.py's XS16 rows (146 bytes per 256 values)
# bytes per GGUF block of each (32 values; the K types: 256)
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F16": 64, "BF16": 64, "Q6_K": 210, "Q5_0": 22, "Q5_1": 24,
                    "IQ4_NL": 18, "Q2_K": 84, "Q3_K": 110, "MXFP4": 17, "Q4_K": 144, "Q5_K": 176,
                    "IQ4_XS": 136}
# the weight_type each GGUF type's records are
WEIGHT_TYPE_OF = {"Q4_0": Q4_0, "Q4_1": Q4, "Q8_0": Q8, "F16": F16, "BF16": BF16, "Q6_K": Q6, "Q5_0": Q5_0, "Q5_1": Q5,
                  "IQ4_NL": IQ4, "Q2_K": Q2, "Q3_K": Q3, "MXFP4": MXFP4, "Q4_K": Q4_K, "Q5_K": Q5_K,
                  "IQ4_XS": IQ4_XS}


def repack_gguf(parts: list[torch.Tensor], gguf_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row blocks ``parts`` ([rows_i, bytes] uint8, one GGUF type) of one matrix -> its records
    [G, nb, R] uint8: Q4_0 records for Q4_0 (0), Q4 records for Q4_1 (1), Q8 records for Q8_0 (2), 16-bit records for F16 (3) and
    BF16 (4), Q6 records for Q6_K (5), Q5_0 / Q5 records for Q5_0 (6) / Q5_1 (7), IQ4 records for IQ4_NL (8), Q2 / Q3
    records for Q2_K (9) / Q3_K (10), MXFP4 records for MXFP4 (11), Q4_K / Q5_K records for Q4_K (12) / Q5_K
    (13), IQ4_XS records for IQ4_XS (14), XS16 records for XS16 rows (15, ``recode.py``), written into ``out`` where
    given (uint8 [G, nb, R], contiguous). Raises
    ValueError for an MXFP4 exponent outside ``MXFP4_EXPONENTS`` or an ``out`` of another shape."""
    records = _repack_gguf(torch.cat(parts) if len(parts) > 1 else parts[0], gguf_type)  # [G, nb, R]
    if out is None:
        return records
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.shape != records.shape:
        raise ValueError(f"out must be a contiguous uint8 {list(records.shape)} tensor, got {out.dtype} {list(out.shape)}")
    return out.copy_(records)


def _repack_gguf(raw: torch.Tensor, gguf_type: int) -> torch.Tensor:
    """``repack_gguf`` of the rows ``raw`` [N, bytes] uint8 (the parts stacked) into a new tensor."""
    if gguf_type == XS16_ROWS:
        return repack_xs16(raw)
    if gguf_type == 14:
        return repack_iq4_xs(raw)
    if gguf_type in (12, 13):
        return repack_k_quant(raw, five=gguf_type == 13)
    if gguf_type == 11:
        raw = mxfp4_as_iq4_nl(raw)  # [N, nb * 18]: d = 2^(e - 128) as float16, the indices as they are
        gguf_type = 8
    if gguf_type in (9, 10):
        return repack_q23_k(raw, q3=gguf_type == 10)
    if gguf_type in (0, 8):
        q4 = repack_q4(raw, has_min=False)  # [G, nb, 160]: IQ4_NL's blocks have Q4_0's layout
        return torch.cat([q4[..., :16], q4[..., 32:]], dim=-1).contiguous()  # [G, nb, 144]: without the mins
    if gguf_type == 2:
        return repack_q8(raw)
    if gguf_type == 5:
        return repack_q6_k(raw)
    if gguf_type == 6:  # the Q5 record without the mins
        q5 = repack_q5(raw, has_min=False)  # [G, nb, 192]
        return torch.cat([q5[..., :16], q5[..., 32:]], dim=-1).contiguous()  # [G, nb, 176]
    if gguf_type == 7:
        return repack_q5(raw, has_min=True)
    if gguf_type in (3, 4):
        return repack_16bit(raw)
    return repack_q4(raw, has_min=gguf_type == 1)


def recode_gguf(raw: torch.Tensor, ggml_type: int, grid: torch.Tensor) -> torch.Tensor:
    """GGUF rows [N, nsb * block bytes] uint8 of ggml type ``ggml_type`` (IQ2_XXS 16, IQ2_XS 17, IQ3_XXS 18, IQ1_S 19,
    IQ3_S 21, IQ2_S 22, IQ1_M 29, TQ1_0 34, TQ2_0 35) -> IQ4_XS rows [N, nsb * 136] (XS16 rows [N, nsb * 146]: IQ2_XS,
    IQ2_S, IQ1_M) read with the type's table (``recode.recode_rows``; ``grid``, the C++ op's level codes, unused).
    Raises ValueError for another type or shape."""
    from gguf import GGMLQuantizationType

    try:
        name = GGMLQuantizationType(ggml_type).name
    except ValueError:
        raise ValueError(f"ggml_type {ggml_type} is not a GGML type") from None
    return recode.recode_rows(name, raw)


def mxfp4_as_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    """GGUF MXFP4 rows [N, nb * 17] uint8 (E8M0 exponent e, 16 index bytes) -> rows of IQ4_NL's block layout
    [N, nb * 18] (fp16 d = 2^(e - 128), the same index bytes), read with ``MXFP4_VALUES``. Raises ValueError for an
    exponent outside ``MXFP4_EXPONENTS`` (a scale float16 does not hold). Source: ggml ``dequantize_row_mxfp4``."""
    blocks = raw.reshape(raw.shape[0], -1, 17)  # [N, nb, 17]
    e = blocks[..., 0].long()  # [N, nb]
    if e.numel() and not MXFP4_EXPONENTS[0] <= int(e.min()) <= int(e.max()) <= MXFP4_EXPONENTS[1]:
        raise ValueError(f"MXFP4 exponents {int(e.min())} .. {int(e.max())} give scales outside float16 "
                         f"({MXFP4_EXPONENTS[0]} .. {MXFP4_EXPONENTS[1]})")
    d = torch.ldexp(torch.ones(e.shape), (e - 128).float()).half().view(torch.uint8).view(*e.shape, 2)  # [N, nb, 2]
    return torch.cat([d, blocks[..., 1:]], dim=-1).reshape(raw.shape[0], -1)  # [N, nb * 18]


def _q3_k_fields(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q3_K rows [N, nsb * 110] uint8 -> (u = q + 4 hm [N, nsb, 256] int64 in [0, 7], scales s_j - 32
    [N, nsb, 16] int64, d bytes [N, nsb, 2]); value = d (s_j - 32) (u - 4). Source: the gguf package's
    ``Q3_K.dequantize_blocks``."""
    n, nsb = raw.shape[0], raw.shape[1] // 110
    b = raw.reshape(n * nsb, 110).long()
    low = (b[:, 96:104].view(-1, 1, 8) >> torch.tensor([0, 4]).view(1, 2, 1)).reshape(-1, 16) & 15
    high = (b[:, 104:108].view(-1, 1, 4) >> torch.tensor([0, 2, 4, 6]).view(1, 4, 1)).reshape(-1, 16) & 3
    sc = (low | (high << 4)) - 32  # [n nsb, 16]: one per 16 values
    q = (b[:, 32:96].view(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)) & 3  # [., half, j, l]
    hm = (b[:, :32].view(-1, 1, 32) >> torch.arange(8).view(1, 8, 1)) & 1  # [., 4 half + j, l]
    u = q + 4 * hm.view(-1, 2, 4, 32)  # [., half, j, l]: value 128 half + 32 j + l
    return u.reshape(n, nsb, 256), sc.view(n, nsb, 16), raw.view(n, nsb, 110)[..., 108:110]


def repack_q23_k(raw: torch.Tensor, q3: bool) -> torch.Tensor:
    """GGUF Q2_K (Q3_K) rows [N, nsb * 84 (110)] uint8 -> Q2 (Q3) records [G, nsb, 672 (912)] uint8 (module doc)."""
    size = 110 if q3 else 84
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"Q{3 if q3 else 2}_K rows must be uint8 [N, nsb * {size}], got {raw.dtype} {list(raw.shape)}")
    n, nsb = raw.shape[0], raw.shape[1] // size
    if q3:
        u, sc, d = _q3_k_fields(raw)
        head = [d, sc.to(torch.int8).view(torch.uint8)]  # [N, nsb, 2], [N, nsb, 16]
    else:
        blocks = raw.view(n, nsb, 84)
        qs = blocks[..., 16:80].long().view(n, nsb, 2, 1, 32)  # [N, nsb, half, 1, l]
        u = ((qs >> (2 * torch.arange(4).view(1, 1, 1, 4, 1))) & 3).reshape(n, nsb, 256)  # 128 half + 32 j + l
        head = [blocks[..., 80:82], blocks[..., 82:84], blocks[..., :16]]  # d, dmin, scales
    g = -(-n // ROWS)
    fields = [_pad_rows(f.reshape(n, -1)).view(g, ROWS, nsb, -1) for f in head]  # [G, r, nsb, bytes]
    fields = [f.permute(0, 2, 3, 1).reshape(g, nsb, -1) if f.shape[-1] == 16 else f.transpose(1, 2).reshape(g, nsb, -1)
              for f in fields]  # scales as [g][r]; d, dmin as [r] fp16
    uu = _pad_rows(u.reshape(n, -1)).view(g, ROWS, nsb, 8, 2, 4, 4)  # [G, r, nsb, k, h, s, i]
    shifts = torch.arange(4).view(1, 1, 1, 1, 1, 4, 1)
    planes = ((uu & 3) << (2 * shifts)).sum(dim=5)  # [G, r, nsb, k, h, i]
    planes = planes.permute(0, 2, 3, 4, 1, 5).reshape(g, nsb, 512)  # [G, nsb, k h r i]
    parts = [*fields, planes]
    if q3:
        bits = (uu >> 2) << (4 * torch.arange(2).view(1, 1, 1, 1, 2, 1, 1) + shifts)  # bit 4h + s
        parts.append(bits.sum(dim=(4, 5)).permute(0, 2, 3, 1, 4).reshape(g, nsb, 256))  # [G, nsb, k r i]
    return torch.cat([p.to(torch.uint8) for p in parts], dim=-1).contiguous()  # [G, nsb, 672 | 912]


def repack_k_quant(raw: torch.Tensor, five: bool) -> torch.Tensor:
    """GGUF Q4_K (Q5_K) rows [N, nsb * 144 (176)] uint8 -> Q4_K (Q5_K) records [G, nsb, 1152 (1408)] uint8 (module
    doc). Source: ggml ``dequantize_row_q4_K`` / ``dequantize_row_q5_K``, the gguf package's ``Q4_K.get_scale_min``."""
    import numpy as np
    from gguf.quants import Q4_K as GGUF_Q4_K

    size, at = (176, 48) if five else (144, 16)  # bytes per super-block, offset of the nibbles
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"Q{5 if five else 4}_K rows must be uint8 [N, nsb * {size}], got {raw.dtype} {list(raw.shape)}")
    nsb = raw.shape[1] // size
    blocks = _pad_rows(raw).view(-1, ROWS, nsb, size)  # [G, r, nsb, size]
    g = blocks.shape[0]
    sc, mn = (torch.from_numpy(x.astype(np.uint8)).view(g, ROWS, nsb, 8)  # [G, r, nsb, k]
              for x in GGUF_Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).numpy().copy()))
    sc, mn = (f.permute(0, 2, 3, 1) for f in (sc, mn))  # [G, nsb, k, r]
    low = ((sc & 15) | ((mn & 15) << 4)).reshape(g, nsb, 64)  # [G, nsb, k r]
    top = ((sc[:, :, :4] >> 4) | ((sc[:, :, 4:] >> 4) << 2) | ((mn[:, :, :4] >> 4) << 4)
           | ((mn[:, :, 4:] >> 4) << 6)).reshape(g, nsb, 32)  # [G, nsb, k % 4 r]
    scales = [low, top]
    head = [blocks[..., a:a + 2].transpose(1, 2).reshape(g, nsb, 16) for a in (0, 2)]  # d, dmin: [G, nsb, r 2]
    qs = blocks[..., at:].reshape(g, ROWS, nsb, 4, 1, 32)  # [G, r, nsb, pair, 1, byte]
    nib = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 1, 2, 1)) & 15  # [G, r, nsb, pair, k % 2, l]
    nib = nib.reshape(g, ROWS, nsb, 8, 2, 4, 4)  # [G, r, nsb, k, column 16 h + 4 t + i]
    packed = (nib[:, :, :, :, 0] | (nib[:, :, :, :, 1] << 4)).permute(0, 2, 3, 4, 1, 5)  # [G, nsb, k, t, r, i]
    per_block = [packed.reshape(g, nsb, 8, 128)]
    if five:  # qh[r][i] of block k: bit t = bit k of qh[4t + i], bit 4 + t = bit k of qh[16 + 4t + i]
        qh = blocks[..., 16:48].reshape(g, ROWS, nsb, 1, 2, 4, 4)  # [G, r, nsb, 1, h, t, i]
        bits = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 1, 1, 8, 1, 1, 1)) & 1  # [G, r, nsb, k, h, t, i]
        high = (bits.long() << _QH_SHIFTS).sum(dim=(4, 5))  # [G, r, nsb, k, i]
        per_block.append(high.permute(0, 2, 3, 1, 4).reshape(g, nsb, 8, 32).to(torch.uint8))  # [G, nsb, k, r i]
    blocks_out = torch.cat(per_block, dim=-1).reshape(g, nsb, -1)  # [G, nsb, 8 x (128 | 160)]
    return torch.cat([*head, *scales, blocks_out], dim=-1).contiguous()  # [G, nsb, 1152 | 1408]


def _dequantize_k_quant(weight: torch.Tensor, five: bool) -> torch.Tensor:
    """Q4_K (Q5_K) records [G, nsb, 1152 (1408)] -> float32 [G * 8, nsb * 256]: (d sc) u - (dmin m), as ggml
    ``dequantize_row_q4_K`` (``_q5_K``)."""
    g, nsb, _ = weight.shape
    d, dmin = (weight[..., a:a + 16].contiguous().view(torch.float16).float().view(g, nsb, 1, ROWS, 1, 1)
               for a in (0, 16))  # [G, nsb, 1, r, 1, 1]
    low = weight[..., 32:96].reshape(g, nsb, 8, ROWS)  # [G, nsb, k, r]
    top = weight[..., 96:128].reshape(g, nsb, 1, 4, ROWS)  # [G, nsb, 1, k % 4, r]
    top = torch.cat([top, top >> 2], dim=2).reshape(g, nsb, 8, ROWS)  # [G, nsb, k, r]: sc's top bits at 0, m's at 4
    sc, mn = (((low >> s) & 15) | (((top >> s) & 3) << 4) for s in (0, 4))  # [G, nsb, k, r]
    sc, mn = (f.float().view(g, nsb, 8, ROWS, 1, 1) for f in (sc, mn))  # [G, nsb, k, r, 1, 1]
    blk = weight[..., 128:].reshape(g, nsb, 8, 160 if five else 128)  # [G, nsb, k, bytes]
    qs = blk[..., :128].reshape(g, nsb, 8, 4, ROWS, 4).permute(0, 1, 2, 4, 3, 5)  # [G, nsb, k, r, t, i]
    u = torch.stack([qs & 15, qs >> 4], dim=4).long()  # [G, nsb, k, r, h, t, i]: column 16 h + 4 t + i
    if five:
        qh = blk[..., 128:].reshape(g, nsb, 8, ROWS, 1, 1, 4).long()  # [G, nsb, k, r, 1, 1, i]
        u = u | (((qh >> _QH_SHIFTS) & 1) << 4)
    w = (d * sc).unsqueeze(-1) * u.float() - (dmin * mn).unsqueeze(-1)  # [G, nsb, k, r, h, t, i]
    return w.permute(0, 3, 1, 2, 4, 5, 6).reshape(g * ROWS, nsb * 256)  # [N_pad, K]


def _dequantize_q23(weight: torch.Tensor, q3: bool) -> torch.Tensor:
    """Q2 / Q3 records [G, nsb, R] -> float32 [G * 8, nsb * 256], as ggml dequantize_row_q2_K / _q3_K."""
    g, nsb, _ = weight.shape
    d = weight[..., 0:16].contiguous().view(torch.float16).float().view(g, nsb, 1, 1, 1, ROWS, 1)  # [G, nsb, ., r, .]
    at = 144 if q3 else 160
    planes = weight[..., at : at + 512].long().view(g, nsb, 8, 2, 1, ROWS, 4)  # [G, nsb, k, h, 1, r, i]
    s = torch.arange(4).view(1, 1, 1, 1, 4, 1, 1)
    u = (planes >> (2 * s)) & 3  # [G, nsb, k, h, s, r, i]
    if q3:
        high = weight[..., 656:].long().view(g, nsb, 8, 1, 1, ROWS, 4)
        u = u | (((high >> (4 * torch.arange(2).view(1, 1, 1, 2, 1, 1, 1) + s)) & 1) << 2)
        sc = weight[..., 16:144].contiguous().view(torch.int8).float().view(g, nsb, 8, 2, 1, ROWS, 1)
        w = (d * sc) * (u - 4).float()
    else:
        scales = weight[..., 32:160].long().view(g, nsb, 8, 2, 1, ROWS, 1)  # group 2k + h
        dmin = weight[..., 16:32].contiguous().view(torch.float16).float().view(g, nsb, 1, 1, 1, ROWS, 1)
        w = (d * (scales & 15).float()) * u.float() - dmin * (scales >> 4).float()
    return w.permute(0, 5, 1, 2, 3, 4, 6).reshape(g * ROWS, nsb * 256)  # [N_pad, K]


def repack_q5(raw: torch.Tensor, has_min: bool) -> torch.Tensor:
    """GGUF Q5_1 (``has_min``) or Q5_0 rows [N, nb * 24 | 22] uint8 -> Q5 records ``[G, nb, 192]`` uint8: the Q4
    record of the same d, m and low nibbles, then the fifth bits as ``qh[r][i]`` (``csrc/common.h``)."""
    size = 24 if has_min else 22
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"Q5 rows must be uint8 [N, nb * {size}], got {raw.dtype} {list(raw.shape)}")
    n, nb = raw.shape[0], raw.shape[1] // size
    blocks = raw.view(n, nb, size)
    as_q4 = torch.cat([blocks[..., : size - 20], blocks[..., size - 16 :]], dim=-1)  # [N, nb, 20 | 18]: d (, m), qs
    q4 = repack_q4(as_q4.reshape(n, -1), has_min, zero_point=16.0)  # [G, nb, 160]: Q5_0's m = -16 d
    bits = blocks[..., size - 20 : size - 16].contiguous().view(torch.int32).view(n, nb)  # [N, nb]: bit c: column c
    columns = (bits[..., None] >> torch.arange(32)) & 1  # [N, nb, 32]
    split = columns.view(n, nb, 2, 4, 4)  # [N, nb, half, t, i]: column 16 half + 4t + i
    shifts = torch.arange(4).view(1, 1, 4, 1)  # t
    qh = ((split[:, :, 0] << shifts) | (split[:, :, 1] << (shifts + 4))).sum(dim=2).to(torch.uint8)  # [N, nb, i]
    qh = _pad_rows(qh.reshape(n, -1)).view(-1, ROWS, nb, 4).transpose(1, 2).reshape(-1, nb, 32)  # [G, nb, r*i]
    return torch.cat([q4, qh], dim=-1).contiguous()  # [G, nb, 192]


def repack_q8(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows ``[N, nb * 34]`` uint8 -> Q8 records ``[G, nb, 272]`` uint8."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % _Q8_0_BYTES:
        raise ValueError(f"Q8_0 rows must be uint8 [N, nb * 34], got {raw.dtype} {list(raw.shape)}")
    offset = raw.view(raw.shape[0], -1, _Q8_0_BYTES).clone()  # [N, nb, 34]
    offset[..., 2:] ^= 0x80  # the values plus 128 as uint8 (padding rows stay all zero, as the kernel's)
    blocks = _pad_rows(offset.view(raw.shape)).view(-1, ROWS, offset.shape[1], _Q8_0_BYTES)  # [G, 8, nb, 34]
    g, _, nb, _ = blocks.shape
    d = blocks[..., 0:2].transpose(1, 2).reshape(g, nb, 16)  # [G, nb, 8 x fp16]
    qs = blocks[..., 2:].reshape(g, ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 256)  # [G, nb, j*r*i]
    return torch.cat([d, qs], dim=-1).contiguous()  # [G, nb, 272]


def repack_16bit(raw: torch.Tensor) -> torch.Tensor:
    """GGUF F16 or BF16 rows ``[N, K * 2]`` uint8 -> records ``[G, K / 32, 512]`` uint8 (column c of row r at w[c][r])."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % (2 * BLOCK):
        raise ValueError(f"F16 rows must be uint8 [N, nb * 64], got {raw.dtype} {list(raw.shape)}")
    nb = raw.shape[1] // (2 * BLOCK)
    halves = _pad_rows(raw).view(-1, ROWS, nb, BLOCK, 2)  # [G, r, nb, c, 2 bytes]
    return halves.permute(0, 2, 3, 1, 4).reshape(-1, nb, 2 * BLOCK * ROWS).contiguous()  # [G, nb, 512]


def _q6_k_values(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q6_K rows [N, nsb * 210] uint8 -> (u [N, nsb * 256] uint8 in [0, 63], scales [N, nsb * 16] int8,
    d [N, nsb] fp16), value = d * scale[c // 16] * (u[c] - 32). Source: ggml ``dequantize_row_q6_K``."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, 210)  # [N, nsb, 210]
    ql = blocks[..., :128].reshape(n, -1, 2, 2, 32)  # [N, nsb, half n, ql half, l]
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)  # [N, nsb, half n, 1, l]
    lo = torch.stack([ql & 15, ql >> 4], dim=3)  # [N, nsb, n, nibble, ql half, l]: quarter k = 2 nibble + ql half
    hi = torch.stack([(qh >> (2 * k)) & 3 for k in range(4)], dim=3).view(n, -1, 2, 2, 2, 32)  # [.., k // 2, k % 2, l]
    u = (lo | (hi << 4)).reshape(n, -1)  # [N, nsb * 256]: value 128 n + 32 k + l
    scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)  # [N, nsb * 16]
    d = blocks[..., 208:210].contiguous().view(torch.float16).reshape(n, -1)  # [N, nsb]
    return u, scales, d


def repack_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K rows ``[N, K / 256 * 210]`` uint8 -> Q6 records ``[G, K / 256, 1680]`` uint8 (module doc)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % 210:
        raise ValueError(f"Q6_K rows must be uint8 [N, nsb * 210], got {raw.dtype} {list(raw.shape)}")
    u, scales, d = _q6_k_values(_pad_rows(raw))
    g, nb = u.shape[0] // ROWS, u.shape[1] // BLOCK
    u = u.view(g, ROWS, nb, 2, 4, 4)  # [G, r, nb, half, t, i]: column 16 half + 4 t + i
    lo = ((u[:, :, :, 0] & 15) | ((u[:, :, :, 1] & 15) << 4)).permute(0, 2, 3, 1, 4)  # [G, nb, t, r, i]
    top = (u >> 4).view(g, ROWS, nb, 2, 2, 2, 4)  # [G, r, nb, half, v, t % 2, i]
    hi = top[:, :, :, 0, :, 0] | (top[:, :, :, 1, :, 0] << 2) | (top[:, :, :, 0, :, 1] << 4) | (top[:, :, :, 1, :, 1] << 6)
    hi = hi.permute(0, 2, 3, 1, 4)  # [G, nb, v, r, i]
    sc = scales.view(g, ROWS, nb, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(g, nb, 16)  # [h][r]
    blocks = torch.cat([sc, lo.reshape(g, nb, 128), hi.reshape(g, nb, 64)], dim=-1)  # [G, nb, 208]
    d = d.view(g, ROWS, nb // 8).transpose(1, 2).contiguous().view(torch.uint8)  # [G, nsb, 16]
    return torch.cat([d, blocks.reshape(g, nb // 8, 8 * 208)], dim=-1).contiguous()  # [G, nsb, 1680]


def _q6_blocks(weight: torch.Tensor) -> torch.Tensor:
    """Q6 records [G, nsb, 1680] -> one 224-byte block per 32 columns [G, nsb * 8, 224] (each with its
    super-block's d[8] in front), the form :func:`dequantize_packed` reads."""
    g, nsb, _ = weight.shape
    d = weight[..., :16].unsqueeze(2).expand(g, nsb, 8, 16)  # [G, nsb, k, 16]
    return torch.cat([d, weight[..., 16:].reshape(g, nsb, 8, 208)], dim=-1).reshape(g, nsb * 8, 224)


def _iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF IQ4_XS super-blocks [..., 136] uint8 -> the 8 sub-block scales ls_j - 32 [..., 8] int64 (ls_j: low
    nibble j of scales_l | 2 bits j of scales_h << 4). Source: ggml ``dequantize_row_iq4_xs``."""
    scales_h = blocks[..., 2:4].contiguous().view(torch.int16).long() & 0xFFFF  # [..., 1]
    j = torch.arange(8)
    return (((blocks[..., 4 + j // 2].long() >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)) - 32


def _super_blocks(raw: torch.Tensor, size: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [N, nsb * size] uint8 of 256-value blocks that start with an fp16 d and end with IQ4_XS's 128 index bytes
    -> (blocks [G, r, nsb, size] with zero padding rows, the records' d [G, nsb, r 2], their qs [G, nsb, k t r i]).
    Raises ValueError for another shape."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"{name} rows must be uint8 [N, nsb * {size}], got {raw.dtype} {list(raw.shape)}")
    nsb = raw.shape[1] // size
    blocks = _pad_rows(raw).view(-1, ROWS, nsb, size)  # [G, r, nsb, size]
    g = blocks.shape[0]
    d = blocks[..., 0:2].transpose(1, 2).reshape(g, nsb, 16)  # [G, nsb, r 2]
    qs = blocks[..., size - 128:].reshape(g, ROWS, nsb, 8, 4, 4).permute(0, 2, 3, 4, 1, 5).reshape(g, nsb, 1024)
    return blocks, d, qs


def repack_iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    """GGUF IQ4_XS rows [N, nsb * 136] uint8 -> IQ4_XS records [G, nsb, 1088] uint8 (module doc)."""
    blocks, d, qs = _super_blocks(raw, 136, "IQ4_XS")
    g, _, nsb, _ = blocks.shape
    ls = _pad_rows(_iq4_xs_scales(raw.view(-1, nsb, 136)) + 32)  # [N_pad, nsb, k]: padding rows 0
    ls = ls.view(g, ROWS, nsb, 8).permute(0, 2, 3, 1)  # [G, nsb, k, r]
    low = (ls[:, :, :4] & 15) | ((ls[:, :, 4:] & 15) << 4)  # [G, nsb, k % 4, r]
    shifts = 2 * torch.arange(4).view(1, 1, 4, 1)  # blocks t, t + 2, t + 4, t + 6 at bits 0, 2, 4, 6
    top = torch.stack([((ls[:, :, t::2] >> 4) << shifts).sum(dim=2) for t in (0, 1)], dim=2)  # [G, nsb, t, r]
    top = top.reshape(g, nsb, 16).to(torch.uint8)  # [G, nsb, t r]: the top bits of ls[t + 2j] at bits 2j
    return torch.cat([d, low.reshape(g, nsb, 32).to(torch.uint8), top, qs], dim=-1).contiguous()  # [G, nsb, 1088]


def repack_xs16(raw: torch.Tensor) -> torch.Tensor:
    """XS16 rows [N, nsb * 146] uint8 (fp16 d, int8 sc[16], 128 index bytes) -> XS16 records [G, nsb, 1168]."""
    blocks, d, qs = _super_blocks(raw, 146, "XS16")
    g, _, nsb, _ = blocks.shape
    sc = blocks[..., 2:18].reshape(g, ROWS, nsb, 8, 2).permute(0, 2, 3, 4, 1).reshape(g, nsb, 128)  # [k h r]
    return torch.cat([d, sc, qs], dim=-1).contiguous()  # [G, nsb, 1168]


def _dequantize_xs16(weight: torch.Tensor, table: tuple[int, ...]) -> torch.Tensor:
    """XS16 records [G, nsb, 1168] -> float32 [G * 8, nsb * 256]: (d sc) table[nibble]."""
    g, nsb, _ = weight.shape
    d = weight[..., :16].contiguous().view(torch.float16).float().view(g, nsb, 1, 1, ROWS, 1, 1)
    sc = weight[..., 16:144].contiguous().view(torch.int8).float().view(g, nsb, 8, 2, ROWS, 1, 1)  # [., k, h, r, 1, 1]
    qs = weight[..., 144:].reshape(g, nsb, 8, 4, ROWS, 4).permute(0, 1, 2, 4, 3, 5).long()  # [G, nsb, k, r, t, i]
    values = torch.tensor(table, dtype=torch.float32)[torch.stack([qs & 15, qs >> 4], dim=3)]  # [., k, h, r, t, i]
    w = (d * sc) * values  # [G, nsb, k, h, r, t, i]
    return w.permute(0, 4, 1, 2, 3, 5, 6).reshape(g * ROWS, nsb * 256)  # [N_pad, K]


def _dequantize_iq4_xs(weight: torch.Tensor, table: tuple[int, ...] = IQ4_VALUES) -> torch.Tensor:
    """IQ4_XS records [G, nsb, 1088] -> float32 [G * 8, nsb * 256]: (d sc) table[nibble] (IQ4_VALUES: as ggml
    ``dequantize_row_iq4_xs``)."""
    g, nsb, _ = weight.shape
    d = weight[..., :16].contiguous().view(torch.float16).float().view(g, nsb, 1, ROWS, 1, 1)  # [G, nsb, 1, r, 1, 1]
    k = torch.arange(8)
    low, top = weight[..., 16:48].long().view(g, nsb, 4, ROWS), weight[..., 48:64].long().view(g, nsb, 2, ROWS)
    low, top = low[:, :, k % 4] >> (4 * (k // 4)).view(8, 1), top[:, :, k % 2] >> (2 * (k // 2)).view(8, 1)
    ls = (low & 15) | ((top & 3) << 4)  # [G, nsb, k, r]
    sc = (ls - 32).float().view(g, nsb, 8, ROWS, 1, 1)  # [G, nsb, k, r, 1, 1]
    qs = weight[..., 64:].reshape(g, nsb, 8, 4, ROWS, 4).permute(0, 1, 2, 4, 3, 5).long()  # [G, nsb, k, r, t, i]
    values = torch.tensor(table, dtype=torch.float32)[torch.stack([qs & 15, qs >> 4], dim=4)]  # [., h, t, i]
    w = (d * sc).unsqueeze(-1) * values  # [G, nsb, k, r, h, t, i]
    return w.permute(0, 3, 1, 2, 4, 5, 6).reshape(g * ROWS, nsb * 256)  # [N_pad, K]


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Float rows [N, K] (K % 32 == 0) -> GGUF Q8_0 bytes [N, K / 32 * 34] uint8.

    As llama.cpp ``quantize_row_q8_0_ref``: d = max|x| / 127 stored as fp16, q = roundf(x * (1 / d))
    (half away from zero; byte for byte the gguf package's ``Q8_0``). Used for tensor types that have no kernel
    (K-quants, Q5_*).
    """
    n, k = w.shape
    x = w.float().reshape(n, k // BLOCK, BLOCK)  # [N, nb, 32]
    d = x.abs().amax(-1, keepdim=True) / 127.0  # [N, nb, 1]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = x * inv
    # roundf: q - trunc(q) is exact, whereas floor(|q| + 0.5) rounds 0.49999997 + 0.5 up to 1
    t = torch.trunc(q)
    q = torch.where((q - t).abs() >= 0.5, t + torch.sign(q), t).clamp(-127, 127).to(torch.int8)
    d16 = d.to(torch.float16).view(torch.uint8)  # [N, nb, 2]
    return torch.cat([d16, q.view(torch.uint8)], dim=-1).reshape(n, -1)  # [N, nb * 34]


def quantize_q8a(x: torch.Tensor) -> torch.Tensor:
    """Activations [M, K] float32 -> [M, K / 32 * 40] uint8 blocks ``{float d, s; int8 qs[32]}``."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)  # [M, nb, 32]
    amax = xb.abs().amax(-1, keepdim=True)  # [M, nb, 1]
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division, as the C++ (a scalar divisor
    d = amax / c127  # would become a multiplication by its reciprocal, which rounds differently)
    inv = torch.where(amax != 0, c127 / amax, torch.zeros_like(amax))
    # 127 / amax overflows where amax < 127 / FLT_MAX: every x * inf is +-inf or NaN, which _mm256_cvtps_epi32 turns
    # into INT_MIN (packed to -128; 32 of them sum to 0 in int32), as the C++ and llama.cpp's x86 path do
    overflow = torch.isinf(inv)  # [M, nb, 1]
    q = torch.where(overflow, -128.0, torch.round(xb * inv))  # half to even, as _mm256_round_ps
    s = torch.where(overflow, 0.0, d * q.sum(-1, keepdim=True))
    head = torch.cat([d, s], dim=-1).contiguous().view(torch.uint8)  # [M, nb, 8]
    return torch.cat([head, q.to(torch.int8).view(torch.uint8)], dim=-1).reshape(m, -1)  # [M, nb * 40]


def dequantize_q8a(q: torch.Tensor) -> torch.Tensor:
    """[M, nb * 40] uint8 activation blocks -> [M, nb * 32] float32 (qs * d)."""
    m = q.shape[0]
    blocks = q.view(m, -1, 40)  # [M, nb, 40]
    d = blocks[..., 0:4].contiguous().view(torch.float32)  # [M, nb, 1]
    qs = blocks[..., 8:].contiguous().view(torch.int8).float()  # [M, nb, 32]
    return (qs * d).reshape(m, -1)


def mixed_segments(weight: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """A mixed weight (``csrc/common.h``: a 64-byte int64 header, then each segment's records) -> its segments
    (weight_type, records [groups, nb, R]). Raises ValueError on a malformed header or byte count."""
    head = weight[:MIXED_HEADER].contiguous().view(torch.int64).tolist()
    num, nb = head[0], head[1]
    if not 1 <= num <= 3 or nb < 1:
        raise ValueError(f"mixed weight header holds {num} segments of {nb} blocks")
    shapes = [(weight_type, (groups, nb // RECORD_BLOCKS.get(weight_type, 1), RECORD_BYTES[weight_type]))
              for weight_type, groups in zip(head[2 : 2 + 2 * num : 2], head[3 : 3 + 2 * num : 2])]
    sizes = [math.prod(shape) for _, shape in shapes]  # bytes of each segment
    if MIXED_HEADER + sum(sizes) != weight.numel():
        raise ValueError(f"mixed weight has {weight.numel()} bytes, its header describes {MIXED_HEADER + sum(sizes)}")
    parts = weight[MIXED_HEADER:].split(sizes)
    return [(weight_type, part.view(shape)) for (weight_type, shape), part in zip(shapes, parts)]


def pack_mixed(segments: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Segments (quantized weight_types, records [groups, records, R]) of one stacked matrix -> a mixed weight
    [bytes] uint8 (:func:`mixed_segments` reads it back). Every segment but the last must fill whole groups (the
    caller's check: their rows are a multiple of 8)."""
    nb = segments[0][1].shape[1] * RECORD_BLOCKS.get(segments[0][0], 1)  # 32-column blocks
    head = [len(segments), nb] + [n for t, records in segments for n in (t, records.shape[0])]
    header = torch.tensor(head + [0] * (MIXED_HEADER // 8 - len(head)), dtype=torch.int64).view(torch.uint8)
    return torch.cat([header, *(records.reshape(-1) for _, records in segments)])


def dequantize_packed(weight: torch.Tensor, weight_type: int) -> torch.Tensor:
    """Repacked records [G, nb, R] (a mixed weight: [bytes]) -> float32 weight [G * 8, nb * 32] (padding rows
    included)."""
    if weight_type == MIXED:
        return torch.cat([dequantize_packed(records, t) for t, records in mixed_segments(weight)])
    if weight_type in (Q2, Q3):
        return _dequantize_q23(weight, q3=weight_type == Q3)
    if weight_type in (Q4_K, Q5_K):
        return _dequantize_k_quant(weight, five=weight_type == Q5_K)
    if weight_type in XS_TABLES:
        return _dequantize_iq4_xs(weight, XS_TABLES[weight_type])
    if weight_type in XS16_TABLES:
        return _dequantize_xs16(weight, XS16_TABLES[weight_type])
    if weight_type == Q6:
        weight = _q6_blocks(weight)  # [G, nb, 224]
    g, nb, _ = weight.shape
    if weight_type in (F16, BF16):
        half = torch.float16 if weight_type == F16 else torch.bfloat16
        w16 = weight.contiguous().view(half).float().view(g, nb, BLOCK, ROWS)  # [G, nb, c, r]
        return w16.permute(0, 3, 1, 2).reshape(g * ROWS, nb * BLOCK)  # [N_pad, K]
    d = weight[..., 0:16].contiguous().view(torch.float16).float()  # [G, nb, 8]
    if weight_type in (Q4, Q5, Q4_0, Q5_0):
        if weight_type in (Q4_0, Q5_0):  # no m stored: m = -8 d, -16 d, exact
            m = d * (-8.0 if weight_type == Q4_0 else -16.0)  # [G, nb, 8]
            qs = weight[..., 16:144].reshape(g, nb, 4, ROWS, 4)  # [G, nb, t, r, i]
        else:
            m = weight[..., 16:32].contiguous().view(torch.float16).float()  # [G, nb, 8]
            qs = weight[..., 32:160].reshape(g, nb, 4, ROWS, 4)  # [G, nb, t, r, i]
        lo, hi = (qs & 15).float(), (qs >> 4).float()
        if weight_type in (Q5, Q5_0):  # qh[r][i]: bit t for column 4t + i, bit 4 + t for column 16 + 4t + i
            qh = weight[..., 160 if weight_type == Q5 else 144:].reshape(g, nb, 1, ROWS, 4)
            t = torch.arange(4, dtype=torch.uint8).view(1, 1, 4, 1, 1)
            lo, hi = lo + 16 * ((qh >> t) & 1).float(), hi + 16 * ((qh >> (t + 4)) & 1).float()
        q = torch.cat([lo, hi], dim=2)  # [G, nb, 8 quads, r, i]: quads 0-3 low, 4-7 high
        w = q * d.view(g, nb, 1, ROWS, 1) + m.view(g, nb, 1, ROWS, 1)
    elif weight_type in (IQ4, MXFP4):
        qs = weight[..., 16:].reshape(g, nb, 4, ROWS, 4).long()  # [G, nb, t, r, i]
        values = torch.tensor(IQ4_VALUES if weight_type == IQ4 else MXFP4_VALUES, dtype=torch.float32)
        q = values[torch.cat([qs & 15, qs >> 4], dim=2)]  # [G, nb, 8, r, i]
        w = q * d.view(g, nb, 1, ROWS, 1)
    elif weight_type == Q8:
        q = (weight[..., 16:] ^ 0x80).contiguous().view(torch.int8)  # the values: stored plus 128
        q = q.reshape(g, nb, 8, ROWS, 4).float()  # [G, nb, j, r, i]
        w = q * d.view(g, nb, 1, ROWS, 1)
    elif weight_type == Q6:
        sc = weight[..., 16:32].contiguous().view(torch.int8).float().view(g, nb, 2, ROWS)  # [G, nb, h, r]
        lo = weight[..., 32:160].reshape(g, nb, 4, ROWS, 4)  # [G, nb, t, r, i]
        hi = weight[..., 160:].reshape(g, nb, 2, 1, ROWS, 4)  # [G, nb, v, 1, r, i]
        top = torch.cat([(hi >> s) & 3 for s in (0, 4)], dim=3)  # [G, nb, v, t % 2, r, i]: half 0's top bits
        top1 = torch.cat([(hi >> s) & 3 for s in (2, 6)], dim=3)  # the same for half 1
        u0 = (lo & 15) | (top.reshape(g, nb, 4, ROWS, 4) << 4)  # [G, nb, t, r, i]: column 4t + i
        u1 = (lo >> 4) | (top1.reshape(g, nb, 4, ROWS, 4) << 4)  # column 16 + 4t + i
        u = torch.cat([u0, u1], dim=2).float() - 32.0  # [G, nb, 8 quads, r, i]
        scale = (d.view(g, nb, 1, ROWS) * sc).repeat_interleave(4, dim=2)  # [G, nb, 8 quads, r]: d * sc (float)
        w = u * scale[..., None]
    else:
        raise ValueError(f"weight_type must be one of {sorted(RECORD_BYTES)} or {MIXED} (mixed), got {weight_type}")
    return w.permute(0, 3, 1, 2, 4).reshape(g * ROWS, nb * BLOCK)  # [N_pad, K]


def qgemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_type: int,
    out_features: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ weight.T (+ bias [N]) (+ residual [M, N]) -> [M, N] float32, with x
    quantized per 32 values first (Q4, Q8, Q6; F16 and BF16 weights take x as it is). The products are summed in
    float64 and rounded once, so a row's result does not depend on the rows beside it (a float32 matmul's blocking
    does): greedy tokens on this path agree alone, batched and in the engine, as on the kernels."""
    xq = x.float() if weight_type in (F16, BF16) else dequantize_q8a(quantize_q8a(x))  # [M, K]
    w = dequantize_packed(weight, weight_type)[:out_features]  # [N, K]
    out = (xq.double() @ w.double().T).float()  # [M, N]
    if bias is not None:
        out = out + bias
    return out + residual.view(out.shape) if residual is not None else out


def dequantize_rows(weight: torch.Tensor, weight_type: int, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` [n] of a repacked weight as float32 [n, in_features] (embedding lookup)."""
    nb = weight.shape[1] * RECORD_BLOCKS.get(weight_type, 1)  # 32-column blocks
    if in_features != nb * BLOCK:
        raise ValueError(f"in_features {in_features} != {nb * BLOCK}")
    groups = weight.index_select(0, ids.reshape(-1) // ROWS)  # [n, records, R]
    rows = dequantize_packed(groups, weight_type).view(-1, ROWS, in_features)  # [n, 8, K]
    return rows[torch.arange(rows.shape[0]), ids.reshape(-1) % ROWS]  # [n, K]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, past_len: int, scale: float,
    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a cache: q [B, H, T, D] float32; k, v [B, Hkv, S, D] (read at fp16
    precision); key_mask [B, S] bool or None. Query t sits at slot ``past_len + t`` and sees the
    slots up to it that key_mask allows (a query that sees none sees its own slot); with ``window`` > 0 (a
    sliding-window layer) only the slots > ``past_len + t - window`` of those. ``softcap`` > 0 (Gemma 2): each
    scaled score s becomes ``softcap * tanh(s / softcap)`` before the softmax. ``sinks`` [H] (gpt-oss): each head's
    softmax also runs over its sink logit, whose probability is dropped.
    Returns [B, T, H, D] float32, computed in float64 and rounded once (so a query's result does not depend on the
    batch, the cache length or the other queries, as on the kernels). Source: Vaswani et al. 2017 eq. 1; GQA as HF
    ``repeat_kv``; the window as transformers' ``sliding_window_overlay``; the softcap as its Gemma 2
    ``eager_attention_forward``; the sinks as its GptOss ``eager_attention_forward``.
    """
    return _attention(q, k.half().double(), v.half().double(), key_mask, past_len, scale, window, softcap, sinks)


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] float32 as int8 caches store them: (values [..., D] int8, scales [...] float32) with
    scale = amax / 127 and value = round(x * (127 / amax)) (half to even; 0 where amax = 0), amax the row's largest
    |x|: symmetric per-row (per token and KV head) quantization; a value reads back as value * scale. Source: llama.cpp's
    ``quantize_row_q8_0_ref`` (ggml-quants.c: d = amax / 127, q = round(x / d)), one block per row, the scale in
    float32, and x * (127 / amax) for x / d (the kernels' ``store_row_q8`` computes the same)."""
    amax = x.abs().amax(-1)  # [...]
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # [...]
    return torch.round(x * inv[..., None]).to(torch.int8), amax / torch.full_like(amax, 127.0)


def dequantize_kv_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 cache rows values [..., D] with their scales [...] -> float64 [..., D] (values * scales, exact)."""
    return values.double() * scales.double()[..., None]


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, past_len: int, scale: float,
    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention` over k, v as given (float64: fp16-rounded or dequantized int8 rows)."""
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    q = q.double()
    slot = torch.arange(s)
    visible = slot[None, :] <= (past_len + torch.arange(t))[:, None]  # [T, S]
    if window > 0:
        visible &= slot[None, :] > (past_len + torch.arange(t))[:, None] - window  # [T, S]
    visible = visible[None] & (key_mask.bool()[:, None, :] if key_mask is not None else True)  # [B, T, S]
    own = slot[None, :] == (past_len + torch.arange(t)).clamp(max=s - 1)[:, None]  # [T, S]
    visible = torch.where(visible.any(-1, keepdim=True), visible, own[None])  # [B, T, S]
    qg = q.reshape(b, h_kv, h // h_kv * t, d)  # [B, Hkv, G*T, D] (head-major, then t)
    scores = (qg @ k.transpose(-1, -2)).view(b, h_kv, h // h_kv, t, s) * scale  # [B, Hkv, G, T, S]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is not None:  # one more logit per head, its probability dropped
        sink = sinks.double().view(1, h_kv, h // h_kv, 1, 1).expand(b, -1, -1, t, 1)  # [B, Hkv, G, T, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]  # [B, Hkv, G, T, S]
    else:
        probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G, T, S]
    out = probs.reshape(b, h_kv, -1, s) @ v  # [B, Hkv, G*T, D]
    return out.view(b, h, t, d).transpose(1, 2).float().contiguous()  # [B, T, H, D]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed queries q [N, H, D] of R sequences (``query_start_loc`` [R+1]) over pools
    [num_blocks, Hkv, block_size, D] through ``block_tables`` [R, nb]; sequence r's queries are
    its last positions before ``seq_lens[r]``; ``window``, ``softcap`` and ``sinks`` as :func:`attention`. Returns [N, H, D]
    float32.
    """
    return _paged_attention(q, k_pool, v_pool, None, None, block_tables, query_start_loc, seq_lens, scale, window,
                            softcap, sinks)


def _paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention`, int8 pools read with their scales (:func:`dequantize_kv_rows`), others at fp16
    precision."""
    out = torch.empty_like(q)
    bs = k_pool.shape[2]

    def read(pool: torch.Tensor, scales: torch.Tensor | None, where: tuple) -> torch.Tensor:
        rows = pool[where]  # [L, Hkv, D]
        rows = rows.half().double() if scales is None else dequantize_kv_rows(rows, scales[where])
        return rows.transpose(0, 1)[None]  # [1, Hkv, L, D]

    for r in range(seq_lens.shape[0]):
        start, end, length = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        pos = torch.arange(length)
        where = (block_tables[r][pos // bs], slice(None), pos % bs)  # each position's (block, every head, row)
        k, v = read(k_pool, k_scale, where), read(v_pool, v_scale, where)  # [1, Hkv, L, D] float64
        qr = q[start:end].transpose(0, 1)[None]  # [1, H, T, D]
        out[start:end] = _attention(qr, k, v, None, length - (end - start), scale, window, softcap, sinks)[0]
    return out


def _split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    n = qkv.shape[0]
    return q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)


def static_attention(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_mask: torch.Tensor | None,
    past_len: int, num_heads: int, scale: float, window: int = 0, softcap: float = 0.0,
    sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [B*T, (H + 2 Hkv) D]: write k, v at slots past_len.. of caches [B, Hkv, S_max, D], then
    :func:`attention` over the first past_len + T slots (``window``, ``softcap``, ``sinks`` as there). int8 caches
    take ``k_scale``, ``v_scale`` [B, Hkv, S_max] float32 (:func:`quantize_kv_rows`, :func:`dequantize_kv_rows`).
    Returns [B*T, H*D]."""
    b, h_kv, _, d = k_cache.shape
    t = qkv.shape[0] // b
    q, k, v = _split_qkv(qkv, num_heads, h_kv, d)  # [N, H|Hkv, D]
    where = (slice(None), slice(None), slice(past_len, past_len + t))
    _store_kv(k_cache, k_scale, where, k.view(b, t, h_kv, d).transpose(1, 2))
    _store_kv(v_cache, v_scale, where, v.view(b, t, h_kv, d).transpose(1, 2))
    end = past_len + t
    qb = q.view(b, t, num_heads, d).transpose(1, 2)  # [B, H, T, D]
    if k_scale is None:
        out = attention(qb, k_cache[:, :, :end], v_cache[:, :, :end], key_mask, past_len, scale, window,
                        softcap, sinks)  # [B, T, H, D]
    else:
        assert v_scale is not None, "int8 caches take k_scale and v_scale"
        k_read = dequantize_kv_rows(k_cache[:, :, :end], k_scale[:, :, :end])  # [B, Hkv, S, D] float64
        v_read = dequantize_kv_rows(v_cache[:, :, :end], v_scale[:, :, :end])
        out = _attention(qb, k_read, v_read, key_mask, past_len, scale, window, softcap, sinks)  # [B, T, H, D]
    return out.reshape(b * t, num_heads * d)


def paged_attention_qkv(
    qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, scale: float,
    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [N, (H + 2 Hkv) D]: write k, v to ``slot_mapping`` [N] of the pools, then
    :func:`paged_attention` (``window``, ``softcap``, ``sinks`` as there). int8 pools take ``k_scale``, ``v_scale``
    [num_blocks, Hkv, block_size] float32: each row written as :func:`quantize_kv_rows` (values and scale), read as
    :func:`dequantize_kv_rows`. Returns [N, H*D]."""
    h_kv, bs, d = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    q, k, v = _split_qkv(qkv, num_heads, h_kv, d)
    blocks, rows = slot_mapping // bs, slot_mapping % bs  # slot s: row s % bs of block s // bs
    _store_kv(k_pool, k_scale, (blocks, slice(None), rows), k)
    _store_kv(v_pool, v_scale, (blocks, slice(None), rows), v)
    if k_scale is None:
        out = paged_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens, scale, window,
                              softcap, sinks)  # [N, H, D]
    else:
        assert v_scale is not None, "int8 pools take k_scale and v_scale"
        out = _paged_attention(q, k_pool, v_pool, k_scale, v_scale, block_tables, query_start_loc, seq_lens, scale,
                               window, softcap, sinks)
    return out.reshape(qkv.shape[0], num_heads * d)


def _store_kv(cache: torch.Tensor, scales: torch.Tensor | None, where: tuple, rows: torch.Tensor) -> None:
    """cache[where] = rows [..., D] float32 in the cache's dtype; int8 caches (``scales`` given): quantized
    (:func:`quantize_kv_rows`), their scales at scales[where]."""
    if scales is None:
        cache[where] = rows.to(cache.dtype)
        return
    values, row_scales = quantize_kv_rows(rows.float())
    cache[where], scales[where] = values, row_scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, C] float32 -> weight * x / sqrt(mean(x^2) + eps), as HF ``LlamaRMSNorm``."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """Rotate, in place, the q and k heads of stacked rows qkv [N, (H + 2 Hkv) * D] by cos, sin [N, R], R <= D even:
    the first R dimensions of each head (pairs i, i + R/2); the other D - R are left alone (partial rotary)."""
    n, r = qkv.shape[0], cos.shape[-1]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if cos.numel() != n * r or sin.numel() != n * r or r % 2 or not 2 <= r <= d:
        raise ValueError(f"rope_qkv_: cos/sin must be [N, R] with R even and <= D = {d}")
    heads = qkv[:, : (num_heads + num_kv_heads) * d].view(n, num_heads + num_kv_heads, d)[..., :r]  # [N, H + Hkv, R]
    c, s = cos.reshape(n, 1, r), sin.reshape(n, 1, r)
    rotated = torch.cat((-heads[..., r // 2 :], heads[..., : r // 2]), dim=-1)  # [N, H + Hkv, R]
    heads.copy_(heads * c + rotated * s)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: gate_up [M, 2I] (gate first) -> silu(gate) * up [M, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU gate (Gemma's ``gelu_pytorch_tanh``): gate_up [M, 2I] (gate first) -> gelu_tanh(gate) * up [M, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def rms_norm_heads_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_heads: int,
                    num_kv_heads: int) -> None:
    """RMS-normalize, in place, each q head of stacked rows qkv [N, (H + 2 Hkv) D] by q_weight [D] and each k head by
    k_weight [D] (Qwen3's q_norm, k_norm: transformers ``Qwen3Attention``); v is left alone."""
    n, d = qkv.shape[0], q_weight.shape[0]
    heads = qkv[:, : (num_heads + num_kv_heads) * d].view(n, num_heads + num_kv_heads, d)  # [N, H + Hkv, D]
    weight = torch.cat([q_weight.expand(num_heads, d), k_weight.expand(num_kv_heads, d)])  # [H + Hkv, D]
    heads.copy_(weight * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)))


@dataclass(frozen=True)
class _Layers:
    """The per-layer operands of :func:`decoder_layers` (see its docstring)."""

    weights: list[torch.Tensor]
    linears: list[int]
    eps: list[float]
    extras: list[torch.Tensor | None]
    layer_args: list[int]
    rope: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    activation: int


def _layers(x: torch.Tensor, p: _Layers, num_layers: int, attend: Callable[[int, torch.Tensor, int], torch.Tensor]
            ) -> torch.Tensor:
    """The layer loop of :func:`decoder_layers`; ``attend(l, qkv, window)`` stores layer l's k, v and returns
    [N, H D]."""
    for layer in range(num_layers):
        norm1, qkv, o, norm2, gate_up, down = p.weights[6 * layer : 6 * layer + 6]
        lin, e = p.linears[8 * layer : 8 * layer + 8], p.eps[3 * layer : 3 * layer + 3]
        qkv_b, o_b, gate_up_b, down_b, q_norm, k_norm, post_attn, post_ff = (
            p.extras[8 * layer : 8 * layer + 8] if p.extras else [None] * 8)
        table, window = p.layer_args[2 * layer : 2 * layer + 2] if p.layer_args else (1, 0)
        h = qgemm(rms_norm(x, norm1, e[0]), qkv, lin[0], lin[1], qkv_b)  # [N, (H + 2 Hkv) D]
        if q_norm is not None and k_norm is not None:
            rms_norm_heads_(h, q_norm, k_norm, e[2], p.num_heads, p.num_kv_heads)
        if table:
            rope_qkv_(h, p.rope[2 * table - 2], p.rope[2 * table - 1], p.num_heads, p.num_kv_heads)
        h = attend(layer, h, window)  # [N, H D]
        if post_attn is None:
            x = qgemm(h, o, lin[2], lin[3], o_b, x)
        else:
            x = x + rms_norm(qgemm(h, o, lin[2], lin[3], o_b), post_attn, e[0])
        h = qgemm(rms_norm(x, norm2, e[1]), gate_up, lin[4], lin[5], gate_up_b)  # [N, 2 I]
        h = gelu_tanh_mul(h) if p.activation == 1 else silu_mul(h)  # [N, I]
        if post_ff is None:
            x = qgemm(h, down, lin[6], lin[7], down_b, x)
        else:
            x = x + rms_norm(qgemm(h, down, lin[6], lin[7], down_b), post_ff, e[1])
    return x


def decoder_layers(
    x: torch.Tensor, weights: list[torch.Tensor], linears: list[int], eps: list[float],
    extras: list[torch.Tensor | None], layer_args: list[int], rope: list[torch.Tensor], k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor], key_mask: torch.Tensor | None, past_len: int, num_heads: int, num_kv_heads: int,
    scale: float, activation: int = 0, softcap: float = 0.0, k_scales: list[torch.Tensor] | None = None,
    v_scales: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Every decoder layer of a Llama-family or Gemma model on rows x [N = B T, C] with a static KV cache, as
    ``LlamaDecoderLayer.forward_kernels`` (``Gemma3DecoderLayer.forward_kernels``) per layer l: weights[6 l : 6 l + 6]
    = (input_layernorm, qkv_proj, o_proj, post_attention_layernorm (Gemma: pre_feedforward_layernorm), gate_up_proj,
    down_proj), linears[8 l : 8 l + 8] = (weight_type, out_features) of the four projections, eps[3 l : 3 l + 3] (the
    two norms, the q/k norms), extras empty or extras[8 l : 8 l + 8] = (the four projections' biases, q_norm, k_norm,
    Gemma's post_attention_layernorm and post_feedforward_layernorm, normalizing the attention and MLP outputs before
    their residual adds with the eps of the norm before them), each possibly None; layer_args empty (every layer
    rotates by rope[0], rope[1], no window) or 2 per layer: (r, window), r = 0 no RoPE (SmolLM3's NoPE layers), r > 0
    the pair rope[2 r - 2], rope[2 r - 1] [N, D], window > 0 a sliding-window layer; activation 0 SwiGLU, 1 GeGLU;
    softcap > 0 caps the scores (Gemma 2); caches [B, Hkv, S_max, D] written at slots ``past_len..``
    (:func:`static_attention`; int8 caches with k_scales[l], v_scales[l], empty or None for others). Returns [N, C]
    float32."""
    p = _Layers(weights, linears, eps, extras, layer_args, rope, num_heads, num_kv_heads, activation)
    return _layers(x, p, len(k_caches), lambda layer, h, window: static_attention(
        h, k_caches[layer], v_caches[layer], key_mask, past_len, num_heads, scale, window, softcap, None,
        *_layer_scales(k_scales, v_scales, layer)))


def _layer_scales(k_scales: list[torch.Tensor] | None, v_scales: list[torch.Tensor] | None, layer: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Layer ``layer``'s (k_scale, v_scale) of int8 caches, (None, None) for others."""
    return (k_scales[layer], v_scales[layer]) if k_scales and v_scales else (None, None)


def paged_decoder_layers(
    x: torch.Tensor, weights: list[torch.Tensor], linears: list[int], eps: list[float],
    extras: list[torch.Tensor | None], layer_args: list[int], rope: list[torch.Tensor], k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float,
    activation: int = 0, softcap: float = 0.0, k_scales: list[torch.Tensor] | None = None,
    v_scales: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`decoder_layers` over packed rows x [N, C] of several sequences and per-layer pools
    [num_blocks, Hkv, block_size, D] (:func:`paged_attention_qkv`; int8 pools with k_scales[l], v_scales[l]). Returns
    [N, C] float32."""
    p = _Layers(weights, linears, eps, extras, layer_args, rope, num_heads, num_kv_heads, activation)
    return _layers(x, p, len(k_pools), lambda layer, h, window: paged_attention_qkv(
        h, k_pools[layer], v_pools[layer], slot_mapping, block_tables, query_start_loc, seq_lens, num_heads, scale,
        window, softcap, None, *_layer_scales(k_scales, v_scales, layer)))


def softmax_draw(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One id per row of logits [B, V] float32 from softmax(logits / temperature [B]) by inversion at u [B] float64
    (``ops.inverse_cdf_at``). Returns [B] long."""
    probs = torch.softmax(logits / temperature.to(logits.dtype)[:, None], dim=-1)  # [B, V]
    return inverse_cdf_at(probs, u.to(torch.float64).view(-1, 1)).view(-1)  # [B]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [B, V] float32 the first index of the largest value, NaN counting as the largest: [B] long.
    Source: ``torch.argmax`` (the greedy token of HF's ``_sample`` and vLLM's sampler)."""
    return torch.argmax(x, dim=-1)


def filter_draw(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The engine's sampling stages in vLLM v1's order (``ops.apply_temperature``, ``apply_min_p``, ``apply_top_k``,
    ``apply_top_p``; 0 / 0 / 1 disable a filter) on logits [B, V] float32 with per-row parameters [B], then
    :func:`softmax_draw` at temperature 1 with u [B] float64 (top_k: integer or float64 whole numbers). Returns [B] long (the C++ op may return -1 for a row it
    leaves to these ops). Raises ValueError for out-of-range parameters. Source: vLLM v1 ``Sampler``; HF's warpers."""
    x = ops.apply_temperature(logits, temperature)
    top_k = top_k.to(torch.int64)  # whole numbers, possibly as float64 (the engine's one parameter tensor), as the op
    x = ops.apply_top_p(ops.apply_top_k(ops.apply_min_p(x, min_p), top_k), top_p)  # [B, V]
    return softmax_draw(x, torch.ones_like(temperature, dtype=torch.float64), u)


GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # GptOssExperts.alpha, .limit (constants of transformers' and llama.cpp's code)


def linear_f64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, C] float32 @ weight [E, C].T (+ bias [E]) computed in float64 and rounded once -> [N, E] float32.

    A float32 GEMM's per-row sums change with N (BLAS picks other kernels and blockings), which would move a
    mixture-of-experts router's near-tied choices between a row alone (decode) and among others (prefill, the
    engine's batches); in float64 the difference is ~1e-16 of a value, below float32's rounding. The C++ op sums
    each output in one fixed order and reads the weights as float32; it raises RuntimeError for inputs that are not
    float32 or whose C (or E, for the bias) differ, as F.linear does for mismatched shapes here.
    Source: torch ``F.linear``; the routers of transformers' Qwen3MoeSparseMoeBlock / GptOssTopKRouter."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


def gpt_oss_glu(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped GLU: gate_up [..., 2I] (gate, then up) -> (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g) with
    g = min(gate, 7), [..., I], gate_up's dtype; also the float path's (models.moe). Source: transformers 4.55
    ``GptOssExperts.forward``."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    gate = gate.clamp(max=GPT_OSS_LIMIT)
    up = up.clamp(min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_ALPHA))


def moe_experts_row(h: torch.Tensor, gate_up: list[torch.Tensor], gate_up_linears: list[int], down: list[torch.Tensor],
                    down_linears: list[int], expert_weights: list[float],
                    biases: list[torch.Tensor | None] | None = None, activation: int = 0) -> torch.Tensor:
    """One row's routed experts: h [1, C] float32 -> sum_j w_j * down_j(act(gate_up_j(h))) [1, C] (act: silu_mul, or
    gpt_oss_glu for activation 1; biases: none, or gate_up's and down's of each expert), j in the given order, each
    term rounded (a float32 product) before it is added to zeros. ``ValueError`` for lists of mismatched lengths (the
    op's checks)."""
    k = len(gate_up)
    if not (k >= 1 and len(down) == len(expert_weights) == k and len(gate_up_linears) == len(down_linears) == 2 * k):
        raise ValueError("moe_experts_row: k >= 1 experts, each with gate_up, down, (type, out_features) of both and a "
                         "weight")
    if biases and len(biases) != 2 * k:
        raise ValueError(f"moe_experts_row: biases must be empty or 2 per expert, got {len(biases)}")
    out = torch.zeros_like(h)  # [1, C]
    act = silu_mul if activation == 0 else gpt_oss_glu
    for j, w in enumerate(expert_weights):
        gb, db = (biases[2 * j], biases[2 * j + 1]) if biases else (None, None)
        g = qgemm(h, gate_up[j], gate_up_linears[2 * j], gate_up_linears[2 * j + 1], gb)  # [1, 2I]
        y = qgemm(act(g), down[j], down_linears[2 * j], down_linears[2 * j + 1], db)  # [1, C]
        out.add_(y * torch.tensor(w, dtype=torch.float32))
    return out
