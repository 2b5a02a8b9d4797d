"""``kvgen info``: what a model is, without generating anything."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvgen.loader import load_model, resolve_model_path


def num_parameters(model) -> int:
    """Weights of the model, counting a quantized matrix by its logical shape (out x in) and tied ones once."""
    from kvgen.models.quant_linear import QuantLinear

    dense = sum(p.numel() for p in model.parameters())
    return dense + sum(m.in_features * m.out_features for m in {id(m): m for m in model.modules() if isinstance(m, QuantLinear)}.values())


def _storage_types(path: Any) -> dict[str, int]:
    """Tensor count per storage type (GGUF quantization types, or safetensors dtype names of the files and keys the loader
    reads: :func:`kvgen.weights.hf_loader.weight_files`, not every ``*.safetensors`` of the directory)."""
    if path.is_dir():
        from kvgen.weights.hf_loader import open_weights, weight_files

        counts: Counter[str] = Counter()
        for file, keys in weight_files(path).items():
            with open_weights(file) as f:
                for key in f.keys() if keys is None else keys:  # noqa: SIM118 -- a weights handle, not a dict
                    counts[str(f.get_slice(key).get_dtype())] += 1
        return dict(counts)
    from kvgen.weights.gguf_file import open_gguf

    reader = open_gguf(path)
    return dict(Counter(t.tensor_type.name for t in reader.tensors))


def describe_model(path_or_name: str = "default") -> dict[str, Any]:
    """Architecture, parameter count, sizes, context length, storage types and tokenizer facts."""
    path = resolve_model_path(path_or_name)
    model, tok = load_model(path)
    cfg = model.config
    return {
        "path": str(path),
        "format": "huggingface" if path.is_dir() else "gguf",
        "architecture": cfg.extra.get("gguf_architecture") or cfg.extra.get("hf_model_type") or cfg.model_type,
        "decoder": cfg.model_type,  # kvgen's decoder class family (qwen2/3, phi3, mistral, smollm3 run as llama)
        "num_parameters": num_parameters(model),
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        **({"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size} if cfg.has_experts else {}),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta if cfg.model_type != "gpt2" else None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "storage_types": _storage_types(path),
        "tokenizer": {
            "vocab_size": tok.vocab_size,
            "bos_token_id": tok.bos_token_id,
            "eos_token_ids": tok.eos_token_ids,
            "pad_token_id": tok.pad_token_id,
            "add_bos_token": tok.add_bos_token,
            "has_chat_template": tok.chat_template is not None,
            "num_special_tokens": len(tok.all_special_ids),
        },
    }


def format_info(info: dict[str, Any]) -> str:
    """Human-readable lines for :func:`describe_model`'s dict."""
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        else:
            lines.append(f"{key}: {value:,}" if key == "num_parameters" else f"{key}: {value}")
    return "\n".join(lines)
