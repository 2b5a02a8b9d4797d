"""Llama-family decoder from first principles (Touvron et al. 2023).

RMSNorm, rotary position embeddings with ``rope_theta``, grouped-query
attention and a SwiGLU MLP. Parameter names are Hugging Face's
(``model.layers.N.self_attn.q_proj.weight``) so checkpoints load by identity;
outputs must agree with ``transformers.LlamaForCausalLM`` on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels import KernelOps
from kvgen.kv_cache.paged import PagedAttentionMetadata
from kvgen.models.attention import (
    AttentionMetadata,
    advance_cache,
    attend,
    attend_rows,
    prepare_attention,
    prepare_key_mask,
)
from kvgen.models.base import CausalLM, HasKernels
from kvgen.models.layers import (
    RMSNorm,
    RopeTable,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)
from kvgen.models.moe import GptOssMoeBlock, SparseMoeBlock
from kvgen.models.one_op import DecoderOperands
from kvgen.models.quant_linear import LinearOperands as _LinearOperands
from kvgen.models.quant_linear import QuantEmbedding, VocabEmbedding, linear_operands

# What LlamaDecoderLayer.forward_kernels reads, gathered once by bind_kernels:
# (kernels, norm1 weight, eps1, qkv, o, norm2 weight, eps2, gate_up, down, H, Hkv, D).
_LayerOperands = tuple[
    KernelOps, torch.Tensor, float, _LinearOperands, _LinearOperands, torch.Tensor, float,
    _LinearOperands, _LinearOperands, int, int, int,
]
# A sparse layer's stand-in for the gate_up / down operands (its SparseMoeBlock.forward_kernels ends the layer).
_NO_LINEAR: _LinearOperands = (torch.empty(0, dtype=torch.uint8), 0, 0, None)


class LlamaAttention(nn.Module):
    """Multi-head attention with H query and Hkv key/value heads of size D.

    q_proj, k_proj and v_proj of the checkpoint are stacked into one ``qkv_proj``
    (rows q, then k, then v; vLLM's layout), so one matmul (and, quantized, one
    activation quantization) serves all three.
    """

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        c, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        # SmolLM3: layers whose no_rope_layers flag is 0 attend without position embeddings (NoPE)
        self.use_rope = config.no_rope_layers is None or bool(config.no_rope_layers[layer_idx])
        # Qwen3: each head's q and k RMS-normalized over D before RoPE (transformers Qwen3Attention)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.use_qk_norm else None
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # None: head_dim^-0.5 (Granite: attention_multiplier; Gemma 3 sets query_pre_attn_scalar^-0.5)
        self.scaling: float | None = config.attention_multiplier
        self.window = 0  # > 0: a sliding-window layer's width in tokens (Gemma 2, Gemma 3)
        self.softcap = 0.0  # > 0: scores capped to softcap * tanh(s / softcap) (Gemma 2's attn_logit_softcapping)
        self.sinks: nn.Parameter | None = None  # [H] float32: one more logit per head's softmax, dropped (gpt-oss)
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(c, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=bias if config.o_proj_bias is None else config.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_idx: int, kv_cache, mask) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]; cos, sin: [B, 1, T, D]; mask: [B|1, 1, T, S] bool, None or paged metadata."""
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # [B, T, H*D | Hkv*D]
        q = q.view(b, t, self.num_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(b, t, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, Hkv, T, D]
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, layer_idx, kv_cache, mask, self.scaling, self.window, self.softcap,
                     self.sinks)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))  # [B, T, C]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)).

    gate_proj and up_proj are stacked into one ``gate_up_proj`` (rows gate, then up).
    """

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(c, 2 * i, bias=bias)
        self.down_proj = nn.Linear(i, c, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, I] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (Granite: each output times residual_multiplier
    before its add); ``mlp`` is a ``SparseMoeBlock`` (models/moe.py) on the layers ``config.is_sparse_layer`` names
    (Qwen3-MoE, Qwen2-MoE, Mixtral)."""

    _operands: _LayerOperands  # set by bind_kernels
    # a sparse layer's SparseMoeBlock.forward_kernels (h, residual -> residual + experts), set by bind_kernels
    _moe_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    _qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None  # (q_norm, k_norm weights, eps), by bind_kernels
    _use_rope = True  # self_attn.use_rope, copied by bind_kernels
    # self_attn's (scaling, window, softcap, sinks) as attend_rows takes them, copied by bind_kernels
    _attn_args: tuple[float | None, int, float, torch.Tensor | None] = (None, 0, 0.0, None)
    residual_multiplier = 1.0  # Granite's config.residual_multiplier, set by __init__

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp: LlamaMLP | SparseMoeBlock | GptOssMoeBlock = (
            SparseMoeBlock(config) if config.is_sparse_layer(layer_idx) else LlamaMLP(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1.0 elsewhere
        self.kernels: KernelOps | None = None  # set by bind_kernels: the fused fast path below

    def forward(self, x, cos, sin, layer_idx, kv_cache, mask) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, layer_idx, kv_cache, mask)
        if self.residual_multiplier != 1.0:  # Granite: residual + out * multiplier (transformers' order)
            x = x + attn * self.residual_multiplier
            return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_kernels(
        self, x: torch.Tensor, batch: int, cos: torch.Tensor, sin: torch.Tensor, layer_idx: int, kv_cache, mask
    ) -> torch.Tensor:
        """The quantized fast path on rows: x [N = B T, C] -> [N, C], nine fused ops (ten with q/k norms), no module
        calls.

        cos, sin: [N, D]; mask: key mask [B, S] bool, None or paged metadata (see
        ``attend_rows``). Every linear layer is a ``QuantLinear`` here; residual adds are
        fused into the output projections.
        """
        ops, norm1, eps1, qkv, o, norm2, eps2, gate_up, down, num_heads, num_kv_heads, head_dim = self._operands
        h = ops.rms_norm(x, norm1, eps1)  # [N, C]
        h = ops.qgemm(h, *qkv)  # [N, (H + 2 Hkv) D]
        if self._qk_norm is not None:
            ops.rms_norm_heads_(h, *self._qk_norm, num_heads, num_kv_heads)  # Qwen3: each q and k head, in place
        if self._use_rope:
            ops.rope_qkv_(h, cos, sin, num_heads, num_kv_heads)
        h = attend_rows(h, batch, layer_idx, kv_cache, mask, ops, num_heads, num_kv_heads, head_dim,
                        *self._attn_args)  # [N, H D]
        rm = self.residual_multiplier
        x = ops.qgemm(h, *o, x) if rm == 1.0 else x + ops.qgemm(h, *o) * rm  # x + o_proj(attn) (* rm: Granite)
        h = ops.rms_norm(x, norm2, eps2)
        if self._moe_forward is not None:  # a sparse layer: x + the experts' weighted outputs
            return self._moe_forward(h, x)
        h = ops.qgemm(h, *gate_up)  # [N, 2I]
        if rm != 1.0:
            return x + ops.qgemm(ops.silu_mul(h), *down) * rm
        return ops.qgemm(ops.silu_mul(h), *down, x)  # x + down_proj(silu(gate) * up)

    def bind_kernels(self, kernels: KernelOps) -> None:
        """Switch this layer to ``forward_kernels``: its operands are gathered once into a plain tuple
        (nn.Module attribute lookups cost ~1 µs each, ~14 per layer and token)."""
        linear = linear_operands
        attn, mlp = self.self_attn, self.mlp
        if isinstance(mlp, (SparseMoeBlock, GptOssMoeBlock)):
            mlp.bind_kernels(kernels)
            self._moe_forward, gate_up, down = mlp.forward_kernels, _NO_LINEAR, _NO_LINEAR
        else:
            gate_up, down = linear(mlp.gate_up_proj), linear(mlp.down_proj)
        self.kernels, self._use_rope = kernels, attn.use_rope
        sinks = None if attn.sinks is None else attn.sinks.float()
        self._attn_args = (attn.scaling, attn.window, attn.softcap, sinks)
        q_norm, k_norm = attn.q_norm, attn.k_norm
        if q_norm is not None and k_norm is not None:
            self._qk_norm = (q_norm.weight, k_norm.weight, q_norm.variance_epsilon)
        self._operands = (
            kernels, self.input_layernorm.weight, self.input_layernorm.variance_epsilon, linear(attn.qkv_proj), linear(attn.o_proj),
            self.post_attention_layernorm.weight, self.post_attention_layernorm.variance_epsilon,
            gate_up, down, attn.num_heads, attn.num_kv_heads, attn.head_dim,
        )


class LlamaModel(nn.Module):
    """Embeddings, L decoder layers and the final norm (HF ``LlamaModel`` names)."""

    embed_tokens: VocabEmbedding | QuantEmbedding  # QuantEmbedding when the file's embeddings are quantized

    def __init__(self, config: ModelConfig, layer_cls: type[LlamaDecoderLayer] | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        layer_cls = layer_cls or LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama decoder with an LM head (tied to ``embed_tokens`` or separate)."""

    inv_freq: torch.Tensor  # [D/2] float32 buffer (rope_inv_freq)
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer  # gpt-oss: GptOssDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_cls)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq", rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling), persistent=False
        )
        self.rope_attention_factor = rope_attention_factor(config.rope_scaling)  # cos/sin scale: LongRoPE, YaRN; else 1
        self.kv_cache_dtype: torch.dtype | None = None  # None: the parameters' dtype
        self.kernels: KernelOps | None = None  # set by use_kernels (quantized weights)
        self._kernel_layers: list[LlamaDecoderLayer] = []
        self._decoder_operands: DecoderOperands | None = None  # set by use_kernels
        self._rope = RopeTable()  # [P, D] cos / sin tables of the kernel path
        # kernels.decoder_layers computes dense layers with plain residual adds only: layer by layer otherwise
        self._has_one_op_layers = not config.has_experts and config.residual_multiplier == 1.0
        if not self._has_one_op_layers:
            self.one_op_decoder = False
        # per layer: its sliding window in tokens (0: full attention; gpt-oss's sliding_attention layers)
        self.windows = [cast(LlamaDecoderLayer, layer).self_attn.window for layer in self.model.layers]
        self.window = max(self.windows)  # the sliding layers' window (one per model): their float path's mask

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache=None,
        attn_metadata: AttentionMetadata | PagedAttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        input_ids, positions: [B, T] int64. kv_cache: a cache with
        ``seq_length``/``update``/``advance`` (new tokens go to slots
        ``seq_length..``), None (attend only within ``input_ids``), or a
        ``PagedKVCache`` with ``PagedAttentionMetadata`` (B = 1, T = N packed tokens).
        Returns [B, T, C] in the model dtype.
        """
        x = self.model.embed_tokens(input_ids)  # [B, T, C]
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        if self.kernels is not None:
            cos, sin = self._rope_table(positions)  # [N, D] each
            mask = prepare_key_mask(attn_metadata, kv_cache, input_ids.shape)
        else:
            cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype, self.rope_attention_factor)  # [B, 1, T, D]
            mask = prepare_attention(attn_metadata, kv_cache, input_ids.shape[1])
            sliding = prepare_attention(attn_metadata, kv_cache, input_ids.shape[1], self.window) if self.window else mask
        if self.kernels is not None:  # rows [N, C] through each layer's fused ops, no module calls
            rows, operands = x.view(-1, x.shape[-1]), self._decoder_operands
            out = operands.run(self.kernels, rows, [cos, sin], kv_cache, mask, input_ids.shape[1]) if (
                operands is not None and self.one_op_decoder) else None  # None: neither a static nor a paged cache
            if out is None:
                for i, layer in enumerate(self._kernel_layers):
                    rows = layer.forward_kernels(rows, x.shape[0], cos, sin, i, kv_cache, mask)
            x = (rows if out is None else out).view(x.shape)
        else:
            for i, block in enumerate(self.model.layers):
                x = block(x, cos, sin, i, kv_cache, sliding if self.windows[i] else mask)
        advance_cache(kv_cache, mask, input_ids.shape[1])
        return self.model.norm(x)

    def use_kernels(self, kernels: KernelOps) -> None:
        """Run every layer through ``kernels`` (the C++ ops or their torch twins): the quantized fast
        path. Every linear layer must be a ``QuantLinear``. The float32 reference path keeps the
        plain torch ops that match transformers."""
        for module in self.modules():
            if isinstance(module, LlamaDecoderLayer):
                module.bind_kernels(kernels)
            elif isinstance(module, HasKernels):  # RMSNorm, QuantLinear, QuantEmbedding
                module.kernels = kernels
        self.kernels = kernels
        self._kernel_layers = [cast(LlamaDecoderLayer, layer) for layer in self.model.layers]
        self._decoder_operands = self._gather_decoder_operands() if self._has_one_op_layers else None
        self.kv_cache_dtype = torch.float16  # the kernels read K and V at fp16 precision: store them so

    def _gather_decoder_operands(self) -> DecoderOperands:
        """The operands of ``kernels.decoder_layers`` (:class:`DecoderOperands`): each layer's norms, projections,
        biases and q/k norms, and its RoPE (none on SmolLM3's NoPE layers)."""
        c = self.config
        scale = c.head_dim**-0.5 if c.attention_multiplier is None else c.attention_multiplier
        operands = DecoderOperands(c.num_attention_heads, c.num_key_value_heads, scale)
        for layer in self._kernel_layers:
            _, norm1, eps1, qkv, o, norm2, eps2, gate_up, down, *_ = layer._operands
            q_norm, k_norm, qk_eps = layer._qk_norm or (None, None, 0.0)
            operands.add_layer((norm1, norm2), (eps1, eps2, qk_eps), (qkv, o, gate_up, down),
                               (q_norm, k_norm, None, None), rope_table=int(layer._use_rope))
        return operands.finish()

    def _rope_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D] float32 for positions [B, T] (``RopeTable``)."""
        return self._rope.rows(positions, self.inv_freq, self.rope_attention_factor)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden [..., C] -> logits [..., V] float32 (Granite: divided by logits_scaling). Pass only the rows
        that need logits."""
        logits = self.lm_head_logits(hidden)  # [..., V]
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., C] -> logits [..., V] float32 from the (tied or own) LM head, before logits_scaling."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_lm_head(hidden).float()
        return self.lm_head(hidden).float()
