"""The one-op decoder: every decoder layer of a model in one kernel call, ``kernels.decoder_layers`` over a static
KV cache or ``kernels.paged_decoder_layers`` over a paged one (their docstrings: kvgen.kernels). At batch 1 the
per-op dispatch of the layer-by-layer path is a sixth of a decode step; the numbers are the same (the op runs each
layer's ops in order on the same operands). Used by the Llama family and by Gemma 2 / Gemma 3."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgen.kernels import KernelOps
from kvgen.kv_cache.paged import PagedAttentionMetadata
from kvgen.models.quant_linear import LinearOperands


@dataclass
class DecoderOperands:
    """What ``kernels.decoder_layers`` reads for every layer, gathered once when a model binds its kernels
    (:meth:`add_layer`), and the model's heads: H, Hkv, the attention scale, the MLP's activation (0 SwiGLU, 1 GeGLU)
    and the score softcap (0: none)."""

    num_heads: int
    num_kv_heads: int
    scale: float
    activation: int = 0
    softcap: float = 0.0
    weights: list[torch.Tensor] = field(default_factory=list)
    linears: list[int] = field(default_factory=list)
    eps: list[float] = field(default_factory=list)
    extras: list[torch.Tensor | None] = field(default_factory=list)
    layer_args: list[int] = field(default_factory=list)

    def add_layer(self, norms: tuple[torch.Tensor, torch.Tensor], eps: tuple[float, float, float],
                  linears: tuple[LinearOperands, LinearOperands, LinearOperands, LinearOperands],
                  extra_norms: tuple[torch.Tensor | None, ...] = (None,) * 4, rope_table: int = 1, window: int = 0
                  ) -> None:
        """One layer: ``norms`` (the norms before attention and before the MLP), their ``eps`` and the q/k norms',
        ``linears`` (qkv, o, gate_up, down), ``extra_norms`` (q_norm, k_norm, post_attention, post_feedforward: each
        None where the layer has none), its RoPE table (0: none, r: the r-th (cos, sin) pair) and its window."""
        qkv, o, gate_up, down = linears
        self.weights += [norms[0], qkv[0], o[0], norms[1], gate_up[0], down[0]]
        self.linears += [n for lin in linears for n in lin[1:3]]
        self.eps += list(eps)
        self.extras += [qkv[3], o[3], gate_up[3], down[3], *extra_norms]
        self.layer_args += [rope_table, window]

    def finish(self) -> DecoderOperands:
        """Empty ``extras`` when no layer has one and empty ``layer_args`` when every layer rotates by the first
        table without a window (the op's defaults); returns self."""
        if all(e is None for e in self.extras):
            self.extras = []
        if all(self.layer_args[i : i + 2] == [1, 0] for i in range(0, len(self.layer_args), 2)):
            self.layer_args = []
        return self

    def run(self, kernels: KernelOps, rows: torch.Tensor, rope: list[torch.Tensor], kv_cache, mask, num_new: int
            ) -> torch.Tensor | None:
        """Every layer on rows [N, C] float32 -> [N, C] in one op, or None when the cache is neither static nor paged
        (the caller then runs the layers one by one). rope: (cos, sin) [N, D] pairs; mask: ``prepare_key_mask``'s
        key mask [B, S] or paged metadata; num_new: T, the new tokens per row of the batch."""
        layers = (rows, self.weights, self.linears, self.eps, self.extras, self.layer_args, rope)
        heads = (self.num_heads, self.num_kv_heads, self.scale, self.activation, self.softcap)
        if isinstance(mask, PagedAttentionMetadata):
            return kernels.paged_decoder_layers(*layers, kv_cache.key_cache, kv_cache.value_cache, mask.slot_mapping,
                                                mask.block_tables, mask.query_start_loc, mask.seq_lens, *heads,
                                                kv_cache.key_scale, kv_cache.value_scale)
        if hasattr(kv_cache, "static_buffers"):
            keys, values, past = kv_cache.static_buffers(num_new)
            return kernels.decoder_layers(*layers, keys, values, mask, past, *heads, kv_cache.key_scale,
                                          kv_cache.value_scale)
        return None
