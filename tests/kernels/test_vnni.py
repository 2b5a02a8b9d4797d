"""qgemm's AVX512-VNNI tiles (Q4_1, Q4_0, Q8_0) give bit for bit what its AVX2 tiles give.

The same inputs run in a subprocess with ``KVGEN_KERNELS_ISA=avx2``; skipped where the CPU lacks AVX512-VNNI (both
runs would take the AVX2 tiles) or the C++ kernels are not built.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvgen.kernels import get_ops, kernel_isa, pack_gguf_rows

needs_vnni = pytest.mark.skipif(kernel_isa() != "avx512vnni", reason=f"qgemm runs {kernel_isa()} tiles here")
# N not a multiple of 8 (a padded last group), K of 3 blocks, M across the 1-4 row tiles and past them
SHAPES = [(37, 96, m) for m in (1, 2, 3, 4, 5, 9)] + [(64, 576, 17)]
AVX2_RUN = """
import sys, torch
from kvgen.kernels import get_ops, kernel_isa
assert kernel_isa() == "avx2", kernel_isa()
cases = torch.load(sys.argv[1])
torch.save([get_ops().qgemm(x, packed, wt, n, None) for x, packed, wt, n in cases], sys.argv[2])
"""


@needs_vnni
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_vnni_tiles_equal_the_avx2_tiles(qtype: str, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, k, m in SHAPES:
        raw = quantize((torch.randn(n, k, generator=gen) * 3).numpy(), getattr(GGMLQuantizationType, qtype))
        weight_type, packed = pack_gguf_rows(qtype, [torch.tensor(raw)])
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10  # [M, K], rows of mixed scale
        cases.append((x, packed, weight_type, n))
    ours = [get_ops().qgemm(x, packed, wt, n, None) for x, packed, wt, n in cases]  # [M, N] each
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "KVGEN_KERNELS_ISA": "avx2"}
    subprocess.run([sys.executable, "-c", AVX2_RUN, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
                   env=env, check=True, capture_output=True)
    theirs = torch.load(tmp_path / "avx2.pt")
    for (x, *_), a, b in zip(cases, ours, theirs):
        assert torch.equal(a, b), (qtype, list(x.shape), (a - b).abs().max())
