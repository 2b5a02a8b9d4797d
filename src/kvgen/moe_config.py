"""The mixture-of-experts fields of ``ModelConfig`` (Qwen3-MoE, Qwen2-MoE, Mixtral) read from a Hugging Face
``config.json`` (:func:`hf_moe_fields`) or from GGUF metadata (:func:`gguf_moe_fields`), and gpt-oss's whole
configuration (:func:`hf_gpt_oss_kwargs`, :func:`gguf_gpt_oss_changes`: its router, experts and activation follow
from ``model_type`` ``gpt_oss``); ``ModelConfig`` validates them and says which layers are sparse
(``is_sparse_layer``), ``kvgen.models.moe`` computes them.
"""

from __future__ import annotations

from typing import Any

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.llama_config import positive_int

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
    key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    positive_int(f"{model_type} {key}", cfg[key])  # 0 loaded a dense model
    if model_type == "mixtral":
        return {"num_experts": cfg["num_local_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    names = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ModelFormatError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    changes = {k: cfg[k] for k in names} | {"mlp_only_layers": dense}
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
    # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (1); gpt-oss: SOFTMAX_WEIGHT (3: softmax of the top k logits)
    if gating not in ((None, 3) if arch == "gpt-oss" else (None, 1)):
        wanted = "3, softmax of the top-k weights" if arch == "gpt-oss" else "softmax only"
        raise UnsupportedArchitectureError(f"{arch}.expert_gating_func={gating} is not supported ({wanted})")
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


# transformers 4.55 GptOssConfig's defaults: save_pretrained leaves out the values equal to them
_GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "rope_theta": 150000.0, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
}
GPT_OSS_SWIGLU_LIMIT = 7.0  # GptOssExperts.limit: a constant of transformers' and llama.cpp's code


def hf_gpt_oss_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig arguments of a ``gpt_oss`` config.json (completed with transformers' defaults): q/k/v/o biases
    where ``attention_bias`` (GptOssConfig's default true),
    ``num_local_experts`` experts of ``intermediate_size`` in every layer (top-k of the router's logits, softmax over
    those k: no other renormalization), ``layer_types`` alternating sliding (even layers) / full when absent, the
    yarn ``rope_scaling`` completed by :func:`kvgen.rope_scaling.hf_yarn_scaling` (``truncate`` honoured). Raises
    ``UnsupportedArchitectureError`` for a ``swiglu_limit`` other than 7 (the experts' clamp, fixed in transformers)
    and ``ModelFormatError`` (by ``ModelConfig``) for bad values. Source: transformers 4.55 ``GptOssConfig``,
    ``GptOssMLP``."""
    from kvgen.rope_scaling import hf_yarn_scaling

    cfg = _GPT_OSS_DEFAULTS | cfg
    limit = cfg.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)
    if limit != GPT_OSS_SWIGLU_LIMIT:
        raise UnsupportedArchitectureError(f"gpt_oss with swiglu_limit={limit} is not supported (7.0, as transformers)")
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
             "tie_word_embeddings", "sliding_window", "num_experts_per_tok", "bos_token_id", "eos_token_id",
             "pad_token_id")
    scaling = cfg.get("rope_scaling") or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
        scaling = hf_yarn_scaling(scaling, int(cfg["max_position_embeddings"]))
    return {k: cfg[k] for k in names if k in cfg} | {
        "model_type": "gpt_oss", "attention_bias": cfg.get("attention_bias", True), "layer_types": list(kinds),
        "rope_scaling": scaling,
        "num_experts": cfg["num_local_experts"], "moe_intermediate_size": cfg["intermediate_size"],
        "extra": {"hf_model_type": "gpt_oss"}}


def gguf_gpt_oss_changes(meta: dict[str, Any], intermediate_size: int | None) -> dict[str, Any]:
    """What a ``gpt-oss`` GGUF file changes of the llama-family arguments: model_type ``gpt_oss``, the experts
    (:func:`gguf_moe_fields`: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``), llama.cpp's
    constant layer pattern (``set_swa_pattern(2)``: even layers sliding) with ``attention.sliding_window``, and the
    YaRN ``rope.scaling`` keys (:func:`kvgen.rope_scaling.gguf_yarn_scaling`) with the correction range unrounded
    (``truncate`` False: gpt-oss's config.json and transformers; llama.cpp's ``ggml_rope_yarn_corr_dims`` rounds it
    outwards for every model, so its frequencies differ from the model's in the ramp's edge dimensions and kvgen
    follows the model). Raises ``ModelFormatError`` naming a missing ``attention.sliding_window`` or expert key and
    ``UnsupportedArchitectureError`` for another rope scaling type. Source: llama.cpp ``llama-model.cpp``
    (LLM_ARCH_OPENAI_MOE), ``convert_hf_to_gguf.py`` ``GptOssModel``."""
    from kvgen.rope_scaling import gguf_yarn_scaling

    arch = "gpt-oss"
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        raise ModelFormatError(f"GGUF metadata of gpt-oss lacks {arch}.attention.sliding_window (or it is 0)")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "yarn"):
        raise UnsupportedArchitectureError(f"{arch}.rope.scaling.type {kind!r} is not supported (yarn or none)")
    scaling = gguf_yarn_scaling(meta, arch) | {"truncate": False} if kind == "yarn" else None
    layers = int(meta[f"{arch}.block_count"])
    return gguf_moe_fields(meta, arch, intermediate_size) | {
        "model_type": "gpt_oss", "norm_topk_prob": False, "sliding_window": int(window), "rope_scaling": scaling,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
