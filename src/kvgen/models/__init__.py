"""Decoders and the registry keyed by ``model_type``.

Contract (DESIGN.md): ``model(input_ids [B, T], positions [B, T], kv_cache,
attn_metadata) -> hidden [B, T, C]`` and ``model.compute_logits(hidden) ->
logits [..., V] float32``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.models.attention import AttentionMetadata
from kvgen.models.gpt2 import GPT2LMHeadModel
from kvgen.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> nn.Module:
    """Instantiate the decoder for ``config.model_type`` and load ``state_dict`` strictly.

    Tensors are adopted without a copy when already in ``dtype`` (the module is
    built on the meta device, so peak memory stays at one set of weights).
    Raises ``UnsupportedArchitectureError`` for an unknown model_type and
    ``ModelFormatError`` listing missing/unexpected/mis-shaped parameters.
    """
    cls = MODEL_REGISTRY.get(config.model_type)
    if cls is None:
        raise UnsupportedArchitectureError(f"no decoder registered for model_type {config.model_type!r}")
    with torch.device("meta"):
        model = cls(config)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ModelFormatError(f"checkpoint does not match {cls.__name__}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, param in expected.items():
        if tuple(state_dict[name].shape) != tuple(param.shape):
            raise ModelFormatError(
                f"parameter {name} has shape {tuple(state_dict[name].shape)}, expected {tuple(param.shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # non-persistent buffers (rope inv_freq) are recomputed on CPU
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module.register_buffer(attr, _recompute_buffer(config, attr), persistent=False)
    model.requires_grad_(False)
    return model.eval()


def _recompute_buffer(config: ModelConfig, name: str) -> torch.Tensor:
    from kvgen.models.layers import rope_inv_freq

    if name == "inv_freq":
        return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    raise AssertionError(f"unknown buffer {name}")


__all__ = ["MODEL_REGISTRY", "AttentionMetadata", "GPT2LMHeadModel", "LlamaForCausalLM", "build_model"]
