"""YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models") and a
GGUF file's rope scaling keys, in kvgen's form.

kvgen's yarn rope_scaling holds every value its frequencies and its cos/sin scale need, so nothing is derived later:
``{"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
"attention_factor"}`` (:data:`YARN_KEYS`). Sources: transformers 4.55 ``_compute_yarn_parameters``
(``modeling_rope_utils.py``); llama.cpp ``ggml_rope_yarn_corr_dims`` / ``rope_yarn`` (ggml-cpu ``ops.cpp``),
``llama_context`` (the attention factor) and ``convert_hf_to_gguf.py`` (the keys it writes).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError

YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
             "attention_factor")
# The keys of a config.json's yarn rope_scaling that transformers 4.55 reads (_validate_yarn_parameters), and
# "finetuned" (NousResearch's Yarn-Llama-2 configs, where it only steers the dynamic variant): others are refused
_HF_YARN_KEYS = frozenset({"rope_type", "type", "factor", "attention_factor", "beta_fast", "beta_slow",
                           "original_max_position_embeddings", "mscale", "mscale_all_dim", "truncate", "finetuned"})


def rope_scaling_type(scaling: dict[str, Any]) -> str | None:
    """A ``rope_scaling`` object's type: its ``rope_type``, else its legacy ``type`` (transformers 4.55's
    ``rope_config_validation`` reads them in that order); None for an empty object. Raises ``ModelFormatError`` for a
    non-empty object naming neither, which transformers (``KeyError``) and vLLM (``patch_rope_scaling_dict``) refuse
    too: loading it unscaled would be silently wrong for a model trained with scaling."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None and scaling:
        raise ModelFormatError(f"rope_scaling has no rope_type (nor type): {scaling!r}")
    return kind


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin scale ``0.1 mscale ln(factor) + 1`` (1 when factor <= 1): transformers' ``get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_yarn_scaling(scaling: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """A config.json's yarn ``rope_scaling`` in kvgen's form, read as transformers 4.55 reads it.

    With an ``original_max_position_embeddings`` the factor becomes ``max_position_embeddings`` / that length (so a
    Qwen3 config that keeps 40960 positions with factor 4 and 32768 original ones gets 1.25, as in transformers),
    else the given ``factor`` over ``max_position_embeddings`` original positions. The cos/sin scale is
    ``attention_factor`` when given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are
    non-zero, else ``mscale(factor)`` (:func:`yarn_mscale`); ``beta_fast`` / ``beta_slow`` are 32 / 1 when absent or
    0; ``truncate`` (round the correction range outwards) defaults to True. Raises ``UnsupportedArchitectureError``
    naming a key transformers does not read (a dynamic YaRN's) and ``ModelFormatError`` for a missing or bad value.
    """
    unknown = sorted(set(scaling) - _HF_YARN_KEYS)
    if unknown:
        raise UnsupportedArchitectureError(
            f"yarn rope_scaling key {unknown[0]!r} is not supported (kvgen computes transformers' static YaRN from "
            f"{', '.join(sorted(_HF_YARN_KEYS - {'type', 'finetuned'}))})")
    if "factor" not in scaling:
        raise ModelFormatError("yarn rope_scaling lacks 'factor'")
    factor, original = _positive(scaling, "factor"), max_position_embeddings
    if "original_max_position_embeddings" in scaling:
        original = _positive_length(scaling, "original_max_position_embeddings")
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _positive(scaling, "attention_factor")
    elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
        mscale, mscale_all_dim = _positive(scaling, "mscale"), _positive(scaling, "mscale_all_dim")
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = (_positive(scaling, k) if scaling.get(k) else default  # absent, null or 0: the default
                            for k, default in (("beta_fast", 32.0), ("beta_slow", 1.0)))
    return check_yarn_scaling({
        "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
        "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": bool(scaling.get("truncate", True)),
        "attention_factor": float(attention_factor)})


def _positive_length(scaling: dict[str, Any], key: str) -> int:
    """``scaling[key]``, a number of tokens: ``ModelFormatError`` unless it is a positive whole number."""
    value = _positive(scaling, key)
    if not value.is_integer():
        raise ModelFormatError(f"yarn rope_scaling {key} must be a whole number of tokens, got {scaling[key]!r}")
    return int(value)


def yarn_scaling(scaling: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """``scaling`` in kvgen's form: checked as it is when it holds exactly :data:`YARN_KEYS` (already computed),
    else read as a config.json's (:func:`hf_yarn_scaling`) for ``max_position_embeddings`` positions."""
    if set(scaling) == set(YARN_KEYS):
        return check_yarn_scaling(scaling)
    return hf_yarn_scaling(scaling, max_position_embeddings)


def check_yarn_scaling(scaling: dict[str, Any]) -> dict[str, Any]:
    """``scaling`` (kvgen's form) unchanged; ``ModelFormatError`` naming a value that is not a positive number."""
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"):
        _positive(scaling, key)
    return scaling


def _positive(scaling: dict[str, Any], key: str) -> float:
    return positive_scaling_value(scaling, key, "yarn")


def positive_scaling_value(scaling: dict[str, Any], key: str, kind: str) -> float:
    """``scaling[key]`` as a float; ``ModelFormatError`` naming the ``kind`` of rope_scaling and the key when it is
    absent or not a finite positive number (0 or NaN gives inf or NaN frequencies)."""
    if key not in scaling:
        raise ModelFormatError(f"{kind} rope_scaling lacks {key!r}")
    value = scaling[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelFormatError(f"{kind} rope_scaling {key} must be a positive number, got {value!r}")
    return float(value)


def gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """The rope_scaling of a Llama-family GGUF file's ``{arch}.rope.scaling.type`` as llama.cpp reads it: absent or
    ``linear`` with a ``rope.scaling.factor`` (older files: ``rope.scale_linear``) other than 0 and 1 is linear,
    ``yarn`` is :func:`gguf_yarn_scaling`, ``none`` and ``longrope`` (whose factors are tensors, the loader's to
    read) add nothing. Raises ``UnsupportedArchitectureError`` naming the key for another type."""
    kind = meta.get(f"{arch}.rope.scaling.type") or "linear"
    if kind == "yarn":
        return gguf_yarn_scaling(meta, arch)
    if kind in ("none", "longrope"):
        return None
    if kind != "linear":
        raise UnsupportedArchitectureError(f"{arch}.rope.scaling.type {kind!r} is not supported "
                                           f"(none, linear, yarn or longrope)")
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear") or 0.0)
    return None if factor in (0.0, 1.0) else {"rope_type": "linear", "factor": factor}


def gguf_yarn_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """A GGUF file's YaRN in kvgen's form, giving transformers' numbers for what llama.cpp's converter wrote.

    ``{arch}.rope.scaling.factor`` (llama.cpp's factor, as stored), ``original_context_length`` (absent:
    ``context_length``), ``yarn_beta_fast`` / ``yarn_beta_slow`` (32 / 1 when absent) and a correction range
    rounded outwards (``ggml_rope_yarn_corr_dims`` always rounds: transformers' ``truncate`` True). The cos/sin
    scale: ``yarn_attn_factor`` (the converter's copy of transformers' ``attention_factor``) when present, else
    ``mscale(factor)``, times ``rope.scaling.attn_factor`` (llama.cpp scales every rotation by it). Raises
    ``UnsupportedArchitectureError`` naming a ``yarn_ext_factor`` other than 1 (negative: unset, llama.cpp's 1) and
    a non-zero ``yarn_log_multiplier`` (DeepSeek's mscale_all_dim, read by llama.cpp for other architectures).
    """
    key = f"{arch}.rope.scaling."
    ext_factor = float(meta.get(key + "yarn_ext_factor", -1.0))
    if ext_factor >= 0 and ext_factor != 1.0:
        raise UnsupportedArchitectureError(f"{key}yarn_ext_factor={ext_factor} is not supported (1: YaRN's blend)")
    if float(meta.get(key + "yarn_log_multiplier") or 0.0) != 0.0:
        raise UnsupportedArchitectureError(f"{key}yarn_log_multiplier={meta[key + 'yarn_log_multiplier']} is not "
                                           f"supported (kvgen reads YaRN of Llama-family files)")
    factor = float(meta.get(key + "factor") or meta.get(f"{arch}.rope.scale_linear") or 1.0)
    original = meta.get(key + "original_context_length") or meta.get(f"{arch}.context_length")
    if original is None:
        raise ModelFormatError(f"GGUF metadata with yarn rope scaling lacks {key}original_context_length")
    attention_factor = meta.get(key + "yarn_attn_factor")
    attention_factor = yarn_mscale(factor) if attention_factor is None else float(attention_factor)
    return check_yarn_scaling({
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
        "beta_fast": float(meta.get(key + "yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get(key + "yarn_beta_slow", 1.0)), "truncate": True,
        "attention_factor": attention_factor * float(meta.get(key + "attn_factor", 1.0))})


def yarn_inv_freq(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` float32 of a yarn rope_scaling in kvgen's form: each blended between theta^(-2i/D)
    (extrapolation) and theta^(-2i/D) / factor (interpolation) by a linear ramp over the dimensions whose
    wavelengths turn between ``beta_fast`` and ``beta_slow`` times in the original length (dimensions below the
    range keep their frequency, those above are divided by the factor). transformers' expression, bit for bit.
    """
    factor = float(scaling["factor"])
    pos_freqs = rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs  # [D/2]
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)  # [D/2]
    low, high = _correction_range(head_dim, rope_theta, scaling)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")  # [D/2], CPU even when building on meta
    ramp = ((dims - low) / (high - low)).clamp(0, 1)  # [D/2]
    extrapolation = 1 - ramp  # [D/2]: 1 for the fast (high-frequency) dimensions, 0 for the slow ones
    return inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation


def _correction_range(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> tuple[float, float]:
    """The dimensions (of D/2) where the ramp starts and ends: those turning ``beta_fast`` and ``beta_slow`` times
    in the original length, rounded outwards when ``truncate``, clipped to [0, D - 1]."""
    original = int(scaling["original_max_position_embeddings"])

    def dim_of(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope_theta))

    low, high = dim_of(float(scaling["beta_fast"])), dim_of(float(scaling["beta_slow"]))
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)
