"""qgemm's AVX512-VNNI tiles (Q4_1, Q4_0, Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, the
types recoded as IQ4_XS or XS16 records; and F16 / BF16, whose tiles take 8 activation rows there) give bit for bit what its
AVX2 tiles give; so do the attention ops' AVX-512 parts (a prefill's chunks).

The same inputs run in a subprocess with ``KVGEN_KERNELS_ISA=avx2``; skipped where the CPU lacks AVX512-VNNI (both
runs would take the AVX2 tiles) or the C++ kernels are not built.
"""

from __future__ import annotations

import itertools

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvgen.kernels import get_ops, kernel_isa, pack_gguf_rows, pack_gguf_segments
from kvgen.kernels.reference import quantize_kv_rows

needs_vnni = pytest.mark.skipif(kernel_isa() != "avx512vnni", reason=f"qgemm runs {kernel_isa()} tiles here")
# N not a multiple of 8 (a padded last group), K of 3 blocks (K-quants: 1 super-block), M across the 1-4 row tiles,
# the 8-row ones and what follows them (from 8 rows, groups of the types with a pair tile go two at a time, an odd last
# one alone)
SHAPES = [(37, 96, m) for m in (1, 2, 3, 4, 5, 8, 9, 14)] + [(64, 576, 17)]
# the types the gguf package cannot quantize: random blocks (indices and scales included) with fp16 d (and dmin) near
# 1e-3 (values and bytes per block, offsets of the fp16 scales)
RANDOM_BLOCKS = {"Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)),
                 "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
                 "IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,)), "IQ3_XXS": (256, 98, (0,)),
                 "IQ3_S": (256, 110, (0,)), "IQ2_XXS": (256, 66, (0,)), "IQ1_S": (256, 50, (0,)),
                 "TQ1_0": (256, 54, (52,)), "TQ2_0": (256, 66, (64,)), "IQ2_XS": (256, 74, (0,)),
                 "IQ2_S": (256, 82, (0,)), "IQ1_M": (256, 56, ())}  # IQ1_M: d in its scales' top nibbles (_rows)


def _run_avx2(cases: list, tmp_path: Path, script: str | None = None) -> list[torch.Tensor]:
    """``script`` (default: qgemm of each case (x, packed, weight_type, n)) in a subprocess on the AVX2 tiles."""
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "KVGEN_KERNELS_ISA": "avx2"}
    subprocess.run([sys.executable, "-c", script or AVX2_RUN, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                   env=env, check=True, capture_output=True)
    return torch.load(tmp_path / "avx2.pt")


def _rows(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """GGUF rows [n, bytes] uint8 of ``qtype``: a random 16-bit matrix's bytes, gguf's quantization of a random
    matrix, or random K-quant blocks."""
    if qtype in ("F16", "BF16"):
        return torch.randn(n, k, generator=gen).to(getattr(torch, "float16" if qtype == "F16" else "bfloat16")).view(
            torch.uint8)
    if qtype not in RANDOM_BLOCKS:
        return torch.tensor(quantize((torch.randn(n, k, generator=gen) * 3).numpy(), getattr(GGMLQuantizationType, qtype)))
    values, size, offsets = RANDOM_BLOCKS[qtype]
    blocks = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, generator=gen)
    for at in offsets:
        blocks[..., at : at + 2] = (torch.randn(n, k // values, 1, generator=gen) * 1e-3).half().view(torch.uint8)
    if qtype == "IQ1_M":  # d = 0x1C00 (2^-8): nibble j of its bits tops the j-th uint16 scale (bytes 48-55)
        blocks[..., 49:56:2] = (blocks[..., 49:56:2] & 0x0F) | torch.tensor([0x00, 0x00, 0xC0, 0x10], dtype=torch.uint8)
    return blocks.reshape(n, -1)
AVX2_RUN = """
import sys, torch
from kvgen.kernels import get_ops, kernel_isa
assert kernel_isa() == "avx2", kernel_isa()
cases = torch.load(sys.argv[1])
torch.save([get_ops().qgemm(x, packed, wt, n, None) for x, packed, wt, n in cases], sys.argv[2])
"""


@needs_vnni
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                   "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16", "IQ3_XXS", "IQ3_S", "IQ2_XXS",
                                   "IQ1_S", "TQ1_0", "TQ2_0", "IQ2_XS", "IQ2_S", "IQ1_M"])
def test_vnni_tiles_equal_the_avx2_tiles(qtype: str, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, k, m in SHAPES:
        k = -(-k // 256) * 256 if RANDOM_BLOCKS.get(qtype, (32,))[0] == 256 else k  # whole super-blocks
        weight_type, packed = pack_gguf_rows(qtype, [_rows(qtype, n, k, gen)])
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10  # [M, K], rows of mixed scale
        cases.append((x, packed, weight_type, n))
    ours = [get_ops().qgemm(x, packed, wt, n, None) for x, packed, wt, n in cases]  # [M, N] each
    for (x, *_), a, b in zip(cases, ours, _run_avx2(cases, tmp_path)):
        assert torch.equal(a, b), (qtype, list(x.shape), (a - b).abs().max())


@needs_vnni
def test_paired_groups_of_a_mixed_weight_equal_the_avx2_tiles(tmp_path: Path) -> None:
    """Stacked weights of Q4_0 (3 groups: a pair, then one alone, as a pair never spans two parts), Q4_K (2 groups) and
    Q6_K (1, partial) rows, and of Q4_1 (3), Q4_K (2) and Q6_K (3) rows, at M = 8 / 9 / 16 / 23 (pairs of 8-row
    tiles, then the rest): the AVX2 tiles' bits, and each row alone gives its row of the batch."""
    gen = torch.Generator().manual_seed(1)
    cases = []
    for parts in ([("Q4_0", 24), ("Q4_K", 16), ("Q6_K", 5)], [("Q4_1", 24), ("Q4_K", 16), ("Q6_K", 20)]):
        weight_type, packed = pack_gguf_segments([(q, _rows(q, n, 256, gen)) for q, n in parts])
        n = sum(rows for _, rows in parts)
        cases += [(torch.randn(m, 256, generator=gen) * 3, packed, weight_type, n) for m in (8, 9, 16, 23)]
    ours = [get_ops().qgemm(x, p, wt, n, None) for x, p, wt, n in cases]  # [M, N] each
    for (x, p, wt, n), a, b in zip(cases, ours, _run_avx2(cases, tmp_path)):
        assert torch.equal(a, b), (list(x.shape), (a - b).abs().max())
        assert torch.equal(a, torch.cat([get_ops().qgemm(x[i : i + 1], p, wt, n, None) for i in range(x.shape[0])]))


ATTENTION_RUN = """
import sys, torch
from kvgen.kernels import get_ops, kernel_isa
assert kernel_isa() == "avx2", kernel_isa()
cases = torch.load(sys.argv[1])
torch.save([getattr(get_ops(), op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]) for op, args in cases],
           sys.argv[2])
"""


def _attention_cases(gen: torch.Generator) -> list[tuple[str, list]]:
    """(op, args) of prefills: static_attention over group sizes 1-10 (every AVX-512 dots and P V template, and the
    any-G paths), head dims 64 / 72 / 80 / 128 (72: a last 8 columns), float16 and float32 caches, a window, a softcap,
    sinks, left padding; paged_attention_qkv of two sequences' chunks; attention on q, k, v. From 64 (query, KV head)
    pairs a prefill's queries run in groups of up to 8 // G a pass (G <= 4): the float32 cache, the padding, the
    paged chunks, a window and the group sizes 1, 2, 3 and 4 among them. Then decode steps (one query a sequence, its
    keys prefetched): static over 3 chunks, paged over 3 and 24 sequences; and int8 caches (paged decodes, a
    prefill in groups, D 72 with a softcap and sinks, a static decode over 3 chunks)."""
    cases: list[tuple[str, list]] = []
    for h, h_kv, d, t, past, dtype, window, softcap, with_sinks in [
            (9, 3, 64, 37, 0, torch.float16, 0, 0.0, False), (8, 8, 80, 13, 5, torch.float32, 0, 0.0, False),
            (32, 4, 128, 20, 300, torch.float16, 0, 0.0, False), (12, 2, 64, 9, 10, torch.float16, 16, 0.0, False),
            (16, 2, 72, 5, 3, torch.float16, 0, 50.0, False), (40, 4, 128, 3, 600, torch.float16, 0, 0.0, False),
            (14, 2, 64, 11, 270, torch.float16, 0, 0.0, True), (10, 2, 96, 6, 2, torch.float32, 0, 0.0, False),
            (12, 2, 64, 4, 1, torch.float16, 0, 0.0, False), (2, 1, 64, 300, 0, torch.float16, 0, 0.0, False),
            # groups of queries (64 pairs or more, G <= 4): a window that cuts the later queries apart, D = 72 with a
            # softcap and sinks, a query whose 257th key opens a chunk the one before it (256 keys) lacks
            (4, 2, 64, 40, 10, torch.float16, 16, 0.0, False), (4, 2, 72, 40, 3, torch.float16, 0, 50.0, True),
            (2, 1, 64, 70, 201, torch.float16, 0, 0.0, False)]:
        k, v = (torch.randn(1, h_kv, past + t + 3, d, generator=gen).to(dtype) for _ in range(2))
        qkv = torch.randn(t, (h + 2 * h_kv) * d, generator=gen)  # [T, (H + 2 Hkv) D]
        sinks = torch.randn(h, generator=gen) if with_sinks else None
        cases.append(("static_attention", [qkv, k, v, None, past, h, d ** -0.5, window, softcap, sinks]))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :7] = False  # row 0 left-padded
    k, v = (torch.randn(2, 2, 48, 64, generator=gen).half() for _ in range(2))
    cases.append(("static_attention", [torch.randn(2 * 25, 10 * 64, generator=gen), k, v, mask, 15, 6, 0.125, 0, 0.0,
                                       None]))
    k1, v1 = (torch.randn(2, 4, 48, 64, generator=gen).half() for _ in range(2))  # G = 1: groups of 8 queries
    cases.append(("static_attention", [torch.randn(2 * 25, 12 * 64, generator=gen), k1, v1, mask, 15, 4, 0.125, 0, 0.0,
                                       None]))
    bs, h, h_kv, d = 16, 8, 2, 64  # sequence 0: 40 cached + 30 new tokens; 1: 20 new
    tables, seq_lens, qsl = torch.tensor([[3, 0, 5, 7, 9], [2, 4, 0, 0, 0]]), torch.tensor([70, 20]), torch.tensor([0, 30, 50])
    positions = [(0, p) for p in range(40, 70)] + [(1, p) for p in range(20)]
    slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for r, p in positions])  # [N]
    pools = [torch.randn(12, h_kv, bs, d, generator=gen).half() for _ in range(2)]  # K, V [blocks, Hkv, bs, D]
    cases.append(("paged_attention_qkv", [torch.randn(50, (h + 2 * h_kv) * d, generator=gen), *pools, slots, tables, qsl,
                                          seq_lens, h, 0.125, 0, 0.0, None]))
    q, k, v = torch.randn(2, 6, 21, 64, generator=gen), *(torch.randn(2, 3, 30, 64, generator=gen) for _ in range(2))
    cases.append(("attention", [q, k, v, None, 9, 0.125, 0, 0.0, None]))
    for dtype in (torch.float16, torch.float32):  # decode steps (their keys prefetched): static, over 3 chunks
        k, v = (torch.randn(1, 3, 700, 64, generator=gen).to(dtype) for _ in range(2))
        cases.append(("static_attention", [torch.randn(1, 15 * 64, generator=gen), k, v, None, 600, 9, 0.125, 0, 0.0,
                                           None]))
    for num_seqs in (3, 24):  # paged: chunks as tasks (3 sequences), whole pairs as tasks (24 x 3 KV heads)
        lens = torch.randint(1, 300, (num_seqs,), generator=gen)
        blocks = [(int(n) + bs - 1) // bs for n in lens]
        tables = torch.zeros(num_seqs, max(blocks), dtype=torch.long)
        order = torch.randperm(sum(blocks), generator=gen)
        for r, start in enumerate(itertools.accumulate([0, *blocks[:-1]])):
            tables[r, : blocks[r]] = order[start : start + blocks[r]]
        slots = torch.tensor([int(tables[r, (int(n) - 1) // bs]) * bs + (int(n) - 1) % bs for r, n in enumerate(lens)])
        pools = [torch.randn(sum(blocks), 3, bs, 64, generator=gen).half() for _ in range(2)]
        cases.append(("paged_attention_qkv", [torch.randn(num_seqs, 15 * 64, generator=gen), *pools, slots, tables,
                                              torch.arange(num_seqs + 1), lens, 9, 0.125, 0, 0.0, None]))
        # the same over int8 pools (values, then scales: reference.quantize_kv_rows)
        (k8, ks), (v8, vs) = (quantize_kv_rows(p.float()) for p in pools)
        cases.append(("paged_attention_qkv", [torch.randn(num_seqs, 15 * 64, generator=gen), k8, v8, slots, tables,
                                              torch.arange(num_seqs + 1), lens, 9, 0.125, 0, 0.0, None, ks, vs]))
    # int8 caches: a prefill in groups (G 3), one with D 72, a softcap and sinks, a decode over 3 chunks
    for h, h_kv, d, t, past, softcap, with_sinks in [(9, 3, 64, 37, 0, 0.0, False), (4, 2, 72, 40, 3, 50.0, True),
                                                     (9, 3, 64, 1, 600, 0.0, False)]:
        (k8, ks), (v8, vs) = (quantize_kv_rows(torch.randn(1, h_kv, past + t + 3, d, generator=gen)) for _ in range(2))
        qkv = torch.randn(t, (h + 2 * h_kv) * d, generator=gen)
        sinks = torch.randn(h, generator=gen) if with_sinks else None
        cases.append(("static_attention", [qkv, k8, v8, None, past, h, d ** -0.5, 0, softcap, sinks, ks, vs]))
    return cases


@needs_vnni
def test_attention_on_avx512_equals_avx2(tmp_path: Path) -> None:
    """A prefill's attention on the AVX-512 parts (two 8-lane vectors per register) gives the AVX2 parts' bits."""
    cases = _attention_cases(torch.Generator().manual_seed(2))
    ours = [getattr(get_ops(), op)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]) for op, args in cases]
    for (op, args), a, b in zip(cases, ours, _run_avx2(cases, tmp_path, ATTENTION_RUN)):
        assert a.abs().sum() > 0 and torch.equal(a, b), (op, [getattr(x, "shape", x) for x in args[:6]], (a - b).abs().max())
