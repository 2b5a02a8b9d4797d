"""gpt-oss checkpoints' expert stacks as kvgen's per-expert linears.

A Hugging Face gpt-oss checkpoint stores each layer's experts as four stacks (transformers 4.55 ``GptOssExperts``):
``mlp.experts.gate_up_proj`` [E, C, 2I] (``[in, out]``, gate and up interleaved along the last dim: gate =
``[..., ::2]``, up = ``[..., 1::2]``), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, C], ``down_proj_bias``
[E, C]. They load as kvgen's per-expert checkpoint names ``experts.e.gate_proj`` / ``up_proj`` [I, C] and
``down_proj`` [C, I], each with its bias (``GptOssExpert`` stacks gate and up into ``gate_up_proj`` as ``LlamaMLP``
does): :func:`split_expert_stacks` transposes and de-interleaves, as llama.cpp's converter does
(``convert_hf_to_gguf.py`` ``GptOssModel``: ``ffn_gate_exps`` = ``[..., ::2]``, ``ffn_up_exps`` = ``[..., 1::2]``).

The released checkpoints store the two weight stacks as MXFP4 instead (transformers 4.55 ``Mxfp4GptOssExperts``):
``gate_up_proj_blocks`` [E, 2I, C / 32, 16] uint8 (rows ``[out]``, interleaved; two E2M1 values a byte, the low
nibble first) and ``gate_up_proj_scales`` [E, 2I, C / 32] uint8 (E8M0 exponents, bias 127), ``down_proj_*`` alike.
Each 32-value block is rewritten as GGUF's ``block_mxfp4`` (the exponent byte, then 16 bytes holding values j and
j + 16 in the low and high nibbles of byte j: :func:`hf_mxfp4_to_gguf`), which the kernels run as stored.
"""

from __future__ import annotations

import re

import torch
from gguf import GGMLQuantizationType

from kvgen.errors import ModelFormatError
from kvgen.weights.quantized import GGUFBlocks, dense_to_q8_0, mxfp4_fits_float16

_STACK_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def is_expert_stack(name: str) -> bool:
    """Whether ``name`` is one of a gpt-oss layer's expert stacks (``mlp.experts.gate_up_proj``, its ``_bias``, and
    in an MXFP4 checkpoint its ``_blocks`` and ``_scales``)."""
    return _STACK_RE.fullmatch(name) is not None


def expert_stack_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-expert parameters (our names, ``[out, in]`` shapes) that the stack ``name`` of ``shape`` becomes (an
    MXFP4 ``_blocks`` stack: the weights; its ``_scales``: nothing, :func:`check_mxfp4_pairs` pairs them); a
    malformed stack (not 3-D weights, 2-D biases or 4-D blocks) maps to itself, for the strict check to name it."""
    m = _STACK_RE.fullmatch(name)
    assert m is not None, name
    prefix, which, kind = m.groups()
    if kind == "_scales":
        return {}
    rank = {None: 3, "_bias": 2, "_blocks": 4}[kind]
    rows = shape[1] if kind == "_blocks" else shape[-1]  # the stack's gate / up rows (interleaved)
    if len(shape) != rank or (kind == "_blocks" and shape[-1] != 16) or (which == "gate_up_proj" and rows % 2):
        return {name: shape}
    suffix = "bias" if kind == "_bias" else "weight"
    if kind == "_blocks":
        per_expert: tuple[int, ...] = (shape[1], shape[2] * 32)  # [out, in]
    else:
        per_expert = shape[1:] if kind else shape[:0:-1]  # weights [E, in, out] -> [out, in]
    if which == "down_proj":
        return {f"{prefix}{e}.down_proj.{suffix}": tuple(per_expert) for e in range(shape[0])}
    half = (per_expert[0] // 2, *per_expert[1:])  # [I] | [I, C]
    return {f"{prefix}{e}.{part}.{suffix}": half for e in range(shape[0]) for part in ("gate_proj", "up_proj")}


def split_expert_stacks(state: dict, dtype: torch.dtype, keep_16bit: bool, keep: bool = False) -> dict:
    """``state`` with each expert stack replaced by its per-expert tensors (as :func:`expert_stack_shapes` names
    them), contiguous in ``dtype``; with ``keep_16bit`` the float16 / bfloat16 weight matrices become
    :class:`GGUFBlocks` of their bytes (the 16-bit kernels) instead, and with ``keep`` MXFP4 ones their GGUF MXFP4
    blocks (else dequantized to ``dtype``). Biases stay dense."""
    out = {}
    for name, t in state.items():
        m = _STACK_RE.fullmatch(name) if isinstance(t, torch.Tensor) else None
        if m is None or m.group(3) == "_scales":  # scales: read with their blocks
            if m is None:
                out[name] = t
            continue
        prefix, which, kind = m.groups()
        suffix = "bias" if kind == "_bias" else "weight"
        scales = state[f"{prefix}{which}_scales"] if kind == "_blocks" else None
        if scales is not None and (scales.shape != t.shape[:-1] or {scales.dtype, t.dtype} != {torch.uint8}):
            raise ModelFormatError(f"{name} {list(t.shape)} {t.dtype} and its _scales {list(scales.shape)} "
                                   f"{scales.dtype} must be uint8 [E, rows, G, 16] and [E, rows, G]")
        for e in range(t.shape[0]):
            if scales is not None:  # [out, G, 16] blocks, [out, G] scales -> GGUF MXFP4 rows [out, G * 17]
                x = hf_mxfp4_to_gguf(t[e], scales[e])
            else:
                x = t[e] if kind else t[e].t()  # [2I] | [C] bias; [out, in] weight
            parts = {"down_proj": x} if which == "down_proj" else {"gate_proj": x[0::2], "up_proj": x[1::2]}
            for part, y in parts.items():  # y: [I] | [C] | [I, C] | [C, I] | MXFP4 rows
                key = f"{prefix}{e}.{part}.{suffix}"
                out[key] = _mxfp4_tensor(y, dtype, keep) if scales is not None else _expert_tensor(
                    y, dtype, keep_16bit and not kind)
    return out


def _expert_tensor(x: torch.Tensor, dtype: torch.dtype, keep_16bit: bool) -> torch.Tensor | GGUFBlocks:
    """x contiguous in ``dtype``, or (``keep_16bit`` and x float16 / bfloat16 [out, in]) GGUFBlocks of its bytes."""
    if keep_16bit and x.dtype in (torch.float16, torch.bfloat16):
        qtype = GGMLQuantizationType.F16 if x.dtype == torch.float16 else GGMLQuantizationType.BF16
        return GGUFBlocks(qtype, [x.contiguous().view(torch.uint8)], (x.shape[0], x.shape[1]))
    return x.to(dtype).contiguous()


def check_mxfp4_pairs(names: list[str]) -> None:
    """ModelFormatError naming every MXFP4 ``_blocks`` stack without its ``_scales`` (or the reverse)."""
    have = set(names)
    lone = sorted(n for n in have if n.endswith(("_blocks", "_scales")) and is_expert_stack(n)
                  and n.rsplit("_", 1)[0] + ("_scales" if n.endswith("_blocks") else "_blocks") not in have)
    if lone:
        raise ModelFormatError(f"MXFP4 expert stacks need both _blocks and _scales; alone: {', '.join(lone)}")


def hf_mxfp4_to_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 rows -> GGUF ``block_mxfp4`` rows: blocks [R, G, 16] uint8 (value 2j in the low nibble of
    byte j, 2j + 1 in its high nibble), scales [R, G] uint8 -> [R, G * 17] uint8 (per block the scale byte, then byte
    j holding value j low and value j + 16 high). Source: transformers 4.55 ``convert_moe_packed_tensors``; llama.cpp
    ``convert_hf_to_gguf.py`` ``GptOssModel.transform_nibble_layout``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ModelFormatError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be uint8 "
                               f"[rows, G, 16] and [rows, G]")
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [R, G, 32]: the 32 values in order
    packed = values[..., :16] | (values[..., 16:] << 4)  # [R, G, 16]
    return torch.cat([scales[..., None], packed], dim=-1).flatten(-2)  # [R, G * 17]


def _mxfp4_tensor(raw: torch.Tensor, dtype: torch.dtype, keep: bool) -> torch.Tensor | GGUFBlocks:
    """GGUF MXFP4 rows [out, in / 32 * 17] as GGUFBlocks (``keep``; Q8_0 when a scale is past float16's range) or
    dequantized (by the gguf package) to [out, in] ``dtype``."""
    from gguf.quants import dequantize

    rows, in_features = raw.shape[0], raw.shape[1] // 17 * 32
    raw = raw.contiguous()
    if keep and mxfp4_fits_float16(raw):
        return GGUFBlocks(GGMLQuantizationType.MXFP4, [raw], (rows, in_features))
    dense = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType.MXFP4).copy()).view(rows, in_features)
    return dense_to_q8_0(dense) if keep else dense.to(dtype)