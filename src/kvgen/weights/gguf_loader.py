"""Loading a Llama-family GGUF file into our parameter names, shapes and dtype.

Tensors are dequantized with the ``gguf`` package (``gguf.quants.dequantize``,
llama.cpp's numpy reference) a bounded chunk of rows at a time, straight into
the final tensor, so peak memory stays near the size of the loaded weights.
llama.cpp's Q/K row permutation is undone while copying (reference:
``transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor``).
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedQuantizationError
from kvgen.heap import return_freed_memory
from kvgen.llama_config import longrope_scaling
from kvgen.weights.gguf_file import gguf_metadata, open_gguf
from kvgen.weights.name_maps import (
    check_layer_count,
    check_state_dict,
    expected_param_shapes,
    gguf_expert_stack_name,
    gguf_to_kvgen_name,
    is_router_weight,
)
from kvgen.weights.quantized import (
    FLOAT16_TYPES,
    KERNEL_TYPES,
    GGUFBlocks,
    dense_to_q8_0,
    is_quantizable,
    mxfp4_fits_float16,
    quantize_matrix,
)

Q = GGMLQuantizationType
# llama.cpp's weight types that the gguf package dequantizes (legacy, K, IQ, ternary TQ and MXFP4 blocks)
SUPPORTED_QUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.MXFP4,
})
_FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# Per-frequency RoPE factors (Llama 3.x scaling); harmless, and ignored, only when all ones.
_ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's frequency divisors past / within the original context (llama.cpp's Phi3MiniModel, 128k models)
_ROPE_LONG, _ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
_ROPE_TENSORS = (_ROPE_FREQS, _ROPE_LONG, _ROPE_SHORT)  # read into the config's rope_scaling, not parameters
# Architectures whose q/k rows llama.cpp's converter stores as Hugging Face's (it permutes only its llama models)
_UNPERMUTED_ARCHS = ("qwen2", "qwen3", "phi3", "gemma3", "gemma2", "qwen2moe", "qwen3moe", "gpt-oss")
# float32 bytes dequantized per step: bounds the transient memory of one tensor.
_CHUNK_BYTES = 8 << 20


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype | None = torch.float32,
    quantization: GGMLQuantizationType | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor | GGUFBlocks], dict[str, Any]]:
    """Read a Llama-family (or ``gpt2``) GGUF file: config, state dict in our names, raw metadata.

    The state dict uses HF Llama names with matrices ``[out, in]`` in ``dtype``.
    ``dtype=None`` ("auto") on a file with quantized matrices keeps every matrix compact
    as :class:`GGUFBlocks` (kernel types as stored: ``weights.quantized``; every other type, float ones included, re-encoded as Q8_0) and loads vectors
    (norms, biases) as float32; in a file of float matrices, F16 and BF16 ones stay as stored (the 16-bit kernels:
    the file's weights, unquantized activations) and F32 ones re-encode as Q8_0 beside them; a file of F32 matrices loads as
    float32 (``lm_head.weight`` only when the file has ``output.weight`` and, in a ``gpt2`` file, it is not
    ``token_embd``'s byte copy; otherwise ``config.tie_word_embeddings`` is True). ``config.attention_bias`` / ``o_proj_bias`` /
    ``mlp_bias`` follow the presence of ``attn_q.bias`` / ``attn_output.bias`` / ``ffn_up.bias``.
    Architectures: ``llama`` (q/k rows un-permuted), ``qwen2``, ``qwen3`` and ``phi3`` (stored as Hugging Face's;
    phi3's ``attn_qkv`` and [2I, C] ``ffn_up`` load as ``qkv_proj`` / ``gate_up_proj``, its ``rope_factors_*``
    as a LongRoPE rope_scaling); mixtures of experts (``qwen3moe``, ``qwen2moe``, ``llama`` with ``expert_count``):
    each expert stack [E, rows, cols] becomes E matrices converted one by one like any other (:func:`_expert_slice`;
    older files' per-expert tensors map directly), routers stay dense (float32 for auto), and a layer without a
    router but with ``ffn_up`` is dense (:func:`_dense_layers`).
    ``quantization`` (a type of :data:`~kvgen.weights.quantized.QUANTIZATIONS`, with ``dtype=None``): the file's
    F32 / F16 / BF16 matrices are encoded in that type (:func:`~kvgen.weights.quantized.quantize_matrix`; ``ValueError``
    for one whose ``in_features`` is not a multiple of 32); quantized ones stay as stored.
    Supported tensor types: :data:`SUPPORTED_QUANT_TYPES`.
    Raises ``ModelNotFoundError``, ``ModelFormatError`` (not GGUF, truncated,
    unknown or missing tensors, wrong shapes), ``UnsupportedArchitectureError``
    and ``UnsupportedQuantizationError`` (naming the tensor and its type).
    """
    path = os.fspath(path)
    reader = open_gguf(path)
    if reader.byte_order != "I":
        raise ModelFormatError(f"{path} is a big-endian GGUF file; kvgen reads little-endian files only")
    meta = gguf_metadata(reader)
    reader.fields.clear()  # ~250k numpy views of the vocabulary (~40 MB); `meta` holds the values now
    by_name = {t.name: t for t in reader.tensors}
    arch = meta.get("general.architecture")
    check_layer_count(f"{arch}.block_count", meta.get(f"{arch}.block_count"), by_name, path)
    config = ModelConfig.from_gguf_metadata(meta)
    # a gpt2 file's output.weight is the converter's copy of token_embd (a tied head, as HF GPT-2's), or an untied
    # head of its own, which llama.cpp reads as it reads a Llama file's
    head_is_copy = config.model_type == "gpt2" and _is_copy(reader, by_name, "output.weight", "token_embd.weight")
    config = replace(
        config,
        rope_scaling=_rope_scaling(by_name, config, meta, path),
        tie_word_embeddings=head_is_copy or "output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name or "blk.0.attn_qkv.bias" in by_name,
        o_proj_bias="blk.0.attn_output.bias" in by_name,  # Qwen2 biases q/k/v only
        mlp_bias="blk.0.ffn_up.bias" in by_name,
    )
    names, stacks = _map_names(reader, path, meta["general.architecture"])
    if head_is_copy:
        del names["output.weight"]
    if config.num_experts:
        config = replace(config, mlp_only_layers=_dense_layers(by_name, config))
        if len(config.mlp_only_layers) == config.num_hidden_layers:  # it loaded as a dense model
            raise ModelFormatError(f"{path} announces {config.num_experts} experts ({arch}.expert_count) but no layer "
                                   f"has a router (blk.N.ffn_gate_inp.weight)")
    if config.num_experts or stacks:
        _check_expert_tensors(by_name, stacks, config, path)
    shapes = expected_param_shapes(config)
    found = {ours: _param_shape(by_name[g], ours) for g, ours in names.items()}
    for g, template in stacks.items():  # expert e of a stack [E, rows, cols]
        for e in range(int(by_name[g].shape[-1])):
            found |= _unfused(template.format(e), _torch_shape(by_name[g])[1:])
    ignored = [n for n in (*_ROPE_TENSORS, *(("output.weight",) if head_is_copy else ())) if n in by_name]
    check_state_dict(shapes, found, path, ignored=ignored)
    for name in (*names, *stacks):
        _check_quant_type(by_name[name])
    # auto on a quantized (or 16-bit) file: every matrix runs through the kernels, so the model has one kind of
    # linear layer; F16 / BF16 matrices keep their bytes unless the file is quantized (then they join its Q8_0).
    # Routers stay dense float32 (is_router_weight).
    matrix_types = {by_name[g].tensor_type for g, ours in (*names.items(), *stacks.items())
                    if len(by_name[g].shape) >= 2 and not is_router_weight(ours)}
    is_quantized = any(q not in _FLOAT_TYPES for q in matrix_types)
    compact = dtype is None and (is_quantized or bool(FLOAT16_TYPES & matrix_types) or quantization is not None)
    if quantization is not None:
        _check_quantizable(by_name, names, stacks, dtype, quantization)

    def convert(t: ReaderTensor, ours: str) -> torch.Tensor | GGUFBlocks:
        """``t`` as kvgen stores it; its file pages are dropped from RSS now, or by the blocks' ``release`` once
        they are packed where the blocks view the file (``_compact_tensor``)."""
        release = partial(_release_pages, reader, t)
        if compact and len(t.shape) == 2 and is_quantizable(ours):  # not routers, not GPT-2's position table
            if quantization is not None and t.tensor_type in _FLOAT_TYPES:
                dense = dequantize_tensor(t, torch.float32, _qk_heads(ours, config))  # [out, in]
                blocks = quantize_matrix(ours, dense, quantization)
                release()
                return blocks
            return _compact_tensor(t, _qk_heads(ours, config), not is_quantized, release)
        out = dequantize_tensor(t, dtype or torch.float32, _qk_heads(ours, config)).view(_param_shape(t, ours))
        release()
        return out

    state: dict[str, torch.Tensor | GGUFBlocks] = {}
    for gguf_name, ours in (*names.items(), *stacks.items()):
        t = by_name[gguf_name]
        if gguf_name in stacks:  # one matrix per expert, each converted as a 2-D tensor of the file
            state |= {ours.format(e): convert(_expert_slice(t, e), ours) for e in range(int(t.shape[-1]))}
        else:
            state[ours] = convert(t, ours)
        return_freed_memory(int(t.n_bytes))  # the transients of this tensor's conversion (kvgen.heap)
    return config, state, meta


def _unfused(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """An expert's part as the strict check sees it: a fused ``gate_up_proj`` [2I, ...] (``ffn_gate_up_exps``) as
    the ``gate_proj`` and ``up_proj`` halves its module stacks, anything else as it is."""
    if ".gate_up_proj." not in name or shape[0] % 2:
        return {name: shape}
    half = (shape[0] // 2, *shape[1:])
    return {name.replace(".gate_up_proj.", f".{part}."): half for part in ("gate_proj", "up_proj")}


def _param_shape(t: ReaderTensor, ours: str) -> tuple[int, ...]:
    """The torch shape parameter ``ours`` takes from ``t``: the file's, but [1, C] for a shared expert gate that
    llama.cpp's converter squeezed to [C]."""
    shape = _torch_shape(t)
    return (1, *shape) if len(shape) == 1 and ours.endswith(".shared_expert_gate.weight") else shape


def _expert_slice(t: ReaderTensor, e: int) -> ReaderTensor:
    """Expert ``e`` of an expert stack ``t`` (ggml ne [cols, rows, E], data [E, rows, cols or bytes]; gpt-oss's bias
    stacks ne [rows, E]) as a tensor of its own (2-D; 1-D for a bias): a view of the file's bytes, named
    ``{t.name}[e]`` in messages."""
    num_experts = int(t.shape[-1])
    n_bytes = t.n_bytes // num_experts
    return t._replace(name=f"{t.name}[{e}]", shape=t.shape[:-1], n_elements=t.n_elements // num_experts,
                      n_bytes=n_bytes, data_offset=t.data_offset + e * n_bytes, data=t.data[e])


def _dense_layers(by_name: dict[str, ReaderTensor], config: ModelConfig) -> list[int]:
    """The layers of a mixture-of-experts file that are dense: no router (``ffn_gate_inp``) but an ``ffn_up``
    (llama.cpp's llama graph decides so per layer; its qwen2moe / qwen3moe graphs know sparse layers only)."""
    return [i for i in range(config.num_hidden_layers)
            if f"blk.{i}.ffn_gate_inp.weight" not in by_name and f"blk.{i}.ffn_up.weight" in by_name]


def _check_expert_tensors(by_name: dict[str, ReaderTensor], stacks: dict[str, str], config: ModelConfig,
                          path: str) -> None:
    """ModelFormatError naming each expert tensor a sparse layer lacks (its ``ffn_{gate,up,down}_exps`` stack, or
    ``ffn_gate_up_exps`` and ``ffn_down_exps``, or the older per-expert ``ffn_{gate,up,down}.E``) and each stack whose expert count is not ``expert_count``."""
    missing, wrong = [], []
    for i in range(config.num_hidden_layers):
        fused = f"blk.{i}.ffn_gate_up_exps.weight" in by_name
        for kind in (("down",) if fused else ("gate", "up", "down")) if config.is_sparse_layer(i) else ():
            stack = f"blk.{i}.ffn_{kind}_exps.weight"
            if stack not in by_name and f"blk.{i}.ffn_{kind}.0.weight" not in by_name:
                missing.append(stack)
    for name in stacks:
        shape = by_name[name].shape
        if len(shape) != (2 if name.endswith(".bias") else 3) or int(shape[-1]) != config.num_experts:
            wrong.append(f"{name} {list(_torch_shape(by_name[name]))}")
    if missing or wrong:
        raise ModelFormatError(f"{path} does not hold the experts its metadata announces (expert_count = "
                               f"{config.num_experts}): missing {', '.join(missing) or 'none'}; "
                               f"not [{config.num_experts}, rows, cols]: {', '.join(wrong) or 'none'}")


def _check_quantizable(by_name: dict[str, ReaderTensor], names: dict[str, str], stacks: dict[str, str],
                       dtype: torch.dtype | None, quantization: GGMLQuantizationType) -> None:
    """``ValueError`` unless ``quantization`` can encode every float matrix of the file for the kernels."""
    name = quantization.name.lower()
    if dtype is not None:
        raise ValueError(f"quantization={name!r} needs dtype 'auto' (the kernels), got {dtype}")
    for g, ours in (*names.items(), *stacks.items()):
        t = by_name[g]
        if len(t.shape) >= 2 and t.tensor_type in _FLOAT_TYPES and is_quantizable(ours) and int(t.shape[0]) % 32:
            raise ValueError(f"quantization={name!r} needs matrices whose in_features is a multiple of 32, got {g} "
                             f"{list(_torch_shape(t))}")


def _compact_tensor(t: ReaderTensor, qk_heads: int | None, keep_16bit: bool,
                    release: Callable[[], None] = lambda: None) -> GGUFBlocks:
    """A matrix as GGUFBlocks: its own bytes for kernel types (F16 / BF16 only with ``keep_16bit``), else
    re-encoded as Q8_0. Kernel-type bytes that need no change (no
    q/k row permutation) stay a view of the mapped file, with ``release`` (dropping its pages) called by
    whoever packs them: no copy of them is made (the copy took a quarter of a mixture-of-experts file's load); every
    other result is the tensor's own and ``release`` runs here."""
    own = t.tensor_type in KERNEL_TYPES and (keep_16bit or t.tensor_type not in FLOAT16_TYPES)
    out_features, in_features = _torch_shape(t)  # 2-D: the caller's check
    qtype = t.tensor_type
    if own:
        with warnings.catch_warnings():  # a read-only mapping: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(out_features, -1))  # [out, bytes]
        if qtype == Q.MXFP4 and not mxfp4_fits_float16(raw):  # a scale float16 does not hold
            own = False
        elif not qk_heads:
            return GGUFBlocks(qtype, [raw], (out_features, in_features), release=(release,))
        else:
            raw = reverse_permute_qk(raw, qk_heads)  # whole rows move: exact on the encoded bytes
            release()
            return GGUFBlocks(qtype, [raw], (out_features, in_features))
    blocks = dense_to_q8_0(dequantize_tensor(t, torch.float32, qk_heads))
    release()
    return blocks


def _is_copy(reader: GGUFReader, by_name: dict[str, ReaderTensor], name: str, original: str) -> bool:
    """Whether tensor ``name`` has the type, shape and bytes of ``original`` (its pages read once, then released)."""
    a, b = by_name.get(name), by_name.get(original)
    if a is None or b is None or a.tensor_type != b.tensor_type or list(a.shape) != list(b.shape):
        return False
    same = bool(np.array_equal(a.data, b.data))
    _release_pages(reader, a)
    return same


def _map_names(reader: GGUFReader, path: str, arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """GGUF tensor name -> our name, and expert stack name -> its experts' names as a format string (of the
    expert index); ModelFormatError listing unknown tensors."""
    names: dict[str, str] = {}
    stacks: dict[str, str] = {}
    unknown = []
    for t in reader.tensors:
        ours = gguf_to_kvgen_name(t.name, arch)
        stack = gguf_expert_stack_name(t.name, arch)
        if ours is not None:
            names[t.name] = ours
        elif stack is not None:
            stacks[t.name] = stack
        elif t.name not in _ROPE_TENSORS:  # rope: the config's
            unknown.append(f"{t.name} ({t.tensor_type.name}, {list(_torch_shape(t))})")
    if unknown:
        raise ModelFormatError(f"{path} has tensors kvgen does not know: {', '.join(unknown)}")
    return names, stacks


def _rope_scaling(
    by_name: dict[str, ReaderTensor], config: ModelConfig, meta: dict[str, Any], path: str
) -> dict[str, Any] | None:
    """The config's rope_scaling with a file's rope tensors: ``rope_factors_long`` / ``rope_factors_short``
    (LongRoPE, :func:`_longrope`) or ``rope_freqs.weight`` (llama.cpp's per-frequency divisors, written for
    Llama 3.1+ rope scaling) as ``freq_factors``; unchanged without them or when the divisors are all 1."""
    if _ROPE_LONG in by_name or _ROPE_SHORT in by_name:
        return _longrope(by_name, config, meta, path)
    if _ROPE_FREQS not in by_name:
        return config.rope_scaling
    factors = _rope_factors(by_name, _ROPE_FREQS, config, path)
    if np.all(factors == 1.0):
        return config.rope_scaling
    return {"rope_type": "freq_factors", "freq_factors": factors.tolist()}


def _longrope(by_name: dict[str, ReaderTensor], config: ModelConfig, meta: dict[str, Any], path: str) -> dict[str, Any]:
    """LongRoPE rope_scaling (:func:`kvgen.llama_config.longrope_scaling`) of a phi3 file: both factor tensors, the
    original length ``{arch}.rope.scaling.original_context_length``, the scale ``context_length`` / original and
    the converter's ``rope.scaling.attn_factor`` (computed as transformers does when absent).
    Source: llama.cpp ``convert_hf_to_gguf.py`` ``Phi3MiniModel``."""
    arch = config.extra["gguf_architecture"]
    absent = [n for n in (_ROPE_LONG, _ROPE_SHORT) if n not in by_name]
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if absent or original is None:
        what = absent or [f"metadata {arch}.rope.scaling.original_context_length"]
        raise ModelFormatError(f"{path} has LongRoPE factors but lacks {', '.join(what)}")
    long_factor = _rope_factors(by_name, _ROPE_LONG, config, path)
    short_factor = _rope_factors(by_name, _ROPE_SHORT, config, path)
    context = int(meta.get(f"{arch}.context_length", original))
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    return longrope_scaling(short_factor.tolist(), long_factor.tolist(), int(original), context / int(original),
                            None if attn_factor is None else float(attn_factor))


def _rope_factors(by_name: dict[str, ReaderTensor], name: str, config: ModelConfig, path: str) -> np.ndarray:
    """A rope factor tensor as float64 ``[R/2]`` (R = ``config.rotary_dim``): ModelFormatError unless F32 / F16 with
    R/2 positive values."""
    t = by_name[name]
    if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        raise ModelFormatError(f"{path}: {name} is stored as {t.tensor_type.name}; expected F32 or F16")
    factors = dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
    if factors.size != config.rotary_dim // 2 or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
        raise ModelFormatError(f"{path}: {name} must hold rotary_dim / 2 = {config.rotary_dim // 2} positive "
                               f"factors, got {factors.size} values")
    return factors


def _torch_shape(t: ReaderTensor) -> tuple[int, ...]:
    """GGUF stores dims fastest-first (ggml ``ne``); torch order is the reverse."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _check_quant_type(t: ReaderTensor) -> None:
    if t.tensor_type not in SUPPORTED_QUANT_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_QUANT_TYPES))
        raise UnsupportedQuantizationError(
            f"tensor {t.name!r} is stored as {t.tensor_type.name}, which kvgen cannot dequantize "
            f"(supported: {supported})"
        )


def _qk_heads(name: str, config: ModelConfig) -> int | None:
    """Heads to un-permute for q/k projections (weight or bias); None for every other tensor, and for every
    tensor of a ``qwen2`` / ``qwen3`` / ``phi3`` / ``gemma3`` / ``gemma2`` / ``qwen2moe`` / ``qwen3moe`` file
    (llama.cpp's converter permutes only its ``llama`` models, Mixtral included)."""
    if config.extra.get("gguf_architecture") in _UNPERMUTED_ARCHS:
        return None
    if ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    return None


def reverse_permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: w [H*D, ...] (GGUF order) -> [H*D, ...] (HF order).

    llama.cpp's converter (``LlamaModel.permute``) reorders each head's D rows
    from HF's rotate-half layout (two halves) to interleaved pairs. Use
    ``num_attention_heads`` for q and ``num_key_value_heads`` for k. Reference:
    transformers ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    out = torch.empty_like(w)
    _unpermute_into(out, w, num_heads)
    return out


def _unpermute_into(dst: torch.Tensor, src: torch.Tensor, num_heads: int) -> None:
    """dst[H*D, ...] (HF order) = src[H*D, ...] (llama.cpp order), cast to dst's dtype."""
    rows, rest = src.shape[0], tuple(src.shape[1:])
    if rows % (2 * num_heads) != 0:
        raise ModelFormatError(f"q/k projection with {rows} rows cannot be split into {num_heads} heads of pairs")
    half = rows // num_heads // 2
    # GGUF row (h, i, s) of [H, D/2, 2] is HF row (h, s, i) of [H, 2, D/2]
    dst.view(num_heads, 2, half, *rest).transpose(1, 2).copy_(src.view(num_heads, half, 2, *rest))


def dequantize_tensor(t: ReaderTensor, dtype: torch.dtype, qk_heads: int | None = None) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in torch order (``[out, in]``) and ``dtype``.

    Dequantizes about ``_CHUNK_BYTES`` of float32 at a time into the result, so
    the only full-size allocation is the result itself. ``qk_heads``: undo
    llama.cpp's q/k permutation over that many heads (:func:`reverse_permute_qk`).
    Raises ``UnsupportedQuantizationError`` for a type outside ``SUPPORTED_QUANT_TYPES``.
    """
    _check_quant_type(t)
    shape = _torch_shape(t)
    out = torch.empty(shape, dtype=dtype)
    if len(shape) == 1:  # norms and biases: small, one piece
        src = _dequantize_rows(t.data.reshape(1, -1), t.tensor_type).reshape(shape)  # [n]
        _copy_rows(out, src, qk_heads)
        return out
    raw = t.data.reshape(-1, t.data.shape[-1])  # [rows, bytes or elements per row]
    out2d = out.view(-1, shape[-1])  # [rows, in]
    rows_per_head = raw.shape[0] // qk_heads if qk_heads else 1
    step = max(1, _CHUNK_BYTES // (4 * shape[-1] * rows_per_head)) * rows_per_head  # whole heads per chunk
    for start in range(0, raw.shape[0], step):
        src = _dequantize_rows(raw[start : start + step], t.tensor_type)  # [r, in] float32
        dst = out2d[start : start + src.shape[0]]  # [r, in]
        _copy_rows(dst, src, src.shape[0] // rows_per_head if qk_heads else None)
    return out


def _dequantize_rows(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    # gguf's dequantize loops in Python over groups of 16 rows; blocks are independent, so
    # handing it the chunk as one long row gives the same values with one vectorized call.
    num_rows = raw.shape[0]
    values = dequantize(raw.reshape(1, -1), qtype).reshape(num_rows, -1)  # float32; a read-only view for F32
    if not values.flags.writeable:
        values = values.copy()  # torch.from_numpy needs a writable array; one chunk only
    return torch.from_numpy(values)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, qk_heads: int | None) -> None:
    if qk_heads is None:
        dst.copy_(src)
    else:
        _unpermute_into(dst, src, qk_heads)


def _release_pages(reader: GGUFReader, t: ReaderTensor) -> None:
    """Drop this tensor's file pages from our resident set (they stay in the page cache).

    Without this, every byte of the file we have read counts in RSS until the
    reader is closed, on top of the converted weights. A no-op where
    ``madvise`` is unavailable or the reader is not memory-mapped.
    """
    memmap = getattr(reader, "mmap", None)  # set by FastGGUFReader
    mm = getattr(memmap, "_mmap", None)
    # read-only mappings only: on a copy-on-write one, MADV_DONTNEED would discard writes
    if mm is None or getattr(memmap, "mode", None) != "r" or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = t.data_offset // page * page
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)
    except (OSError, ValueError):
        pass
