"""Decoders and the registry keyed by ``model_type``.

Contract (DESIGN.md): ``model(input_ids [B, T], positions [B, T], kv_cache,
attn_metadata) -> hidden [B, T, C]`` and ``model.compute_logits(hidden) ->
logits [..., V] float32``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.heap import return_freed_memory
from kvgen.kernels import get_ops
from kvgen.models.attention import AttentionMetadata
from kvgen.models.base import CausalLM, SupportsKernels
from kvgen.models.gemma2 import Gemma2ForCausalLM
from kvgen.models.gemma3 import Gemma3ForCausalLM, gemma3_inv_freq
from kvgen.models.gpt2 import GPT2LMHeadModel
from kvgen.models.gpt_oss import GptOssForCausalLM
from kvgen.models.llama import LlamaForCausalLM
from kvgen.models.quant_linear import QuantEmbedding, QuantLinear
from kvgen.weights.arena import WeightArena
from kvgen.weights.quantized import GGUFBlocks, stack_blocks

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def build_model(
    config: ModelConfig, state_dict: Mapping[str, torch.Tensor | GGUFBlocks], dtype: torch.dtype = torch.float32
) -> CausalLM:
    """Instantiate the decoder for ``config.model_type`` and load ``state_dict`` strictly.

    ``state_dict`` uses checkpoint (HF) names; matrices a module stacks (its
    ``packed_modules``, e.g. q/k/v into ``qkv_proj``) are concatenated here. Dense
    tensors are adopted without a copy when already in ``dtype`` (the module is built
    on the meta device, so peak memory stays at one set of weights); ``GGUFBlocks``
    become ``QuantLinear`` / ``QuantEmbedding`` modules in place of ``nn.Linear`` /
    the embedding, and are consumed (their byte blocks released as they are packed). Raises ``UnsupportedArchitectureError`` for an unknown model_type
    and ``ModelFormatError`` listing missing/unexpected/mis-shaped parameters.
    """
    cls = MODEL_REGISTRY.get(config.model_type)
    if cls is None:
        raise UnsupportedArchitectureError(f"no decoder registered for model_type {config.model_type!r}")
    with torch.device("meta"):
        model = cls(config)
    state_dict = _stack_packed(model, state_dict)
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
    dense = {k: v for k, v in state_dict.items() if not isinstance(v, GGUFBlocks)}
    arena = WeightArena()  # the packed matrices back to back in huge pages (kvgen.weights.arena)
    for name, blocks in state_dict.items():
        if isinstance(blocks, GGUFBlocks):
            _install_quantized(model, name.removesuffix(".weight"), blocks, dense, arena)
            freed = sum(p.numel() for p in blocks.parts)
            blocks.parts = []  # consumed: the file's bytes go as their packed copy arrives (peak memory)
            for release in blocks.release:  # parts that viewed a mapped file: its pages leave the resident set
                release()
            return_freed_memory(freed)  # and the copies' pages with them (kvgen.heap)
    model.load_state_dict({k: v.to(dtype) for k, v in dense.items()}, strict=False, assign=True)
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # non-persistent buffers (rope inv_freq) are recomputed on CPU
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module.register_buffer(attr, _recompute_buffer(config, attr), persistent=False)
    assert not any(p.is_meta for p in model.parameters()), "a parameter was left unloaded"
    if any(isinstance(m, QuantLinear) for m in model.modules()) and isinstance(model, SupportsKernels):
        model.use_kernels(get_ops())
    model.requires_grad_(False)
    return model.eval()


def _stack_packed(model: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` with each module's ``packed_modules`` parts concatenated by rows."""
    state = dict(state_dict)
    for module_name, module in model.named_modules():
        for fused, parts in getattr(module, "packed_modules", {}).items():
            for suffix in ("weight", "bias"):
                keys = [f"{module_name}.{part}.{suffix}" for part in parts]
                present = [k for k in keys if k in state]
                if not present:
                    continue
                if len(present) != len(keys):
                    raise ModelFormatError(f"checkpoint has {present} but not all of {keys}")
                values = [state.pop(k) for k in keys]
                if isinstance(values[0], GGUFBlocks):
                    state[f"{module_name}.{fused}.{suffix}"] = stack_blocks(values)
                    for v in values:
                        v.parts = []  # the stacked blocks hold the bytes now
                else:
                    state[f"{module_name}.{fused}.{suffix}"] = torch.cat(values)
    return state


def _install_quantized(model: nn.Module, module_name: str, blocks: GGUFBlocks, dense: dict[str, torch.Tensor],
                       arena: WeightArena) -> None:
    """Replace the linear or embedding ``module_name`` by its quantized counterpart, its packed weight in ``arena``."""
    parent_name, _, attr = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    bias = dense.pop(f"{module_name}.bias", None)
    bias = None if bias is None else bias.float()
    if blocks.part_types:  # a stack of differently typed parts: one mixed weight, packed in parts, then copied
        linear = QuantLinear.from_gguf_segments([(t.name, p) for t, p in zip(blocks.part_types, blocks.parts)],
                                                blocks.shape[1], bias)
        linear.qweight = arena.adopt(linear.qweight)
    else:  # packed straight into the arena: no large temporary freed (whose size would raise malloc's mmap threshold)
        linear = QuantLinear.from_gguf(blocks.qtype.name, blocks.parts, blocks.shape[1], bias, arena.empty)
    if isinstance(old, nn.Embedding):
        setattr(parent, attr, QuantEmbedding(linear))
    elif isinstance(old, nn.Linear):
        setattr(parent, attr, linear)
    else:
        raise ModelFormatError(f"{module_name} is a {type(old).__name__}; only linear and embedding weights may be quantized")


def kv_cache_dtype(model: nn.Module) -> torch.dtype:
    """The dtype KV caches for ``model`` store: its ``kv_cache_dtype`` if set (float16 on the
    quantized fast path), else its parameters' dtype."""
    return getattr(model, "kv_cache_dtype", None) or next(model.parameters()).dtype


KV_CACHE_DTYPES = ("auto", "int8")  # vLLM's kv_cache_dtype names kvgen takes


def cache_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The ``kv_cache_dtype`` names (vLLM's field) ``model`` takes and the dtype a KV cache then stores: "auto" is
    :func:`kv_cache_dtype`; "int8" (``torch.int8`` rows with a float32 scale each, which only the kernels read) on the
    kernels only."""
    on_kernels = getattr(model, "kernels", None) is not None
    return {"auto": kv_cache_dtype(model), **({"int8": torch.int8} if on_kernels else {})}


def check_kv_cache_dtype(name: str) -> None:
    """Raise ``ValueError`` naming the field unless ``name`` is one of ``KV_CACHE_DTYPES``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def cache_dtype(model: nn.Module, name: str = "auto") -> torch.dtype:
    """:func:`cache_dtypes`' dtype of ``name``. Raises ``ValueError`` for a name not in ``KV_CACHE_DTYPES``, or
    "int8" for a model off the kernels."""
    check_kv_cache_dtype(name)
    dtypes = cache_dtypes(model)
    if name not in dtypes:
        raise ValueError("kv_cache_dtype='int8' needs a model on kvgen's kernels (a quantized GGUF or "
                         "--quantization, dtype 'auto')")
    return dtypes[name]


def _recompute_buffer(config: ModelConfig, name: str) -> torch.Tensor:
    from kvgen.models.layers import rope_inv_freq

    if name == "inv_freq":
        return rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
    if name == "inv_freq_local":  # Gemma 3's sliding-window layers (Gemma 2's: inv_freq's values)
        return gemma3_inv_freq(config, local=True)
    raise AssertionError(f"unknown buffer {name}")


__all__ = ["KV_CACHE_DTYPES", "MODEL_REGISTRY", "AttentionMetadata", "CausalLM", "GPT2LMHeadModel", "Gemma2ForCausalLM",
           "Gemma3ForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM", "build_model", "cache_dtype", "cache_dtypes",
           "check_kv_cache_dtype", "kv_cache_dtype"]
