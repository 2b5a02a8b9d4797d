"""GPT-2 decoder from first principles (Radford et al. 2019).

Learned position embeddings, pre-LayerNorm blocks, fused ``c_attn`` QKV
projection, GELU (tanh approximation) MLP and an LM head tied to ``wte`` (or, untied, its own ``lm_head``).
Weights are kept as ``[out, in]`` (the loader transposes HF's Conv1D); outputs
must agree with ``transformers.GPT2LMHeadModel`` on the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig
from kvgen.errors import UnsupportedArchitectureError
from kvgen.kv_cache.paged import PagedAttentionMetadata
from kvgen.models.attention import (
    AttentionMetadata,
    advance_cache,
    attend,
    prepare_attention,
)
from kvgen.models.base import CausalLM
from kvgen.models.quant_linear import VocabEmbedding

# transformers' ACT2FN names a GPT2Config may give; the tanh-approximate GELUs (gelu_new, gelu_fast, gelu_accurate,
# gelu_pytorch_tanh) are one formula, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
_ACTIVATIONS = {
    **dict.fromkeys(("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate"),
                    lambda x: F.gelu(x, approximate="tanh")),
    "gelu": F.gelu,
    "gelu_python": F.gelu,  # the erf GELU written out in Python
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


class GPT2Attention(nn.Module):
    """Causal self-attention with a fused QKV projection (H heads of size D).

    Scores are scaled by D^-0.5 (1 without ``scale_attn_weights``), and by 1 / (layer_idx + 1) with
    ``scale_attn_by_inverse_layer_idx``. Source: transformers 4.55 GPT-2 ``eager_attention_forward`` (its SDPA path
    drops both settings).
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        c = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        scale = self.head_dim**-0.5 if config.extra.get("scale_attn_weights", True) else 1.0
        if config.extra.get("scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.scale: float | None = None if scale == self.head_dim**-0.5 else scale  # None: sdpa's default
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)

    def forward(self, x: torch.Tensor, layer_idx: int, kv_cache, mask) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x [B, T, C]
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        v = v.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        out = attend(q, k, v, layer_idx, kv_cache, mask, self.scale)  # [B, H, T, D]
        return self.c_proj(out.transpose(1, 2).reshape(b, t, c))  # [B, T, C]


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x))) with act = GELU-tanh by default."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise UnsupportedArchitectureError(f"GPT-2 activation_function {config.hidden_act!r} is not supported")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x, layer_idx, kv_cache, mask) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        x = x + self.attn(self.ln_1(x), layer_idx, kv_cache, mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Token and position embeddings, L blocks, final LayerNorm (HF names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = VocabEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with its LM head tied to the token embeddings (GPT2Config's default), or its own ``lm_head`` when
    ``tie_word_embeddings`` is false."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache=None,
        attn_metadata: AttentionMetadata | PagedAttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [B, T] int64 -> hidden [B, T, C] after ``ln_f`` (see LlamaForCausalLM.forward)."""
        tr = self.transformer
        x = tr.wte(input_ids) + tr.wpe(positions)  # [B, T, C]
        mask = prepare_attention(attn_metadata, kv_cache, input_ids.shape[1])
        for i, block in enumerate(tr.h):
            x = block(x, i, kv_cache, mask)
        advance_cache(kv_cache, mask, input_ids.shape[1])
        return tr.ln_f(x)

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., C] -> logits [..., V] float32 (the tied head, or ``lm_head``)."""
        if self.config.tie_word_embeddings:
            return self.transformer.wte.as_lm_head(hidden).float()
        return self.lm_head(hidden).float()
