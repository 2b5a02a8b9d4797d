"""kvgen's CPU kernels: C++ (AVX2 + FMA + F16C) torch custom ops, built on first use.

The sources in ``csrc/`` are compiled once by ``torch.utils.cpp_extension`` (g++,
``-O3 -mavx2 -mfma -mf16c -fopenmp``, ninja) into a persistent cache,
``$KVGEN_CACHE_DIR`` or ``~/.cache/kvgen/kernels/<hash>``, keyed by the sources, the
flags and the torch version; later processes load the cached library in milliseconds.
Where the CPU lacks AVX2/FMA/F16C, the build fails, or ``KVGEN_KERNELS=reference`` is
set, the plain-torch twins in :mod:`kvgen.kernels.reference` run instead (one logged
notice, never a crash). :func:`get_ops` returns whichever is in use. On a CPU with AVX512-VNNI, qgemm's quantized
tiles use ``vpdpbusd`` and a prefill's attention 512-bit registers (chosen at run time; ``KVGEN_KERNELS_ISA=avx2``
keeps the AVX2 code; the outputs are bit-identical): :func:`kernel_isa` says which. A prefill's attention takes
consecutive queries of a sequence in groups, one pass over their keys (up to 8 heads on AVX-512, 6 on AVX2 where a KV
head has at most 2), each query's numbers those of the query alone.

Ops (``torch.ops.kvgen.*``, same signatures in the reference):

* ``qgemm(x [M, K] f32, weight [G, nb, R] u8, weight_type, out_features, bias?, residual?) -> [M, N] f32``
  (weight_type Q2, Q3, Q4, Q4_0, Q4_K, Q5, Q5_0, Q5_K, Q6, Q8, IQ4, IQ4_XS, MXFP4 and the recoded IQ3_XXS, IQ3_S,
  IQ2_XXS, IQ1_S, TQ, IQ2_XS, IQ1_M: x quantized per 32 values first; F16, BF16: x as it is; MIXED: a [bytes] weight
  of quantized segments, ``pack_gguf_segments``; Q2, Q3, Q4_K, Q5_K, Q6, IQ4_XS and the recoded types' weights are
  [G, K / 256, R]: one record per 256-column super-block)
* ``quantize_q8a(x [M, K] f32) -> [M, K / 32 * 40] u8``
* ``dequantize_rows(weight, weight_type, ids [n] i64, in_features) -> [n, K] f32``
* ``attention(q [B, H, T, D], k, v [B, Hkv, S, D], key_mask [B, S] bool?, past_len, scale) -> [B, T, H, D]``
* ``paged_attention(q [N, H, D], k_pool, v_pool [blocks, Hkv, block_size, D], block_tables [R, nb],
  query_start_loc [R+1], seq_lens [R], scale) -> [N, H, D]`` (K and V read at fp16 precision)
* ``static_attention(qkv [B*T, (H+2Hkv)D], k_cache, v_cache [B, Hkv, S_max, D], key_mask?, past_len, H, scale)
  -> [B*T, H*D]``: cache write + ``attention``
* ``paged_attention_qkv(qkv [N, W], k_pool, v_pool, slot_mapping [N], block_tables, query_start_loc, seq_lens, H,
  scale) -> [N, H*D]``: cache write + ``paged_attention``
* every attention op also takes ``window=0`` (> 0: a query at position p sees positions > p - window only; Gemma's
  sliding layers), ``softcap=0.0`` (> 0: scores become ``softcap * tanh(score / softcap)``; Gemma 2) and
  ``sinks=None`` ([H] float32: one more logit in each head's softmax, its probability dropped; gpt-oss)
* ``static_attention`` and ``paged_attention_qkv`` also take int8 caches (pools) with ``k_scale``, ``v_scale``
  (float32, the caches' shape without D: one scale per row): each row written as ``reference.quantize_kv_rows``
  (the same values and scales to the bit) and read as its values times its scale
* ``rms_norm(x [M, C], weight [C], eps) -> [M, C]``
* ``rms_norm_heads_(qkv [N, (H + 2 Hkv) D], q_weight [D], k_weight [D], eps, H, Hkv)``: in place on each q and k
  head (Qwen3's q_norm, k_norm)
* ``rope_qkv_(qkv [N, (H + 2 Hkv) D], cos [N, R], sin [N, R], H, Hkv)``: in place on the first R <= D dims of q and k
* ``silu_mul(gate_up [M, 2I]) -> [M, I]``: SwiGLU's gate; ``gelu_tanh_mul`` the same for GeGLU (Gemma),
  ``gpt_oss_glu`` for gpt-oss's clamped GLU
* ``decoder_layers(x [N, C], weights (6 per layer), linears (8 ints per layer), eps (3 per layer), extras (empty,
  or 8 per layer: 4 biases, q_norm, k_norm, post_attention_norm, post_feedforward_norm; each may be None),
  layer_args (empty, or 2 per layer: RoPE table (0: none, r: rope[2r-2], rope[2r-1]), window), rope (cos, sin
  [N, D] pairs), k_caches, v_caches [B, Hkv, S_max, D] per layer, key_mask?, past_len, H, Hkv, scale,
  activation (0 SwiGLU, 1 GeGLU), softcap (0.0: none), k_scales, v_scales (int8 caches' scales per layer, else
  empty)) -> [N, C]``: every Llama or Gemma decoder layer over a static cache in one op (each layer's ops above, in
  order)
* ``paged_decoder_layers(x, weights, linears, eps, extras, layer_args, rope, k_pools, v_pools, slot_mapping,
  block_tables, query_start_loc, seq_lens, H, Hkv, scale, activation, softcap, k_scales, v_scales) -> [N, C]``: the
  same over a paged cache (``paged_attention_qkv``)
* ``softmax_draw(logits [B, V] f32, temperature [B] f64, u [B] f64) -> [B] i64``: one id per row from
  softmax(logits / temperature) by inversion at u (the engine's draw, ``ops.sample_inverse_cdf``'s search)
* ``argmax(x [B, V] f32) -> [B] i64``: per row the first index of the largest value (of the first NaN, as
  ``torch.argmax``): the greedy token
* ``filter_draw(logits [B, V] f32, temperature, min_p, top_p [B] f64, top_k [B] i64, u [B] f64) -> [B] i64``: the
  engine's sampling stages (logits / temperature, min_p, top_k, top_p: ``ops``' warpers in vLLM's order) then the
  draw at temperature 1, per row; -1 for a row whose filters float32 rounding could decide otherwise (the caller
  runs the torch stages for it)
* ``moe_experts_row(h [1, C], gate_up [k] packed, gate_up_linears [2k], down [k] packed, down_linears [2k],
  expert_weights [k], biases [] or [2k], activation 0 | 1) -> [1, C]``: sum_j w_j * down_j(act(gate_up_j(h))) in the
  order given, each term rounded before its add (a decode step's routed experts in one op; ``linears``:
  (weight_type, out_features) pairs; act: silu_mul, or gpt_oss_glu for 1)
* ``linear_f64(x [N, C] f32, weight [E, C] f32, bias [E] f32?) -> [N, E] f32``: ``x @ weight.T + bias`` summed in
  float64 and rounded once, one fixed order per output (batch-invariant; mixture-of-experts routers)
* ``recode_gguf(raw [N, bytes] u8, ggml_type, grid u8) -> [N, bytes'] u8``: IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ1_0,
  TQ2_0 rows as IQ4_XS rows, IQ2_XS, IQ2_S, IQ1_M rows as XS16 rows, value for value (``recode.py``)
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from kvgen.kernels import recode, reference

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "ops.cpp", "quantize_q8a.cpp", "qgemm_q4.cpp", "qgemm_q5.cpp", "qgemm_q8.cpp", "qgemm_q6.cpp", "qgemm_f16.cpp",
    "qgemm_iq4.cpp", "qgemm_q23.cpp",
    "attention.cpp", "rms_norm.cpp", "rope.cpp", "glu.cpp", "repack.cpp", "decoder.cpp",
    "softmax_draw.cpp", "moe.cpp", "linear_f64.cpp", "recode.cpp",
)
HEADERS = ("common.h", "vec_math.h", "aten_lite.h", "ops.h", "team.h")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
Q4, Q8, F16, BF16, Q6, MIXED, Q5, IQ4, Q2, Q3, MXFP4, Q4_0, Q4_K, Q5_K, IQ4_XS, Q5_0 = (
    reference.Q4, reference.Q8, reference.F16, reference.BF16, reference.Q6, reference.MIXED, reference.Q5, reference.IQ4,
    reference.Q2, reference.Q3, reference.MXFP4, reference.Q4_0, reference.Q4_K, reference.Q5_K, reference.IQ4_XS,
    reference.Q5_0)
IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ = reference.IQ3_XXS, reference.IQ3_S, reference.IQ2_XXS, reference.IQ1_S, reference.TQ
IQ2_XS, IQ1_M = reference.IQ2_XS, reference.IQ1_M


@dataclass(frozen=True)
class KernelOps:
    """The op implementations in use: ``backend`` is ``"avx2"`` or ``"reference"``."""

    backend: str
    qgemm: Callable[..., torch.Tensor]
    quantize_q8a: Callable[[torch.Tensor], torch.Tensor]
    dequantize_rows: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    rms_norm_heads_: Callable[..., None]
    rope_qkv_: Callable[..., None]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]
    gpt_oss_glu: Callable[[torch.Tensor], torch.Tensor]
    repack_gguf: Callable[..., torch.Tensor]
    static_attention: Callable[..., torch.Tensor]
    paged_attention_qkv: Callable[..., torch.Tensor]
    decoder_layers: Callable[..., torch.Tensor]
    paged_decoder_layers: Callable[..., torch.Tensor]
    softmax_draw: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    filter_draw: Callable[..., torch.Tensor]
    argmax: Callable[[torch.Tensor], torch.Tensor]
    moe_experts_row: Callable[..., torch.Tensor]
    linear_f64: Callable[..., torch.Tensor]
    recode_gguf: Callable[..., torch.Tensor]


_NAMES = (
    "qgemm", "quantize_q8a", "dequantize_rows", "attention", "paged_attention", "rms_norm", "rms_norm_heads_",
    "rope_qkv_", "silu_mul", "gelu_tanh_mul", "gpt_oss_glu", "repack_gguf", "static_attention",
    "paged_attention_qkv", "decoder_layers", "paged_decoder_layers", "softmax_draw", "filter_draw", "argmax",
    "moe_experts_row", "linear_f64", "recode_gguf",
)
_REFERENCE = KernelOps("reference", *(getattr(reference, n) for n in _NAMES))
_ops: KernelOps | None = None


def _cflags() -> list[str]:
    """CFLAGS plus ``$KVGEN_KERNELS_CFLAGS`` (e.g. ``-fsanitize=address,undefined`` for a checked build)."""
    return [*CFLAGS, *os.environ.get("KVGEN_KERNELS_CFLAGS", "").split()]


def cache_dir() -> Path:
    """Where the compiled library lives: ``$KVGEN_CACHE_DIR`` or ``~/.cache/kvgen``, then ``kernels/<hash>``
    of the sources, the flags and the torch version."""
    root = Path(os.environ.get("KVGEN_CACHE_DIR") or Path.home() / ".cache" / "kvgen")
    digest = hashlib.sha256()
    for name in (*HEADERS, *SOURCES):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(_cflags()).encode() + torch.__version__.encode())
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
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp", *_cflags()[len(CFLAGS):]],
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
        except Exception as exc:  # noqa: BLE001 -- a missing compiler, a failed build: fall back, never crash
            reason = f"the C++ kernels could not be built ({type(exc).__name__}: {str(exc).strip()[:300]})"
    if reason is None:
        _ops = KernelOps("avx2", *(getattr(torch.ops.kvgen, n).default for n in _NAMES))
    else:
        logger.warning("kvgen: using the portable torch kernels (slow): %s", reason)
        _ops = _REFERENCE
    return _ops


def pack_gguf_rows(qtype: str, parts: list[torch.Tensor], empty: Callable[[tuple[int, ...]], torch.Tensor] | None = None
                   ) -> tuple[int, torch.Tensor]:
    """GGUF-encoded row blocks of one matrix -> (weight_type, records [G, nb, R] uint8) in the
    kernels' 8-row layout.

    qtype: one of ``reference.GGUF_TYPES`` (Q4_0, Q4_1, Q8_0, F16, BF16, Q6_K, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, MXFP4:
    exponents in ``reference.MXFP4_EXPONENTS`` only, Q4_K, Q5_K, IQ4_XS) or of ``reference.RECODED_TYPES`` (IQ3_XXS,
    IQ3_S, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0: recoded as IQ4_XS records first; IQ2_XS, IQ2_S, IQ1_M: as XS16 records;
    ``recode.py``);
    parts: [rows_i, bytes per row] uint8 each, stacked in order (q, k, v); empty: where the records go, given their
    shape (e.g. ``WeightArena.empty``; default: a new tensor). Raises ValueError for another type or a malformed
    byte count.
    """
    recoded = qtype in reference.RECODED_TYPES
    if qtype not in reference.GGUF_TYPES and not recoded:
        kinds = (*reference.GGUF_TYPES, *reference.RECODED_TYPES)
        raise ValueError(f"kernels run {', '.join(kinds)} rows, got {qtype}")
    size = recode.RECODINGS[qtype].block_bytes if recoded else reference.GGUF_BLOCK_BYTES[qtype]
    for p in parts:
        if p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] % size or p.shape[1] != parts[0].shape[1]:
            raise ValueError(f"{qtype} rows must be uint8 [N, nb * {size}], got {p.dtype} {list(p.shape)}")
    if recoded:
        weight_type, grid = reference.RECODED_TYPES[qtype], recode.grid_codes(qtype)
        ggml_type = GGMLQuantizationType[qtype].value
        parts = [get_ops().recode_gguf(p.contiguous(), ggml_type, grid) for p in parts]  # [rows_i, nsb * 136 or 146]
        halves = recode.RECODINGS[qtype].halves
        code, size = (reference.XS16_ROWS, recode.XS16_BYTES) if halves else (14, recode.IQ4_XS_BYTES)
    else:
        weight_type, code = reference.WEIGHT_TYPE_OF[qtype], reference.GGUF_TYPES.index(qtype)
    shape = ((sum(p.shape[0] for p in parts) + reference.ROWS - 1) // reference.ROWS,  # [G, nb, R]
             parts[0].shape[1] // size, reference.RECORD_BYTES[weight_type])
    out = None if empty is None else empty(shape)
    return weight_type, get_ops().repack_gguf([p.contiguous() for p in parts], code, out)


def pack_gguf_segments(segments: list[tuple[str, torch.Tensor]]) -> tuple[int, torch.Tensor]:
    """A stacked matrix whose parts have different GGUF types (e.g. Q4_K_M's Q4_K q, k and Q6_K v) -> (MIXED, one
    [bytes] uint8 weight): each part ``(qtype, rows [n_i, bytes] uint8)`` packed as :func:`pack_gguf_rows` into
    its own run of row groups, so one qgemm call (one activation quantization) serves them all.

    qtypes: the quantized ``reference.GGUF_TYPES``; every part but the last must have a multiple of 8 rows.
    Raises ValueError otherwise (and as :func:`pack_gguf_rows`)."""
    if not 1 <= len(segments) <= 3:
        raise ValueError(f"a mixed weight holds 1-3 segments, got {len(segments)}")
    packed = []
    for i, (qtype, rows) in enumerate(segments):
        if (qtype not in reference.GGUF_TYPES and qtype not in reference.RECODED_TYPES) or qtype in ("F16", "BF16"):
            kinds = ", ".join((*reference.GGUF_TYPES[:3], *reference.GGUF_TYPES[5:], *reference.RECODED_TYPES))
            raise ValueError(f"mixed weights hold quantized parts ({kinds}), got {qtype}")  # 16-bit: unquantized x
        if i < len(segments) - 1 and rows.shape[0] % reference.ROWS:
            raise ValueError(f"every part but the last needs a multiple of 8 rows, part {i} has {rows.shape[0]}")
        packed.append(pack_gguf_rows(qtype, [rows]))
    return MIXED, reference.pack_mixed(packed)


def kernel_isa() -> str:
    """The instruction set of qgemm's quantized tiles in this process: ``"avx512vnni"`` (the
    CPU has AVX512F, BW, VL and VNNI, and ``$KVGEN_KERNELS_ISA`` is not ``"avx2"``), ``"avx2"``, or ``"reference"``
    (the torch twins). Both C++ paths give bit-identical outputs (``csrc/common.h``)."""
    if get_ops().backend != "avx2":
        return "reference"
    return "avx512vnni" if torch.ops.kvgen.kernel_isa() == 1 else "avx2"


def reference_ops() -> KernelOps:
    """The plain-torch twins (the spec of every op)."""
    return _REFERENCE


__all__ = [
    "BF16", "F16", "IQ1_M", "IQ1_S", "IQ2_XS", "IQ2_XXS", "IQ3_S", "IQ3_XXS", "IQ4", "IQ4_XS", "MIXED", "MXFP4", "Q2", "Q3", "Q4", "Q4_0",
    "Q4_K", "Q5", "Q5_0", "Q5_K", "Q6", "Q8", "TQ", "KernelOps", "cache_dir", "get_ops",
    "kernel_isa", "pack_gguf_rows", "pack_gguf_segments", "reference_ops",
]
