"""The mixture-of-experts fields of ``ModelConfig`` (Qwen3-MoE, Qwen2-MoE, Mixtral) read from a Hugging Face
``config.json`` (:func:`hf_moe_fields`) or from GGUF metadata (:func:`gguf_moe_fields`); ``ModelConfig`` validates
them and says which layers are sparse (``is_sparse_layer``), ``kvgen.models.moe`` computes them.
"""

from __future__ import annotations

from typing import Any

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError

HF_MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# ModelConfig's mixture-of-experts fields: set per model_type by hf_moe_fields, never copied from a config.json as is
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "shared_expert_intermediate_size")


def hf_moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a ``qwen3_moe`` / ``qwen2_moe`` / ``mixtral`` config.json (``cfg`` completed
    with transformers' defaults; none for other model_types). Mixtral: ``num_local_experts`` experts of
    ``intermediate_size`` in every layer, top-k always renormalized; Qwen2-MoE: a shared expert. Source:
    transformers 4.55 ``Qwen3MoeConfig``, ``Qwen2MoeConfig``, ``MixtralConfig`` and their sparse MoE blocks."""
    if model_type not in HF_MOE_TYPES:
        return {}
    if model_type == "mixtral":
        return {"num_experts": cfg["num_local_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    names = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")
    changes = {k: cfg[k] for k in names} | {"mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []]}
    if model_type == "qwen2_moe":
        changes["shared_expert_intermediate_size"] = cfg["shared_expert_intermediate_size"]
    return changes


def gguf_moe_fields(meta: dict[str, Any], arch: str, intermediate_size: int | None) -> dict[str, Any]:
    """The mixture-of-experts fields of a ``qwen3moe``, ``qwen2moe`` or (``expert_count`` > 0: Mixtral) ``llama``
    file: ``expert_count``, ``expert_used_count``, the experts' size ``expert_feed_forward_length`` (llama: the
    ``feed_forward_length``; absent: feed_forward_length / expert_used_count, llama.cpp's fallback), qwen2moe's
    ``expert_shared_feed_forward_length`` (absent: feed_forward_length), and llama.cpp's constants for the
    rest: softmax gating, top-k weights renormalized for qwen3moe and llama, not for qwen2moe; every layer sparse
    (the loader makes a layer without ``ffn_gate_inp`` but with ``ffn_up`` dense). Raises ``ModelFormatError`` for
    missing counts or ``expert_used_count`` > ``expert_count``, and ``UnsupportedArchitectureError`` for a gating
    function or weight scale llama.cpp does not apply to these architectures. Source: llama.cpp ``llama-model.cpp``
    / ``models/qwen3moe.cpp``, ``qwen2moe.cpp``, ``llama.cpp`` (``build_moe_ffn``), ``convert_hf_to_gguf.py``
    ``Qwen2MoeModel``."""
    for key in ("expert_count", "expert_used_count"):
        if not int(meta.get(f"{arch}.{key}") or 0):
            raise ModelFormatError(f"GGUF metadata of a {arch} mixture of experts lacks {arch}.{key} (or it is 0)")
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedArchitectureError(f"{arch}.expert_gating_func={gating} is not supported (softmax only)")
    scale = float(meta.get(f"{arch}.expert_weights_scale") or 0.0)
    if scale not in (0.0, 1.0):
        raise UnsupportedArchitectureError(f"{arch}.expert_weights_scale={scale} is not supported")
    used, count = int(meta[f"{arch}.expert_used_count"]), int(meta[f"{arch}.expert_count"])
    if used > count:
        raise ModelFormatError(f"{arch}.expert_used_count ({used}) must be at most {arch}.expert_count ({count})")
    if arch == "llama":
        expert_size = intermediate_size
    else:
        expert_size = meta.get(f"{arch}.expert_feed_forward_length") or (intermediate_size or 0) // used or None
    if not expert_size:
        raise ModelFormatError(f"GGUF metadata of {arch} gives no expert size ({arch}.expert_feed_forward_length)")
    changes = {"num_experts": count, "num_experts_per_tok": used,
               "moe_intermediate_size": int(expert_size), "norm_topk_prob": arch != "qwen2moe",
               "intermediate_size": intermediate_size or int(expert_size)}
    if arch == "qwen2moe":
        shared = meta.get("qwen2moe.expert_shared_feed_forward_length") or intermediate_size
        if not shared:
            raise ModelFormatError("GGUF metadata of qwen2moe lacks qwen2moe.expert_shared_feed_forward_length")
        changes["shared_expert_intermediate_size"] = int(shared)
    return changes
