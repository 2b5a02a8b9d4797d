"""Reading Gemma 3 and Gemma 2 configurations: their ``config.json`` (transformers' ``Gemma3TextConfig`` /
``Gemma2Config``) and what their GGUF files (llama.cpp's ``gemma3`` / ``gemma2`` architectures) change of the
llama-family arguments; ``ModelConfig`` (kvgen.config) calls these."""

from __future__ import annotations

from typing import Any

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.rope_scaling import rope_scaling_type


def gemma3_kwargs(cfg: dict[str, Any], model_type: str = "gemma3_text") -> dict[str, Any]:
    """ModelConfig arguments of a Gemma 3 text or (``model_type`` ``gemma2``) Gemma 2 ``config.json`` (``cfg``
    completed with transformers' defaults): GeGLU; Gemma 3: q/k norms, ``layer_types`` (from
    ``sliding_window_pattern``, 6 by default, when absent), a ``linear`` rope_scaling for the full-attention layers
    only; Gemma 2: no q/k norms, ``layer_types`` alternating (even layers sliding) when absent, one RoPE for every
    layer, attention and final logit softcapping. Raises ``UnsupportedArchitectureError`` naming logit softcapping in
    Gemma 3 (None in its checkpoints), an activation other than ``gelu_pytorch_tanh`` or another rope type. Source:
    transformers 4.55 ``Gemma3TextConfig`` / ``Gemma3TextModel`` (``rotary_emb_local``), ``Gemma2Config``."""
    is_gemma3 = model_type == "gemma3_text"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if is_gemma3 and cfg.get(name) is not None:
            raise UnsupportedArchitectureError(f"gemma3_text with {name}={cfg[name]} is not supported (kvgen computes "
                                               f"no logit softcapping for Gemma 3; its checkpoints have none)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedArchitectureError(f"{model_type} hidden_activation must be 'gelu_pytorch_tanh', got {act!r}")
    scaling = cfg.get("rope_scaling") or None
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelFormatError(f"rope_scaling must be an object (or null), got {scaling!r}")
    kind = rope_scaling_type(scaling) if scaling else None
    if kind not in (None, "default", "linear"):
        raise UnsupportedArchitectureError(f"{model_type} rope_scaling type {kind!r} is not supported (linear or none)")
    pattern = cfg.get("sliding_window_pattern", 6) if is_gemma3 else 2  # Gemma2Config: sliding where (i + 1) % 2
    kinds = cfg.get("layer_types") or gemma3_layer_types(pattern, cfg["num_hidden_layers"])
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
             "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window",
             "query_pre_attn_scalar", *(("rope_local_base_freq",) if is_gemma3 else
                                        ("attn_logit_softcapping", "final_logit_softcapping")))
    return {k: cfg[k] for k in names if k in cfg} | {
        "model_type": model_type, "hidden_act": act, "use_qk_norm": is_gemma3,
        "layer_types": list(kinds) if isinstance(kinds, (list, tuple)) else kinds,  # else ModelConfig names it
        "rope_scaling": scaling if kind == "linear" else None, "extra": {"hf_model_type": model_type}}


def gemma3_layer_types(pattern: int | list[bool], num_layers: int) -> list[str]:
    """Gemma 3's ``layer_types``: with an int pattern every ``pattern``-th layer full attention, the others sliding
    (transformers 4.55 ``Gemma3TextConfig``, llama.cpp ``set_swa_pattern(6)``); a list of flags (a GGUF
    ``attention.sliding_window_pattern`` array) says per layer whether it slides. ModelFormatError for a bad value."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelFormatError(f"sliding_window_pattern must hold a flag per layer ({num_layers}), got {pattern}")
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]
    if int(pattern) < 1:
        raise ModelFormatError(f"sliding_window_pattern must be >= 1, got {pattern}")
    return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)]


def gemma3_gguf_changes(meta: dict[str, Any], kwargs: dict[str, Any], window: Any) -> dict[str, Any]:
    """What a ``gemma3`` GGUF file changes of the llama-family arguments ``kwargs``: llama.cpp's constants for the
    keys its converter leaves out (every 6th layer full attention, local RoPE base 10000, the attention scale
    head_dim^-0.5 except hidden / heads for the 62-layer 27B) unless the file has them, a linear
    ``rope.scaling`` for the full layers. Norm weights already hold 1 + w. Raises ``UnsupportedArchitectureError``
    for logit softcapping or another rope scaling type. Source: llama.cpp ``llama-model.cpp`` (LLM_ARCH_GEMMA3),
    ``convert_hf_to_gguf.py`` ``Gemma3Model``."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if float(meta.get(f"gemma3.{key}") or 0.0) != 0.0:
            raise UnsupportedArchitectureError(f"gemma3 file with {key}={meta[f'gemma3.{key}']} is not supported")
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    kind, factor = meta.get("gemma3.rope.scaling.type"), float(meta.get("gemma3.rope.scaling.factor") or 1.0)
    if kind not in (None, "none", "linear"):
        raise UnsupportedArchitectureError(f"gemma3 rope.scaling.type {kind!r} is not supported (linear or none)")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    return {
        "model_type": "gemma3_text", "hidden_act": "gelu_pytorch_tanh", "use_qk_norm": True,
        "layer_types": gemma3_layer_types(list(pattern) if isinstance(pattern, (list, tuple)) else pattern, layers),
        "sliding_window": int(window), "rope_local_base_freq": float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else kwargs["head_dim"]),
        "rope_scaling": {"rope_type": "linear", "factor": factor} if kind == "linear" and factor != 1.0 else None,
        "rms_norm_eps": float(meta.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
    }


def gemma2_gguf_changes(meta: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a ``gemma2`` GGUF file changes of the llama-family arguments ``kwargs``: llama.cpp's constants for what
    it does not store (every other layer sliding, even layers first; the attention scale head_dim^-0.5 except
    hidden / heads for the 46-layer 27B) and for the keys it may leave out (sliding window 4096, softcapping 50 and
    30). Norm weights already hold 1 + w; q/k rows are Hugging Face's. A stored softcap that is not positive is
    refused (``ModelFormatError``, by ``ModelConfig``). Source: llama.cpp ``llama-model.cpp`` (LLM_ARCH_GEMMA2:
    ``set_swa_pattern(2)``, ``f_attention_scale``), ``models/gemma2-iswa.cpp``, ``convert_hf_to_gguf.py``
    ``Gemma2Model``."""
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    return {
        "model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh", "layer_types": gemma3_layer_types(2, layers),
        "sliding_window": int(meta.get("gemma2.attention.sliding_window", 4096)),
        "query_pre_attn_scalar": float(hidden // heads if layers == 46 else kwargs["head_dim"]),
        "attn_logit_softcapping": float(meta.get("gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.get("gemma2.final_logit_softcapping", 30.0)),
        "rms_norm_eps": float(meta.get("gemma2.attention.layer_norm_rms_epsilon", 1e-6)),
    }
