"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Qwen2-MoE, Mixtral; gpt-oss's ``GptOssMoeBlock``) for the Llama
decoder's sparse layers.

A router (``gate``, a float32 softmax over all ``num_experts``) picks ``num_experts_per_tok`` SwiGLU experts per
token, their probabilities renormalized to sum 1 where ``norm_topk_prob``; the block returns the experts' outputs
weighted by those probabilities, plus (Qwen2-MoE) a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
Names are transformers' Qwen-MoE ones (``mlp.gate``, ``mlp.experts.E``, ``mlp.shared_expert``,
``mlp.shared_expert_gate``; Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2`` load as ``gate_proj/up_proj/down_proj``,
:func:`kvgen.weights.name_maps.hf_to_kvgen_name`). Outputs agree with transformers 4.55 ``Qwen3MoeSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock`` and ``MixtralSparseMoeBlock`` on the same weights; llama.cpp computes the same in
``llm_graph_context::build_moe_ffn`` (softmax gating, weights taken before the optional renormalization).

Routers stay dense float32 (``nn.Linear``) on every path, as llama.cpp's converter stores them (F32; the kernel path
computes their logits in float64, ``ops.linear_f64``, so a row's route does not depend on its batch); the
experts and the shared expert are ``QuantLinear`` on the kernel path, where the rows routed to each expert go through
one ``qgemm`` per matrix (``experts_on_kernels``), so a prefill of N tokens costs one GEMM per chosen expert, not per
token, and a decode step runs its k experts without grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels import KernelOps
from kvgen.kernels.reference import gpt_oss_glu
from kvgen.models.quant_linear import LinearOperands, linear_operands

# One SwiGLU expert's (gate_up_proj, down_proj) operands.
_ExpertOperands = tuple[LinearOperands, LinearOperands]


class MoeMLP(nn.Module):
    """One SwiGLU expert (or the shared expert): down(silu(gate(x)) * up(x)), no biases; gate_proj and up_proj
    stacked into ``gate_up_proj`` (rows gate, then up) as in ``LlamaMLP``. x: [..., C] -> [..., C].
    Source: transformers ``Qwen3MoeMLP``, ``MixtralBlockSparseTop2MLP`` (w1 gate, w3 up, w2 down)."""

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [..., I] each
        return self.down_proj(F.silu(gate) * up)


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each row goes to and their weights: router_logits [N, E] -> (weights [N, k] float32, ids [N, k]
    int64), ids by descending probability (``torch.topk``; ties as transformers breaks them).

    Softmax over all E in float32, top k of the probabilities, renormalized to sum 1 per row when
    ``norm_topk_prob``. Source: transformers ``Qwen3MoeSparseMoeBlock.forward``; llama.cpp ``build_moe_ffn``
    (``norm_w``)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k] each
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_groups(ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The rows routed to each chosen expert, experts ascending: ids [N, k] int64 -> ``(expert, rows [n] int64,
    slots [n] int64)`` per expert with n >= 1 rows, ``slots`` indexing ``ids.view(-1)`` (and the weights alike).
    A row picks an expert at most once, so ``index_add_`` over ``rows`` adds one term per row."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [N k]
    slots = torch.argsort(flat, stable=True)  # [N k]: grouped by expert, rows ascending within a group
    groups, start = [], 0
    for expert, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            group = slots[start : start + count]  # [n]
            groups.append((expert, group // k, group))
            start += count
    return groups


def experts_in_torch(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList
                     ) -> torch.Tensor:
    """The reference path's routed experts: sum_j weights[:, j] * experts[ids[:, j]](rows) for rows [N, C], weights
    [N, k] (cast to rows' dtype), ids [N, k] int64 -> [N, C] in rows' dtype; each chosen expert once over the rows
    routed to it (``expert_groups``), added to zeros in ascending expert order (transformers' loop order)."""
    flat = weights.to(rows.dtype).reshape(-1)  # [N k]
    out = torch.zeros_like(rows)  # [N, C]
    for expert, idx, slots in expert_groups(ids):
        y = experts[expert](rows.index_select(0, idx))  # [n, C]
        out.index_add_(0, idx, y * flat[slots, None])
    return out


def experts_on_kernels(ops: KernelOps, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       experts: list[_ExpertOperands], act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The kernel path's routed experts: for rows h [N, C] float32, weights [N, k] float32 and ids [N, k] int64 (a
    router's), sum_j weights[:, j] * down(act(gate_up(h))) of expert ids[:, j] -> [N, C] float32; experts[e] = its
    (gate_up, down) ``qgemm`` operands, act [n, 2I] -> [n, I]: ``ops.silu_mul`` or ``ops.gpt_oss_glu``.

    Each chosen expert runs once over the rows routed to it (``expert_groups``: one GEMM per expert in a prefill),
    the weighted outputs added to zeros in ascending expert order. A single row (a decode step) skips the grouping
    (argsort, bincount, gathers and scatters: ~0.2 ms a layer) and runs its k experts in one op
    (``ops.moe_experts_row``) that adds them in that same order, so its bits are those it has among other rows (batch
    invariance: the engine's tokens are generate()'s)."""
    assert act is ops.silu_mul or act is ops.gpt_oss_glu, "the kernels' GLUs only"
    if h.shape[0] == 1:
        order = sorted(zip(ids[0].tolist(), range(ids.shape[1])))  # (expert, slot), ascending expert
        chosen = [experts[e] for e, _ in order]
        w = weights[0].tolist()
        biased = any(gu[3] is not None or d[3] is not None for gu, d in chosen)
        return ops.moe_experts_row(h, [gu[0] for gu, _ in chosen], [v for gu, _ in chosen for v in gu[1:3]],
                                   [d[0] for _, d in chosen], [v for _, d in chosen for v in d[1:3]],
                                   [w[j] for _, j in order], [b for gu, d in chosen for b in (gu[3], d[3])] if biased
                                   else [], int(act is ops.gpt_oss_glu))  # [1, C]
    out = torch.zeros_like(h)  # [N, C]
    flat = weights.reshape(-1)  # [N k]
    for expert, idx, slots in expert_groups(ids):
        gate_up, down = experts[expert]
        y = ops.qgemm(act(ops.qgemm(h.index_select(0, idx), *gate_up)), *down)  # [n, C]
        out.index_add_(0, idx, y * flat[slots, None])
    return out


class SparseMoeBlock(nn.Module):
    """A sparse layer's feed-forward: router, ``num_experts`` experts, optionally a gated shared expert.

    ``forward`` (torch modules, any dtype; transformers' order of operations) and ``forward_kernels`` (the kernel
    path's rows, experts as ``QuantLinear``) compute the same function.
    """

    _operands: tuple[KernelOps, torch.Tensor, list[_ExpertOperands],
                     tuple[torch.Tensor, _ExpertOperands] | None]  # set by bind_kernels

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config.hidden_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(c, config.num_experts, bias=False)  # the router: [E, C], float32 on the kernel path
        self.experts = nn.ModuleList(MoeMLP(c, config.moe_intermediate_size) for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MoeMLP(c, shared) if shared else None
        self.shared_expert_gate = nn.Linear(c, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C] in x's dtype (the router's weights cast to it, as transformers does)."""
        rows = x.reshape(-1, x.shape[-1])  # [N, C]
        weights, ids = route(self.gate(rows), self.top_k, self.norm_topk_prob)  # [N, k]
        out = experts_in_torch(rows, weights, ids, self.experts)  # [N, C]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(rows)) * self.shared_expert(rows)  # [N, C]
        return out.view(x.shape)

    def forward_kernels(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The kernel path: x + block(h) for h, x [N, C] float32 (h the normalized rows, x the residual) -> [N, C].

        The router's logits through ``ops.linear_f64``; the experts through ``experts_on_kernels`` (one GEMM
        per expert reached; a decode step's k experts without grouping)."""
        ops, router, experts, shared = self._operands
        weights, ids = route(ops.linear_f64(h, router), self.top_k, self.norm_topk_prob)  # [N, k]
        out = experts_on_kernels(ops, h, weights, ids, experts, ops.silu_mul)  # [N, C]
        if shared is not None:
            shared_gate, (gate_up, down) = shared
            y = ops.qgemm(ops.silu_mul(ops.qgemm(h, *gate_up)), *down)  # [N, C]
            out = out + torch.sigmoid(ops.linear_f64(h, shared_gate)) * y  # shared_gate [1, C]: a scale per row
        return x + out

    def bind_kernels(self, kernels: KernelOps) -> None:
        """Gather ``forward_kernels``' operands once: the router's weight [E, C] (float32), each expert's linears
        (every one a ``QuantLinear`` here) and the shared expert's gate weight [1, C] (float32) and linears."""
        experts = [(linear_operands(e.gate_up_proj), linear_operands(e.down_proj))
                   for e in cast(list[MoeMLP], self.experts)]
        shared = None
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = (self.shared_expert_gate.weight.float(), (linear_operands(self.shared_expert.gate_up_proj),
                                                       linear_operands(self.shared_expert.down_proj)))
        self._operands = (kernels, self.gate.weight.float(), experts, shared)


def route_top_k_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: router_logits [N, E] -> (weights [N, k] float32, ids [N, k] int64): the top k logits, then a
    float32 softmax over those k only. Source: transformers 4.55 ``GptOssTopKRouter.forward``."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)  # [N, k] each
    return F.softmax(values, dim=-1, dtype=torch.float32), ids


class GptOssExpert(nn.Module):
    """One gpt-oss expert: down(gpt_oss_glu(gate_up(x))), both with biases; ``gate_up_proj`` [2I, C] stacks the
    checkpoint's ``gate_proj`` and ``up_proj`` (rows gate, then up, as ``LlamaMLP``; :mod:`kvgen.weights.gpt_oss`
    splits a Hugging Face checkpoint's interleaved stacks so). x: [..., C] -> [..., C]."""

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gpt_oss_glu(self.gate_up_proj(x)))


class GptOssMoeBlock(nn.Module):
    """gpt-oss's feed-forward: a biased ``router`` [E, C] (top-k logits, softmax over them) and ``num_experts``
    :class:`GptOssExpert` (``experts.E``). ``forward`` and ``forward_kernels`` as :class:`SparseMoeBlock`'s; outputs
    agree with transformers 4.55 ``GptOssMLP``; llama.cpp computes the same (``build_moe_ffn`` with
    ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT`` and ``swiglu_oai``)."""

    _operands: tuple[KernelOps, torch.Tensor, torch.Tensor, list[_ExpertOperands]]  # set by bind_kernels

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(c, config.num_experts, bias=True)  # [E, C], float32 on the kernel path
        self.experts = nn.ModuleList(GptOssExpert(c, config.moe_intermediate_size) for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C] in x's dtype."""
        rows = x.reshape(-1, x.shape[-1])  # [N, C]
        weights, ids = route_top_k_softmax(self.router(rows), self.top_k)  # [N, k]
        return experts_in_torch(rows, weights, ids, self.experts).view(x.shape)

    def forward_kernels(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The kernel path: x + block(h) for h, x [N, C] float32 -> [N, C]; the router through
        ``ops.linear_f64``, each chosen expert once over its rows (``qgemm`` with bias, the GLU in torch,
        ``qgemm`` with bias; ``experts_on_kernels``)."""
        ops, router, router_bias, experts = self._operands
        weights, ids = route_top_k_softmax(ops.linear_f64(h, router, router_bias), self.top_k)  # [N, k]
        return x + experts_on_kernels(ops, h, weights, ids, experts, ops.gpt_oss_glu)  # the kernels' GLU, every N

    def bind_kernels(self, kernels: KernelOps) -> None:
        """Gather ``forward_kernels``' operands once: the router's weight [E, C] and bias [E] (float32), each expert's
        linears (every one a ``QuantLinear`` here)."""
        experts = [(linear_operands(e.gate_up_proj), linear_operands(e.down_proj))
                   for e in cast(list[GptOssExpert], self.experts)]
        self._operands = (kernels, self.router.weight.float(), self.router.bias.float(), experts)
