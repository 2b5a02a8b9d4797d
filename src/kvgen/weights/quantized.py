"""GGUF tensors kept in their file encoding, for the quantized fast path.

``load_gguf(..., dtype=None)`` (``--dtype auto``) returns a :class:`GGUFBlocks` instead of
a dense tensor for every matrix stored in a quantized type, so nothing is dequantized
to float32 in memory. ``build_model`` turns them into ``QuantLinear`` /
``QuantEmbedding`` modules (kernels' 8-row layouts, ``kvgen.kernels.pack``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvgen.weights.name_maps import is_router_weight

Q = GGMLQuantizationType
# Types our kernels run from their own bytes (F16, BF16: in a file of float matrices; MXFP4 when its scales fit
# float16, mxfp4_fits_float16; IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ1_0 and TQ2_0 recoded value for value as IQ4_XS
# records at load, IQ2_XS, IQ2_S and IQ1_M as XS16 records, kernels/recode.py); F32 matrices (and 16-bit ones in a
# quantized file: gguf_loader) are converted to Q8_0.
FLOAT16_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F16, Q.BF16})
KERNEL_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
    Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ1_S, Q.TQ1_0, Q.TQ2_0, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M,
}) | FLOAT16_TYPES


_SEGMENT_TYPES = KERNEL_TYPES - FLOAT16_TYPES  # parts a mixed stack keeps as they are (they share quantized activations)


@dataclass
class GGUFBlocks:
    """One matrix in a GGUF block encoding.

    qtype: one of KERNEL_TYPES; parts: row blocks [rows_i, bytes per row] uint8 whose
    rows, in order, are the matrix's (one block unless stacked; rows in torch order, q/k
    rows already un-permuted); shape: (out_features, in_features). part_types: empty, or each part's own type
    when a stack mixes them (then ``qtype`` is the first part's; ``kernels.pack_gguf_segments`` runs them).
    release: what to call once the parts are packed (parts that view a memory-mapped file: dropping its pages
    from the resident set, ``gguf_loader``); empty for parts of their own.
    """

    qtype: GGMLQuantizationType
    parts: list[torch.Tensor]
    shape: tuple[int, int]
    part_types: tuple[GGMLQuantizationType, ...] = ()
    release: tuple[Callable[[], None], ...] = ()

    def __post_init__(self) -> None:
        if self.qtype not in KERNEL_TYPES:
            kinds = ", ".join(sorted(t.name for t in KERNEL_TYPES))
            raise ValueError(f"GGUFBlocks holds {kinds}, got {self.qtype.name}")
        if any(p.dtype != torch.uint8 or p.dim() != 2 for p in self.parts) or sum(p.shape[0] for p in self.parts) != self.shape[0]:
            raise ValueError(f"parts must be uint8 [rows, bytes] adding up to {self.shape[0]} rows")
        if self.part_types and len(self.part_types) != len(self.parts):
            raise ValueError(f"part_types names {len(self.part_types)} types for {len(self.parts)} parts")


def stack_blocks(parts: list[GGUFBlocks]) -> GGUFBlocks:
    """Concatenate matrices along their rows (vLLM's stacked q/k/v, gate/up).

    Parts of one type are joined byte for byte (no copy here: the kernels' repacking reads
    the row blocks in order). Parts of different quantized types (a Q4_K_M file's Q4_K q, k beside a Q6_K v) stay
    as they are, named in ``part_types``, when every part but the last has a multiple of 8 rows (whole row groups of
    the kernels' mixed weight); otherwise, or with 16-bit parts, all are converted to Q8_0 (from their exact
    dequantized values) so one kernel serves the stacked matrix.
    """
    in_features = parts[0].shape[1]
    if any(p.shape[1] != in_features for p in parts):
        raise ValueError(f"cannot stack matrices with in_features {[p.shape[1] for p in parts]}")
    shape = (sum(p.shape[0] for p in parts), in_features)
    if len({p.qtype for p in parts}) > 1:
        whole_groups = all(p.shape[0] % 8 == 0 for p in parts[:-1]) and all(len(p.parts) == 1 for p in parts)
        if whole_groups and all(p.qtype in _SEGMENT_TYPES for p in parts) and len(parts) <= 3:
            return GGUFBlocks(parts[0].qtype, [p.parts[0] for p in parts], shape, tuple(p.qtype for p in parts),
                              tuple(r for p in parts for r in p.release))
        releases = tuple(r for p in parts for r in p.release)
        parts = [to_q8_0(p) for p in parts]
        return GGUFBlocks(parts[0].qtype, [r for p in parts for r in p.parts], shape, release=releases)
    return GGUFBlocks(parts[0].qtype, [r for p in parts for r in p.parts], shape,
                      release=tuple(r for p in parts for r in p.release))


def to_q8_0(blocks: GGUFBlocks) -> GGUFBlocks:
    """The same matrix re-encoded as Q8_0 (a no-op for Q8_0)."""
    if blocks.qtype == Q.Q8_0:
        return blocks
    from gguf.quants import dequantize

    raw = torch.cat(blocks.parts) if len(blocks.parts) > 1 else blocks.parts[0]
    dense = torch.from_numpy(dequantize(raw.numpy(), blocks.qtype))  # [out, in] float32
    return dense_to_q8_0(dense)


def dense_to_q8_0(w: torch.Tensor) -> GGUFBlocks:
    """A float matrix [out, in] (in % 32 == 0) encoded as Q8_0 (llama.cpp's reference rounding)."""
    from kvgen.kernels.reference import quantize_q8_0

    return GGUFBlocks(Q.Q8_0, [quantize_q8_0(w)], (w.shape[0], w.shape[1]))


# ``quantization`` (load_model, EngineArgs, --quantization): float matrices encoded at load in one of these
# llama.cpp types, each run by its kernel. vLLM's knob of the same name; llama.cpp's `llama-quantize` types.
QUANTIZATIONS: dict[str, GGMLQuantizationType] = {
    "q8_0": Q.Q8_0, "q5_1": Q.Q5_1, "q5_0": Q.Q5_0, "q4_1": Q.Q4_1, "q4_0": Q.Q4_0,
}
# Names of the token embedding and the LM head (our state dict): Q8_0 under a 4- or 5-bit quantization
# (llama.cpp's quantize keeps its output matrix at a higher precision too; the default model's Q4_1 file holds its
# tied embedding as Q8_0).
_VOCAB_MATRICES = ("model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight")
# Matrices no linear layer reads, left dense: GPT-2's learned position embeddings (a lookup of T rows a step).
_DENSE_MATRICES = ("transformer.wpe.weight",)
_QUANTIZE_CHUNK_VALUES = 1 << 20  # float32 values quantized per step (4 MiB; the quantizer makes a few copies)


def parse_quantization(quantization: str | None) -> GGMLQuantizationType | None:
    """``quantization`` as its GGUF type: None for None; ``ValueError`` naming the choices for anything else."""
    if quantization is None:
        return None
    qtype = QUANTIZATIONS.get(str(quantization).lower())
    if qtype is None:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), got {quantization!r}")
    return qtype


def is_quantizable(name: str) -> bool:
    """Whether ``quantization`` encodes the 2-D parameter ``name`` (every matrix but routers and position tables)."""
    return not is_router_weight(name) and name not in _DENSE_MATRICES


def quantize_matrix(name: str, w: torch.Tensor, qtype: GGMLQuantizationType) -> GGUFBlocks:
    """The float matrix ``name`` [out, in] (in % 32 == 0) encoded as ``qtype`` by the gguf package's quantizers
    (llama.cpp's ``quantize_row_*_ref`` rounding); the embedding and LM head as Q8_0 under a 4- or 5-bit type.
    ``ValueError`` for a matrix holding NaN or inf, or values so large that a block's float16 scale overflows
    (llama.cpp's quantizer refuses both: ``ggml_validate_row_data``, "quantized data validation failed")."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    if name in _VOCAB_MATRICES:
        qtype = Q.Q8_0
    out_features, in_features = w.shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.empty(out_features, in_features // block_size * type_size, dtype=torch.uint8)  # [out, bytes]
    step = max(1, _QUANTIZE_CHUNK_VALUES // in_features)  # rows per step: bounds the quantizer's float temporaries
    for r in range(0, out_features, step):
        rows = w[r:r + step].float().contiguous()  # [step, in] float32
        if not torch.isfinite(rows).all():
            raise ValueError(f"{name} holds NaN or inf values: it cannot be quantized as {qtype.name.lower()}")
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing scale: _check_scales says so
            raw[r:r + step] = torch.from_numpy(quantize(rows.numpy(), qtype))
        _check_scales(name, raw[r:r + step], qtype, float(rows.abs().max()))
    return GGUFBlocks(qtype, [raw], (out_features, in_features))


def _check_scales(name: str, raw: torch.Tensor, qtype: GGMLQuantizationType, amax: float) -> None:
    """``ValueError`` unless every block of ``raw`` [rows, bytes] uint8 (``qtype``) has finite float16 fields d (and
    m, for Q4_1, Q5_1): the leading 2 (4) bytes of each block."""
    from gguf.constants import GGML_QUANT_SIZES

    num_scale_bytes = 4 if qtype in (Q.Q4_1, Q.Q5_1) else 2
    scales = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, :num_scale_bytes].contiguous().view(torch.float16)
    if not torch.isfinite(scales).all():
        raise ValueError(f"{name} holds values up to {amax:g} in magnitude: their {qtype.name.lower()} block scale "
                         "overflows float16")


def mxfp4_fits_float16(raw: torch.Tensor) -> bool:
    """Whether every block scale 2^(e - 128) of GGUF MXFP4 rows [rows, nb * 17] uint8 is exact in float16 (the
    kernels' MXFP4 record; ``reference.MXFP4_EXPONENTS``); files whose scales are not are re-encoded as Q8_0."""
    from kvgen.kernels.reference import MXFP4_EXPONENTS

    e = raw.reshape(-1, 17)[:, 0]  # [blocks]: the E8M0 exponents
    if e.numel() == 0:
        return True
    low, high = torch.aminmax(e)  # one pass over the strided bytes
    return MXFP4_EXPONENTS[0] <= int(low) <= int(high) <= MXFP4_EXPONENTS[1]
