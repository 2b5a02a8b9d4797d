"""kvgen's CPU kernels: C++ (AVX2 + FMA + F16C) torch custom ops, built on first use.

The sources in ``csrc/`` are compiled once by ``torch.utils.cpp_extension`` (g++,
``-O3 -mavx2 -mfma -mf16c -fopenmp``, ninja) into a persistent cache,
``$KVGEN_CACHE_DIR`` or ``~/.cache/kvgen/kernels/<hash>``, keyed by the sources, the
flags and the torch version; later processes load the cached library in milliseconds.
Where the CPU lacks AVX2/FMA/F16C, the build fails, or ``KVGEN_KERNELS=reference`` is
set, the plain-torch twins in :mod:`kvgen.kernels.reference` run instead (one logged
notice, never a crash). :func:`get_ops` returns whichever is in use.

Ops (``torch.ops.kvgen.*``, same signatures in the reference):

* ``qgemm(x [M, K] f32, weight [G, nb, R] u8, weight_type, out_features, bias?) -> [M, N] f32``
* ``quantize_q8a(x [M, K] f32) -> [M, K / 32 * 40] u8``
* ``dequantize_rows(weight, weight_type, ids [n] i64, in_features) -> [n, K] f32``
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvgen.kernels import reference

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "quantize_q8a.cpp", "qgemm_q4.cpp", "qgemm_q8.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
Q4, Q8 = reference.Q4, reference.Q8


@dataclass(frozen=True)
class KernelOps:
    """The op implementations in use: ``backend`` is ``"avx2"`` or ``"reference"``."""

    backend: str
    qgemm: Callable[..., torch.Tensor]
    quantize_q8a: Callable[[torch.Tensor], torch.Tensor]
    dequantize_rows: Callable[..., torch.Tensor]


_REFERENCE = KernelOps("reference", reference.qgemm, reference.quantize_q8a, reference.dequantize_rows)
_ops: KernelOps | None = None


def cache_dir() -> Path:
    """Where the compiled library lives: ``$KVGEN_CACHE_DIR`` or ``~/.cache/kvgen``, then ``kernels/<hash>``."""
    root = Path(os.environ.get("KVGEN_CACHE_DIR") or Path.home() / ".cache" / "kvgen")
    digest = hashlib.sha256()
    for name in ("common.h", *SOURCES):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode() + torch.__version__.encode())
    return root / "kernels" / digest.hexdigest()[:16]


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _load_extension() -> None:
    """Load the cached library, building it first if absent (raises on failure)."""
    build = cache_dir()
    library = build / "kvgen_kernels.so"
    if not library.exists():
        from torch.utils import cpp_extension

        build.mkdir(parents=True, exist_ok=True)
        logger.warning("kvgen: compiling CPU kernels into %s (first run only, ~1 minute)", build)
        cpp_extension.load(
            name="kvgen_kernels",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
    else:
        torch.ops.load_library(str(library))


def get_ops() -> KernelOps:
    """The kernels to use in this process (built or loaded on the first call)."""
    global _ops
    if _ops is not None:
        return _ops
    reason = None
    if os.environ.get("KVGEN_KERNELS", "").lower() == "reference":
        reason = "KVGEN_KERNELS=reference"
    elif not _cpu_supported():
        reason = f"this CPU reports {torch.backends.cpu.get_cpu_capability()}, not AVX2"
    else:
        try:
            _load_extension()
        except Exception as exc:  # a missing compiler, a failed build: fall back, never crash
            reason = f"the C++ kernels could not be built ({type(exc).__name__}: {str(exc).strip()[:300]})"
    if reason is None:
        ops = torch.ops.kvgen
        _ops = KernelOps("avx2", ops.qgemm.default, ops.quantize_q8a.default, ops.dequantize_rows.default)
    else:
        logger.warning("kvgen: using the portable torch kernels (slow): %s", reason)
        _ops = _REFERENCE
    return _ops


def pack_gguf_rows(qtype: str, raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    """GGUF-encoded rows -> (weight_type, records [G, nb, R] uint8) in the kernels' 8-row layout.

    qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``; raw: [N, bytes per row] uint8.
    Raises ValueError for another type or a malformed byte count.
    """
    if qtype in ("Q4_0", "Q4_1"):
        return Q4, reference.repack_q4(raw, has_min=qtype == "Q4_1")
    if qtype == "Q8_0":
        return Q8, reference.repack_q8(raw)
    raise ValueError(f"kernels run Q4_0, Q4_1 and Q8_0 blocks, got {qtype}")


def reference_ops() -> KernelOps:
    """The plain-torch twins (the spec of every op)."""
    return _REFERENCE


__all__ = ["Q4", "Q8", "KernelOps", "cache_dir", "get_ops", "pack_gguf_rows", "reference_ops"]
