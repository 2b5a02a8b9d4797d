"""gpt-oss (gpt-oss-20b / -120b; OpenAI 2025) as a Llama-family decoder.

What it changes of a Llama (transformers 4.55 ``GptOssForCausalLM``, the reference it must agree with; llama.cpp
``LLM_ARCH_OPENAI_MOE``): q/k/v/o biases; a learned attention sink per head (``self_attn.sinks`` [H]: one more logit
in each head's softmax, its probability dropped); ``layer_types`` alternating sliding-window (``sliding_window``
tokens) and full attention; YaRN RoPE; every layer a mixture of experts (:class:`kvgen.models.moe.GptOssMoeBlock`:
a biased router, top-k of its logits softmaxed, experts with biases and a clamped GLU); RMSNorms that multiply by
their weight in float32 before the cast (:class:`GptOssRMSNorm`). Layers run one by one on both paths (the one-op
decoder computes dense layers only).
"""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.gemma3 import GemmaRMSNorm
from kvgen.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from kvgen.models.moe import GptOssMoeBlock


class GptOssRMSNorm(GemmaRMSNorm):
    """gpt-oss's RMSNorm: x [..., C] -> [..., C] in x's dtype, the normalization and the product by ``weight`` (w
    itself) in float32, cast last (transformers ``GptOssRMSNorm``: ``(w * x).to(dtype)``; Llama's casts x before the
    product, a second rounding in a 16-bit dtype). Gemma's computation, with no ``1 + w`` offset at load."""


class GptOssAttention(LlamaAttention):
    """LlamaAttention with biases, per-head ``sinks`` [H] and (on ``sliding_attention`` layers) a window."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        assert config.layer_types is not None  # set by ModelConfig for gpt_oss
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))
        self.window = int(config.sliding_window or 0) if config.layer_types[layer_idx] == "sliding_attention" else 0


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with :class:`GptOssAttention` and :class:`GptOssMoeBlock` (transformers
    ``GptOssDecoderLayer``); ``forward`` and ``forward_kernels`` are Llama's."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, layer_idx)
        self.mlp = GptOssMoeBlock(config)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.kernels = None


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss decoder with its LM head; ``LlamaForCausalLM``'s forward (sliding layers get the windowed mask)."""

    layer_cls = GptOssDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
