"""GGUF's lattice and ternary types re-encoded, value for value, as IQ4_XS super-blocks over a table of their own.

IQ3_XXS, IQ3_S, IQ2_XXS and IQ1_S store 4 or 8 values at a time as an index into a grid of points (llama.cpp's
lattice codebooks), with signs and a 3- or 4-bit scale per 32 values under an fp16 ``d`` per 256; TQ1_0 and TQ2_0
store ternary values under one ``d``. Every value they decode to is ``d' * sc * table[code]``, ``sc`` an odd integer
1 .. 31 per 32 values and ``table`` 16 signed 8-bit levels:

=========  ====  ============================  ==========================================
type       d'    sc                            table
=========  ====  ============================  ==========================================
IQ3_XXS    d/2   1 + 2 s (4 bits)              +-{2, 6, 10, 14, 18, 22, 26, 31}: grid bytes / 2
IQ3_S      d     1 + 2 s (4 bits)              +-{1, 3, 5, 7, 9, 11, 13, 15}
IQ2_XXS    d/8   1 + 2 s (4 bits)              +-{8, 25, 43}
IQ1_S      d/8   1 + 2 s (3 bits)              8 g + 1 or 8 g - 1 for g in {-1, 0, 1} (delta +-1/8, per 32)
TQ1_0/2_0  d     1                             {-1, 0, 1} (and 2: TQ2_0's unused code 3 decodes to it)
=========  ====  ============================  ==========================================

which is IQ4_XS's block (``ls = sc + 32``, a 4-bit code per value) with ``table`` in place of ``kvalues_iq4nl``: the
kernels run these types through the IQ4_XS tiles at 4.25 bits a weight (1.39x IQ3_XXS's bytes, 2.06x IQ2_XXS's,
against 8.5 bits for the Q8_0 they were converted to before), from the file's values and no requantization.

IQ2_XS and IQ2_S (IQ2_XXS's levels, d/8) and IQ1_M (IQ1_S's levels and a delta sign per 8 values, d/8 with d spread
over the top nibbles of its scales) have an ``sc`` per 16 values: they become XS16 rows, per 256 values fp16 d',
int8 ``sc[16]`` (16-value group 2 j + h) and IQ4_XS's 128 index bytes (146 bytes, 4.56 bits a weight), which the
kernels keep in their XS16 records.

The codes come from the ``gguf`` package's dequantization of the file (llama.cpp's reference decoding): code = the
table index nearest to value / (d' sc). Source: ggml-quants.c ``dequantize_row_iq3_xxs`` / ``_iq3_s`` / ``_iq2_xxs``
/ ``_iq2_xs`` / ``_iq2_s`` / ``_iq1_s`` / ``_iq1_m`` / ``_tq1_0`` / ``_tq2_0``, ``block_iq4_xs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from gguf.quants import dequantize

SUPER_BLOCK = 256  # values per GGUF super-block
IQ4_XS_BYTES = 136  # bytes of a block_iq4_xs: fp16 d, uint16 scales_h, scales_l[4], qs[128]
XS16_BYTES = 146  # bytes of an XS16 row block: fp16 d, int8 sc[16], qs[128]


def _u16(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    return blocks[:, start:start + 2 * count].copy().view("<u2").astype(np.int64)  # [n, count]


def _u32(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    return blocks[:, start:start + 4 * count].copy().view("<u4").astype(np.int64)  # [n, count]


def _nibbles(blocks: np.ndarray, start: int, count: int = 4) -> np.ndarray:
    b = blocks[:, start:start + count].astype(np.int64)  # [n, count]: two 4-bit scales a byte, low first
    return np.stack([b & 15, b >> 4], axis=2).reshape(-1, 2 * count)  # [n, 2 count]


def _signed(levels: tuple[int, ...]) -> tuple[int, ...]:
    return (*levels, *(-v for v in levels))


def _iq1_m_d(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M's fp16 d [n, 1]: the top nibbles of its 4 uint16 scales, lowest first."""
    return ((_u16(blocks, 48, 4) >> 12) << (4 * np.arange(4))).sum(axis=1, keepdims=True).astype("<u2").view(np.float16)


def _iq1_m_scales(blocks: np.ndarray) -> np.ndarray:
    s = _u16(blocks, 48, 4)  # [n, 4]: 3-bit scales at bits 0, 3, 6, 9
    return 1 + 2 * ((s[:, :, None] >> (3 * np.arange(4))) & 7).reshape(-1, 16)


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    return 1 + 2 * _nibbles(blocks, start, 8)  # [n, 16]: a 4-bit scale per 16 values, two a byte


@dataclass(frozen=True)
class Recoding:
    """How one GGUF type maps onto IQ4_XS (XS16): its block bytes, where its fp16 ``d`` sits (None: IQ1_M's),
    ``d' = d / d_divisor``, the 16-entry table (shorter tables padded with their first entry) and its ``sc`` per 32
    values (per 16: XS16) from the blocks [n, bytes]."""

    block_bytes: int
    d_offset: int | None
    d_divisor: int
    levels: tuple[int, ...]
    scales: Callable[[np.ndarray], np.ndarray]  # blocks [n, bytes] uint8 -> sc [n, 8] (XS16: [n, 16]) int64
    halves: bool = False

    def d(self, blocks: np.ndarray) -> np.ndarray:
        """The blocks' fp16 d [n, 1]."""
        if self.d_offset is None:
            return _iq1_m_d(blocks)
        return blocks[:, self.d_offset:self.d_offset + 2].copy().view(np.float16)

    @property
    def table(self) -> tuple[int, ...]:
        return self.levels + (self.levels[0],) * (16 - len(self.levels))


RECODINGS: dict[str, Recoding] = {
    "IQ3_XXS": Recoding(98, 0, 2, _signed((2, 6, 10, 14, 18, 22, 26, 31)), lambda b: 1 + 2 * (_u32(b, 66, 8) >> 28)),
    "IQ3_S": Recoding(110, 0, 1, _signed((1, 3, 5, 7, 9, 11, 13, 15)), lambda b: 1 + 2 * _nibbles(b, 106)),
    "IQ2_XXS": Recoding(66, 0, 8, _signed((8, 25, 43)), lambda b: 1 + 2 * (_u32(b, 2, 16)[:, 1::2] >> 28)),
    "IQ1_S": Recoding(50, 0, 8, (-9, -7, -1, 1, 7, 9), lambda b: 1 + 2 * ((_u16(b, 34, 8) >> 12) & 7)),
    "TQ1_0": Recoding(54, 52, 1, (-1, 0, 1, 2), lambda b: np.ones((b.shape[0], 8), dtype=np.int64)),
    "TQ2_0": Recoding(66, 64, 1, (-1, 0, 1, 2), lambda b: np.ones((b.shape[0], 8), dtype=np.int64)),
    "IQ2_XS": Recoding(74, 0, 8, _signed((8, 25, 43)), lambda b: _halves(b, 66), halves=True),
    "IQ2_S": Recoding(82, 0, 8, _signed((8, 25, 43)), lambda b: _halves(b, 74), halves=True),
    "IQ1_M": Recoding(56, None, 8, (-9, -7, -1, 1, 7, 9), _iq1_m_scales, halves=True),
}


def recode_rows(qtype: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF rows of ``qtype`` (a key of :data:`RECODINGS`) [N, nsb * block_bytes] uint8 -> IQ4_XS rows
    [N, nsb * 136] (XS16 rows [N, nsb * 146] for the types with ``halves``) uint8 that, read with
    ``RECODINGS[qtype].table``, decode to the same values (``d'`` rounded to fp16: exact but where d' is subnormal).
    Raises ValueError for another type or shape."""
    if qtype not in RECODINGS:
        raise ValueError(f"recoded types are {', '.join(RECODINGS)}, got {qtype}")
    rc = RECODINGS[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % rc.block_bytes:
        raise ValueError(f"{qtype} rows must be uint8 [N, nsb * {rc.block_bytes}], got {raw.dtype} {list(raw.shape)}")
    n_rows = raw.shape[0]
    blocks = raw.contiguous().numpy().reshape(-1, rc.block_bytes)  # [n, B]
    n, groups = blocks.shape[0], 16 if rc.halves else 8  # scale groups of 256 values
    values = dequantize(blocks, GGMLQuantizationType[qtype]).reshape(n, groups, -1)  # [n, groups, 16 or 32] float32
    d = rc.d(blocks).astype(np.float32)  # [n, 1]
    sc = rc.scales(blocks)  # [n, groups]
    unit = d / rc.d_divisor * sc  # [n, groups]: d' sc
    with np.errstate(divide="ignore", invalid="ignore"):
        level = np.rint(np.where(unit[..., None] != 0, values / unit[..., None], 0))  # [n, groups, values]
    table = np.array(rc.table)
    grid = np.arange(-64, 65)  # the levels a value can reach, each to its nearest table entry
    code_of = np.abs(grid[:, None] - table[None, :]).argmin(axis=1).astype(np.uint8)  # [129]
    codes = code_of[np.clip(level, -64, 64).astype(np.int64) + 64].reshape(n, 8, 32)  # [n, j, 32]
    nibbles = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, 128)  # low nibbles: values 0-15 of 32
    d_new = (d / rc.d_divisor).astype(np.float16).view(np.uint8)  # [n, 2]
    if rc.halves:
        return torch.from_numpy(np.concatenate([d_new, sc.astype(np.uint8), nibbles], axis=1).reshape(n_rows, -1))
    ls = sc + 32  # [n, j]: IQ4_XS's 6-bit scales
    out = np.empty((n, IQ4_XS_BYTES), dtype=np.uint8)
    out[:, 0:2] = d_new
    out[:, 2:4] = (((ls >> 4) & 3) << (2 * np.arange(8))).sum(axis=1).astype("<u2")[:, None].view(np.uint8)
    out[:, 4:8] = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    out[:, 8:] = nibbles
    return torch.from_numpy(out.reshape(n_rows, -1))


def grid_codes(qtype: str) -> torch.Tensor:
    """The grid of ``qtype`` (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M; from the ``gguf`` package) as each point's values' level
    indices: uint8 [entries, 4 or 8], the ``grid`` of the C++ op ``recode_gguf``; empty [0, 0] for TQ1_0 / TQ2_0."""
    cls = getattr(quants, qtype, None)
    if qtype not in RECODINGS or cls is None:
        raise ValueError(f"recoded types are {', '.join(RECODINGS)}, got {qtype}")
    if not cls.grid_map:
        return torch.empty(0, 0, dtype=torch.uint8)
    cls.init_grid()
    grid = cls.grid.reshape(cls.grid_shape)  # [entries, width] float32: the grid's values
    return torch.from_numpy(np.searchsorted(np.array(cls.grid_map, dtype=np.float32), grid).astype(np.uint8))
