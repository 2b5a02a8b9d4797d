"""The decoder contract every model in ``MODEL_REGISTRY`` fulfils, as types.

``CausalLM`` is an ``nn.Module`` base that declares what callers rely on (``config``,
``forward``, ``compute_logits``), so code holding "a loaded model" is typed by it rather
than by ``nn.Module``, whose ``__getattr__`` would type every attribute as
``Tensor | Module``. It adds no behaviour.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels import KernelOps
from kvgen.kv_cache.paged import PagedAttentionMetadata
from kvgen.models.attention import AttentionMetadata


class CausalLM(nn.Module):
    """A decoder: ``forward(input_ids [B, T], positions [B, T], kv_cache, attn_metadata) -> hidden [B, T, C]``
    and ``compute_logits(hidden [..., C]) -> logits [..., V]`` float32 (DESIGN.md)."""

    config: ModelConfig
    # The checkpoint's generation_config.json decoding fields (GenerationConfig names) and transformers_version
    # (load_model fills it for a Hugging Face directory): generate()'s defaults, as transformers'
    # model.generation_config.
    generation_defaults: dict[str, Any] = {}  # noqa: RUF012 -- replaced, never mutated
    # A decoder with a one-op path over every layer (LlamaForCausalLM's kernels.decoder_layers) takes it while
    # True; False runs the layers one by one (the same numbers; a profiler sees each op).
    one_op_decoder: bool = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: Any = None,
        attn_metadata: AttentionMetadata | PagedAttentionMetadata | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., C] -> logits [..., V] float32: the LM head and any final transform (Gemma 2's softcap,
        Granite's logits_scaling)."""
        return self.lm_head_logits(hidden)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., C] -> logits [..., V] float32 from the LM head alone (DoLa's early exits: transformers'
        ``lm_head(hidden_states[i])``)."""
        raise NotImplementedError


@runtime_checkable
class SupportsKernels(Protocol):
    """A decoder with a quantized fast path through kvgen's kernels (``LlamaForCausalLM``)."""

    def use_kernels(self, kernels: KernelOps) -> None: ...


@runtime_checkable
class HasKernels(Protocol):
    """A module that runs through ``kernels`` once set (``RMSNorm``, ``QuantLinear``, ``QuantEmbedding``)."""

    kernels: KernelOps | None
