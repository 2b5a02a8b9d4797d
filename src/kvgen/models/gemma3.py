"""Gemma 3 text decoder (Gemma-3-270M, Gemma-3-1B; Gemma Team 2025) from first principles.

What it changes of a Llama: embeddings scaled by sqrt(hidden_size); RMSNorms that multiply by ``1 + w`` (loaded as
one weight holding ``1 + w``, :func:`kvgen.weights.name_maps.hf_norm_offset`), computed in float32 and cast after
the product; per-head q/k norms; "sandwich" norms (the attention and MLP outputs are normalized before their
residual adds); a GeGLU MLP (``gelu_pytorch_tanh``); the attention scale ``query_pre_attn_scalar^-0.5``; and
per-layer ``layer_types``: sliding-window layers see their last ``sliding_window`` tokens and rotate by
``rope_local_base_freq`` (unscaled), full layers by ``rope_theta`` with ``rope_scaling``. Outputs must agree with
transformers 4.55 ``Gemma3ForCausalLM`` on the same weights; the GGUF graph is llama.cpp's ``llm_build_gemma3``.

The kernel path (quantized or 16-bit weights) runs every layer in one op over a static or paged KV cache (the one-op
decoder, :mod:`kvgen.models.one_op`: sandwich norms, GeGLU, per-layer RoPE tables and windows), else layer by layer on
the same kernel ops (``forward_kernels``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels import KernelOps
from kvgen.kv_cache.paged import PagedAttentionMetadata
from kvgen.models.attention import (
    AttentionMetadata,
    advance_cache,
    attend_rows,
    prepare_attention,
    prepare_key_mask,
)
from kvgen.models.base import CausalLM, HasKernels
from kvgen.models.layers import RMSNorm, RopeTable, rope_cos_sin, rope_inv_freq
from kvgen.models.llama import LlamaAttention, LlamaMLP
from kvgen.models.one_op import DecoderOperands
from kvgen.models.quant_linear import LinearOperands as _LinearOperands
from kvgen.models.quant_linear import QuantEmbedding, VocabEmbedding, linear_operands


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``weight`` holds ``1 + w``; x: [..., C] -> [..., C] in x's dtype, the normalization and the
    product in float32, cast last (transformers ``Gemma3RMSNorm``: ``(x * (1 + w)).to(dtype)``, not Llama's order).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None or x.dtype == torch.float32:
            return super().forward(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)  # [..., C] float32
        return (h * self.weight.float()).to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """LlamaAttention with Gemma 3's q/k norms (Gemma 2: none, ``use_qk_norm`` False), scale, (on
    ``sliding_attention`` layers) window and (Gemma 2) score softcapping."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        assert config.layer_types is not None  # set by ModelConfig for gemma3_text and gemma2
        if config.use_qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.scaling = float(config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = int(config.sliding_window or 0) if self.is_sliding else 0
        self.softcap = float(config.attn_logit_softcapping or 0.0)


class Gemma3MLP(LlamaMLP):
    """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x)) (transformers ``Gemma3MLP``, ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, I] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))) (transformers
    ``Gemma3DecoderLayer``)."""

    _operands: tuple[KernelOps, list[torch.Tensor], float, _LinearOperands, _LinearOperands, _LinearOperands,
                     _LinearOperands]  # set by bind_kernels

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        c, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(c, eps)
        self.post_attention_layernorm = GemmaRMSNorm(c, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(c, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_idx: int, kv_cache, mask) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]; cos, sin [B, 1, T, D] of this layer's RoPE; mask as ``LlamaAttention``'s."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, layer_idx, kv_cache, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward_kernels(
        self, x: torch.Tensor, batch: int, cos: torch.Tensor, sin: torch.Tensor, layer_idx: int, kv_cache, mask
    ) -> torch.Tensor:
        """The kernel path on rows: x [N = B T, C] float32 -> [N, C]. cos, sin: [N, D] of this layer's RoPE; mask:
        key mask [B, S] bool, None or paged metadata (``attend_rows``, which applies this layer's window)."""
        ops, norms, eps, qkv, o, gate_up, down = self._operands
        attn = self.self_attn
        h = ops.qgemm(ops.rms_norm(x, norms[0], eps), *qkv)  # [N, (H + 2 Hkv) D]
        if len(norms) == 6:  # q_norm, k_norm (Gemma 3; Gemma 2 has none)
            ops.rms_norm_heads_(h, norms[4], norms[5], eps, attn.num_heads, attn.num_kv_heads)
        ops.rope_qkv_(h, cos, sin, attn.num_heads, attn.num_kv_heads)
        h = attend_rows(h, batch, layer_idx, kv_cache, mask, ops, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                        attn.scaling, attn.window, attn.softcap)  # [N, H D]
        x = x + ops.rms_norm(ops.qgemm(h, *o), norms[1], eps)  # [N, C]
        h = ops.qgemm(ops.rms_norm(x, norms[2], eps), *gate_up)  # [N, 2I]
        return x + ops.rms_norm(ops.qgemm(ops.gelu_tanh_mul(h), *down), norms[3], eps)  # [N, C]

    def bind_kernels(self, kernels: KernelOps) -> None:
        """Gather ``forward_kernels``' operands once: norms (input, post-attention, pre-/post-feedforward, then q, k
        where the layer has them), eps and the four linears (every one a ``QuantLinear`` here)."""
        linear = linear_operands
        attn, mlp = self.self_attn, self.mlp
        norms: list[torch.Tensor] = [self.input_layernorm.weight, self.post_attention_layernorm.weight,
                 self.pre_feedforward_layernorm.weight, self.post_feedforward_layernorm.weight]
        if attn.q_norm is not None and attn.k_norm is not None:
            norms += [attn.q_norm.weight, attn.k_norm.weight]
        self._operands = (kernels, norms, self.input_layernorm.variance_epsilon, linear(attn.qkv_proj),
                          linear(attn.o_proj), linear(mlp.gate_up_proj), linear(mlp.down_proj))


class Gemma3TextModel(nn.Module):
    """Embeddings, L decoder layers and the final norm (HF ``Gemma3TextModel`` names)."""

    embed_tokens: VocabEmbedding | QuantEmbedding  # QuantEmbedding when the file's embeddings are quantized

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 decoder with an LM head (tied to ``embed_tokens``, Gemma 3's checkpoints; or separate)."""

    inv_freq: torch.Tensor  # [D/2] float32: the full-attention layers' RoPE (rope_theta, rope_scaling)
    inv_freq_local: torch.Tensor  # [D/2] float32: the sliding layers' RoPE (rope_local_base_freq, unscaled)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3TextModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", gemma3_inv_freq(config, local=False), persistent=False)
        self.register_buffer("inv_freq_local", gemma3_inv_freq(config, local=True), persistent=False)
        self.is_sliding = [layer.self_attn.is_sliding for layer in cast(list[Gemma3DecoderLayer], self.model.layers)]
        self.kv_cache_dtype: torch.dtype | None = None  # None: the parameters' dtype
        self.kernels: KernelOps | None = None  # set by use_kernels (quantized or 16-bit weights)
        self._ropes = (RopeTable(), RopeTable())  # the kernel path's tables: full, sliding
        self._decoder_operands: DecoderOperands | None = None  # set by use_kernels

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache=None,
        attn_metadata: AttentionMetadata | PagedAttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, as ``LlamaForCausalLM.forward``: input_ids, positions [B, T] int64
        (B = 1, T = N packed tokens with a ``PagedKVCache``); returns [B, T, C] in the model dtype."""
        x = self.model.embed_tokens(input_ids)  # [B, T, C]
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # HF: the scale cast to the weights' dtype
        if self.kernels is not None:
            mask = prepare_key_mask(attn_metadata, kv_cache, input_ids.shape)
            x = self._layers_on_kernels(x, positions, kv_cache, mask)
        else:
            mask = prepare_attention(attn_metadata, kv_cache, input_ids.shape[1])
            window = self.config.sliding_window or 0
            sliding = prepare_attention(attn_metadata, kv_cache, input_ids.shape[1], window) if window else mask
            ropes = [rope_cos_sin(positions, self.inv_freq, x.dtype), rope_cos_sin(positions, self.inv_freq_local, x.dtype)]
            for i, layer in enumerate(self.model.layers):  # cos, sin [B, 1, T, D]; masks [B|1, 1, T, S], None or paged
                x = layer(x, *ropes[self.is_sliding[i]], i, kv_cache, sliding if self.is_sliding[i] else mask)
        advance_cache(kv_cache, mask, input_ids.shape[1])
        return self.model.norm(x)

    def _layers_on_kernels(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, mask) -> torch.Tensor:
        """Every layer's ``forward_kernels`` on the rows of x [B, T, C] float32 -> [B, T, C]; each layer rotates by
        its kind's table and attends through its window (mask: ``prepare_key_mask``'s)."""
        ropes = [self._ropes[0].rows(positions, self.inv_freq), self._ropes[1].rows(positions, self.inv_freq_local)]
        rows, operands = x.view(-1, x.shape[-1]), self._decoder_operands  # [N, C]
        assert self.kernels is not None
        out = operands.run(self.kernels, rows, [*ropes[0], *ropes[1]], kv_cache, mask, x.shape[1]) if (
            operands is not None and self.one_op_decoder) else None  # None: neither a static nor a paged cache
        if out is None:
            for i, layer in enumerate(cast(list[Gemma3DecoderLayer], self.model.layers)):
                rows = layer.forward_kernels(rows, x.shape[0], *ropes[self.is_sliding[i]], i, kv_cache, mask)
        return (rows if out is None else out).view(x.shape)

    def use_kernels(self, kernels: KernelOps) -> None:
        """Run every layer through ``kernels`` (the C++ ops or their torch twins): in one op where the cache allows,
        else layer by layer; every linear layer must be a ``QuantLinear``. K and V are then cached at float16 (what
        the kernels read)."""
        for module in self.modules():
            if isinstance(module, Gemma3DecoderLayer):
                module.bind_kernels(kernels)
            elif isinstance(module, HasKernels):  # RMSNorm, QuantLinear, QuantEmbedding
                module.kernels = kernels
        self.kernels = kernels
        self.kv_cache_dtype = torch.float16
        self._decoder_operands = self._gather_decoder_operands()

    def _gather_decoder_operands(self) -> DecoderOperands:
        """The one-op decoder's operands (:class:`DecoderOperands`): per layer the four norms, the q/k norms (Gemma 3),
        the projections, the RoPE table (1: full, 2: sliding, as ``_layers_on_kernels`` passes them) and the window;
        GeGLU and the score softcap for every layer."""
        layers = cast(list[Gemma3DecoderLayer], self.model.layers)
        attn = layers[0].self_attn
        operands = DecoderOperands(attn.num_heads, attn.num_kv_heads, cast(float, attn.scaling), activation=1,
                                   softcap=attn.softcap)
        for layer, sliding in zip(layers, self.is_sliding):
            _, norms, eps, qkv, o, gate_up, down = layer._operands
            q_norm, k_norm = norms[4:6] if len(norms) == 6 else (None, None)
            operands.add_layer((norms[0], norms[2]), (eps, eps, eps), (qkv, o, gate_up, down),
                               (q_norm, k_norm, norms[1], norms[3]), rope_table=2 if sliding else 1,
                               window=layer.self_attn.window)
        return operands.finish()

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden [..., C] -> logits [..., V] float32 (Gemma 3's logits: it has no final softcapping)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_lm_head(hidden).float()
        return self.lm_head(hidden).float()


def gemma3_inv_freq(config: ModelConfig, local: bool) -> torch.Tensor:
    """Inverse frequencies [D/2] float32 of the sliding layers (``local``: ``rope_local_base_freq``, no scaling) or
    the full ones (``rope_theta`` and ``rope_scaling``); without a ``rope_local_base_freq`` (Gemma 2) every layer
    has the full ones. Source: transformers 4.55 ``Gemma3TextModel`` (``rotary_emb_local``: rope_theta replaced,
    rope_type default), ``Gemma2Model`` (one ``rotary_emb``); llama.cpp ``rope_freq_base_train_swa``."""
    if local and config.rope_local_base_freq is not None:
        return rope_inv_freq(config.head_dim, config.rope_local_base_freq, None)
    return rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
