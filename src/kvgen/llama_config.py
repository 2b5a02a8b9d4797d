"""What Llama-family models change of a Llama, read from a Hugging Face ``config.json`` or GGUF metadata, for
:class:`kvgen.config.ModelConfig`: Mistral's and Phi-3's windows, Qwen's biases and q/k norms, SmolLM3's NoPE layers,
Phi-3's LongRoPE and Phi-4-mini's partial rotary, Granite's multipliers, ERNIE 4.5's interleaved RoPE."""

from __future__ import annotations

import math
from typing import Any

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.rope_scaling import hf_yarn_scaling, positive_scaling_value, rope_scaling_type

# rope.dimension_count below the head size: read for these rotate-half architectures only
_GGUF_PARTIAL_ROTARY_ARCHS = ("phi3",)
# Hugging Face model_types whose q_proj / k_proj rows rotate interleaved pairs (2i, 2i + 1) (transformers' Ernie4_5
# apply_rotary_pos_emb): the loader moves them into rotate-half order, as it does for a llama GGUF file's
INTERLEAVED_ROPE_MODEL_TYPES = ("ernie4_5",)
# The model_types whose transformers 4.55 modules read the config's attention_bias / mlp_bias; the others' have no
# such biases whatever their config.json says (Qwen2, Qwen2-MoE and ERNIE 4.5 set theirs below)
_ATTENTION_BIAS_TYPES = ("llama", "qwen3", "smollm3", "granite", "qwen3_moe")
_MLP_BIAS_TYPES = ("llama", "smollm3", "granite")
# ModelConfig fields that only this model_type's transformers 4.55 modules read from a config.json (None: none of the
# Llama family's; Qwen3's q/k norms come with its model_type): the others ignore them, as transformers does
_HF_FIELD_OWNERS = {"embedding_multiplier": "granite", "residual_multiplier": "granite",
                    "attention_multiplier": "granite", "logits_scaling": "granite", "no_rope_layers": "smollm3",
                    "use_qk_norm": None}


def hf_unread_fields(model_type: str) -> set[str]:
    """The ModelConfig fields a Llama-family ``model_type``'s config.json may hold but transformers 4.55 does not read
    for it (a Granite multiplier or SmolLM3's ``no_rope_layers`` in a Llama config changes nothing there)."""
    return {name for name, owner in _HF_FIELD_OWNERS.items() if owner != model_type}


def granite_gguf_fields(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """A ``granite`` file's multipliers as ModelConfig fields: ``attention.scale`` (absent or 0: None, head_dim^-0.5,
    as llama.cpp reads it), ``embedding_scale``, ``residual_scale`` and ``logit_scale`` (1 when absent). Source:
    llama.cpp ``convert_hf_to_gguf.py`` ``GraniteModel``."""
    return {"attention_multiplier": float(meta.get(f"{arch}.attention.scale") or 0.0) or None,
            "embedding_multiplier": float(meta.get(f"{arch}.embedding_scale", 1.0)),
            "residual_multiplier": float(meta.get(f"{arch}.residual_scale", 1.0)),
            "logits_scaling": float(meta.get(f"{arch}.logit_scale", 1.0))}


def gguf_partial_rotary_factor(meta: dict[str, Any], arch: str, head_dim: int) -> float:
    """``{arch}.rope.dimension_count`` / head_dim: 1.0 when absent or equal; below 1 for the rotate-half (NEOX)
    architectures llama.cpp stores unpermuted (phi3: Phi-4-mini). Raises ``UnsupportedArchitectureError`` elsewhere
    (llama's pairs are interleaved over the rotated part only) and ``ModelFormatError`` for a count that is not an even
    number in [2, head_dim]."""
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is None or int(rope_dim) == head_dim:
        return 1.0
    if arch not in _GGUF_PARTIAL_ROTARY_ARCHS:
        raise UnsupportedArchitectureError(f"partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim="
                                           f"{head_dim}) are supported for {', '.join(_GGUF_PARTIAL_ROTARY_ARCHS)} files, "
                                           f"not {arch}")
    factor = int(rope_dim) / head_dim
    if not 2 <= int(rope_dim) <= head_dim or int(rope_dim) % 2 or int(head_dim * factor) != int(rope_dim):
        raise ModelFormatError(f"{arch}.rope.dimension_count must be an even number in [2, head_dim = {head_dim}], "
                               f"got {rope_dim}")
    return factor


def _has_sliding_layers(cfg: dict[str, Any], model_type: str) -> bool:
    """Whether a Qwen config's attention slides in any layer, as transformers 4.55's ``Qwen2Config`` reads it: its
    ``sliding_window`` (default 4096) counts only with ``use_sliding_window``, on the layers ``layer_types`` names
    ``sliding_attention`` (default: those from ``max_window_layers``, 28, on); a window as long as
    ``max_position_embeddings`` (default 32768) slides nothing. Qwen2-MoE's and Qwen3-MoE's masks slide every layer
    (``Qwen2MoeModel._update_causal_mask``, ``Qwen3MoeModel``: neither reads ``max_window_layers`` nor ``layer_types``)."""
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    if window is None or window >= cfg.get("max_position_embeddings", 32768):
        return False
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return True
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        return cfg.get("max_window_layers", 28) < cfg.get("num_hidden_layers", 0)
    return "sliding_attention" in layer_types


def _smollm3_slides(cfg: dict[str, Any], no_rope_layers: Any) -> bool:
    """Whether transformers 4.55 slides any SmolLM3 layer: its ``layer_types`` (absent: ``sliding_attention`` for the
    NoPE layers when ``use_sliding_window`` and a ``sliding_window``) name a sliding layer, and its mask then takes
    ``sliding_window`` whatever ``use_sliding_window`` says (``create_sliding_window_causal_mask``; the attention's own
    ``sliding_window``, which only flash attention reads, follows ``use_sliding_window``)."""
    window, layer_types = cfg.get("sliding_window"), cfg.get("layer_types")
    if layer_types is None:
        return bool(cfg.get("use_sliding_window")) and window is not None and 0 in (no_rope_layers or [])
    return isinstance(layer_types, list) and "sliding_attention" in layer_types and (  # else ModelConfig names it
        window is not None or bool(cfg.get("use_sliding_window")))


def llama_family_changes(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """What Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite and ERNIE 4.5 change of a Llama (Granite: only its
    multipliers, read as the config's own fields with GraniteConfig's defaults of 1.0; ERNIE 4.5: ``use_bias`` for
    every projection, its interleaved q/k rows reordered by the loader): SmolLM3 skips RoPE in its ``no_rope_layers``
    (NoPE); ``attention_bias`` / ``mlp_bias`` count only where transformers reads them (``_ATTENTION_BIAS_TYPES``,
    ``_MLP_BIAS_TYPES``); Qwen2 biases q/k/v (not o_proj); Qwen3 normalizes each
    head's q and k (``use_qk_norm``; its ``head_dim`` may differ from hidden_size / heads); Mistral's and Phi-3's
    sliding window bounds the context (attention within the window is exact; longer contexts are refused, not
    approximated); a LongRoPE ``rope_scaling`` is completed by :func:`_hf_longrope`, a YaRN one by
    :func:`kvgen.rope_scaling.hf_yarn_scaling` (read as transformers reads it, even when it holds every key of kvgen's
    form). Phi-3 checkpoints stack q/k/v and
    gate/up themselves (``weights.name_maps``). Raises ``UnsupportedArchitectureError`` for Qwen2/Qwen3 sliding-window
    layers (a ``use_sliding_window`` that slides no layer is taken) and a ``partial_rotary_factor`` below 1 outside Phi-3 (Phi-4-mini's is taken). Source: transformers 4.55 ``MistralConfig`` /
    ``Qwen2Config`` / ``Qwen3Config`` / ``Phi3Config`` / ``SmolLM3Config`` and their attention modules."""
    changes: dict[str, Any] = {"model_type": "llama", "extra": {"hf_model_type": model_type}}
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and _has_sliding_layers(cfg, model_type):
        raise UnsupportedArchitectureError(f"{model_type} with use_sliding_window=true and sliding layers (a "
                                           f"sliding_window under max_position_embeddings) is not supported")
    rotary = cfg.get("partial_rotary_factor")
    if rotary is None:
        rotary = 1.0
    elif isinstance(rotary, bool) or not isinstance(rotary, (int, float)):
        raise ModelFormatError(f"partial_rotary_factor must be a number, got {rotary!r}")
    if rotary != 1.0 and model_type != "phi3":  # transformers' other Llama-family attentions rotate whole heads
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor must be 1.0 for {model_type} (kvgen rotates part of each head for phi3 only, "
            f"as transformers does), got {rotary}")
    changes["partial_rotary_factor"] = rotary
    for name, types in (("attention_bias", _ATTENTION_BIAS_TYPES), ("mlp_bias", _MLP_BIAS_TYPES)):
        if model_type not in types:
            changes[name] = False
    if model_type == "qwen2":
        changes |= {"attention_bias": True, "o_proj_bias": False}
    if model_type == "qwen2_moe":  # Qwen2MoeAttention: q/k/v biased as qkv_bias says, o_proj never
        changes |= {"attention_bias": bool(cfg.get("qkv_bias", True)), "o_proj_bias": False}
    if model_type in ("qwen3", "qwen3_moe"):
        changes["use_qk_norm"] = True
    if model_type == "ernie4_5":  # one use_bias for every projection
        bias = bool(cfg.get("use_bias", False))
        changes |= {"attention_bias": bias, "mlp_bias": bias}
    if model_type == "smollm3":  # NoPE layers; sliding-window layers are refused
        if cfg.get("no_rope_layers") is None:
            interval = positive_int("no_rope_layer_interval", cfg.get("no_rope_layer_interval", 4))
            changes["no_rope_layers"] = no_rope_every(interval, positive_int("num_hidden_layers",
                                                                              cfg["num_hidden_layers"]))
        if _smollm3_slides(cfg, changes.get("no_rope_layers", cfg.get("no_rope_layers"))):
            raise UnsupportedArchitectureError("smollm3 with sliding-window layers is not supported")
    window = cfg.get("sliding_window") if model_type in ("mistral", "phi3", "mixtral") else None
    if window is not None and positive_int("sliding_window", window) < positive_int(
            "max_position_embeddings", cfg.get("max_position_embeddings", 2048)):
        changes["max_position_embeddings"] = int(window)
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ModelFormatError(f"rope_scaling must be an object (or null), got {scaling!r}")
    kind = rope_scaling_type(scaling)
    if kind == "longrope" or (model_type == "phi3" and kind in ("su", "yarn")):  # Phi3Config renames su / yarn
        changes["rope_scaling"] = _hf_longrope(cfg, scaling, model_type)
    elif kind == "yarn":  # its factor from the config's own max_position_embeddings, before a window bounds them
        changes["rope_scaling"] = hf_yarn_scaling(scaling, positive_int("max_position_embeddings",
                                                                         cfg.get("max_position_embeddings", 2048)))
    return changes


def positive_int(key: str, value: Any) -> int:
    """``value``, the config.json's ``key``; ``ModelFormatError`` naming the key unless it is a positive integer
    (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"{key} must be a positive integer, got {value!r}")
    return value


def no_rope_every(interval: int, num_layers: int) -> list[int]:
    """SmolLM3's ``no_rope_layers``: 0 (no RoPE) for every ``interval``-th layer, 1 elsewhere. Source: transformers
    4.55 ``SmolLM3Config`` (``int((i + 1) % interval != 0)``), llama.cpp ``n_no_rope_layer_step``."""
    return [int((i + 1) % interval != 0) for i in range(num_layers)]


def _hf_longrope(cfg: dict[str, Any], scaling: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A config.json's LongRoPE rope_scaling completed as :func:`longrope_scaling`: the original length and the
    scale come from the top-level ``original_max_position_embeddings`` when present (Phi3Config's default: 4096),
    else the rope_scaling's ``factor`` over ``max_position_embeddings``. Source: transformers 4.55
    ``_compute_longrope_parameters``."""
    max_len = positive_int("max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    original = cfg.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
    if original is not None:
        original = positive_int("original_max_position_embeddings", original)
    if original:
        factor = max_len / original
    else:
        factor = positive_scaling_value(scaling, "factor", "longrope") if scaling.get("factor") else 1.0
    for key in ("short_factor", "long_factor"):
        _check_factor_list(scaling, key)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None:
        attention_factor = positive_scaling_value(scaling, "attention_factor", "longrope")
    try:
        return longrope_scaling(scaling["short_factor"], scaling["long_factor"], original or max_len, factor,
                                attention_factor)
    except KeyError as e:
        raise ModelFormatError(f"longrope rope_scaling lacks {e.args[0]!r}") from None


def _check_factor_list(scaling: dict[str, Any], key: str) -> None:
    """``ModelFormatError`` unless LongRoPE's ``scaling[key]`` (absent: the caller's to report) is a list of positive
    numbers."""
    values = scaling.get(key)
    if values is not None and not (isinstance(values, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values)):
        raise ModelFormatError(f"longrope rope_scaling {key} must be a list of positive numbers, got {values!r}")


def longrope_scaling(short_factor: list[float], long_factor: list[float], original_max_position_embeddings: int,
                     factor: float, attention_factor: float | None = None) -> dict[str, Any]:
    """LongRoPE (Phi-3 128k, Phi-3.5) rope_scaling in kvgen's form, from HF's config or a GGUF file.

    short_factor, long_factor: ``head_dim / 2`` divisors of the frequencies (within / past the original length);
    factor: context length / original length. ``attention_factor`` (the scale of cos and sin) defaults to
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``, 1 when factor <= 1. Sources: transformers 4.55
    ``_compute_longrope_parameters``; llama.cpp ``convert_hf_to_gguf.py`` ``Phi3MiniModel`` (``rope.scaling.attn_factor``).
    """
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))
    return {
        "rope_type": "longrope",
        "short_factor": [float(x) for x in short_factor],
        "long_factor": [float(x) for x in long_factor],
        "original_max_position_embeddings": int(original_max_position_embeddings),
        "attention_factor": float(attention_factor),
    }
