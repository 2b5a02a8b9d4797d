"""Linear and embedding layers over GGUF blocks, run by kvgen's CPU kernels.

``QuantLinear`` stands where ``nn.Linear`` would, chosen at load by the weight format;
``QuantEmbedding`` stands for ``VocabEmbedding`` and also serves as the tied LM head.
Weights stay in the kernels' packed 8-row records (``kvgen.kernels``): 4.5-5 bits per
Q4 weight, 8.5 per Q8 weight, never dequantized to float32 as a whole. The kernel
implementation is picked once when the module is built (C++ or the torch reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import get_ops, pack_gguf_rows, pack_gguf_segments

# A QuantLinear's operands of kernels.qgemm: (qweight, weight_type, out_features, bias).
LinearOperands = tuple[torch.Tensor, int, int, torch.Tensor | None]


def linear_operands(module: nn.Module) -> LinearOperands:
    """A ``QuantLinear``'s operands of ``kernels.qgemm``, gathered once by a layer binding its kernels (a module
    built as nn.Linear and replaced at load: nn.Module attribute lookups cost ~1 µs each on the decode path)."""
    if not isinstance(module, QuantLinear):
        raise TypeError(f"the kernel path needs QuantLinear layers, got {type(module).__name__}")
    return (module.qweight, module.weight_type, module.out_features, module.bias)


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` that can also act as the tied LM head: ``as_lm_head(h [..., C]) -> [..., V]``."""

    def reset_parameters(self) -> None:
        """Random init as ``nn.Embedding``, except on the meta device (``build_model``), where the
        weights come from a checkpoint and ``normal_`` would import torch._dynamo (1.4 s of load)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W in packed GGUF blocks.

    x: [..., in_features] float32 -> [..., out_features] float32. Activations are
    quantized per 32 values to int8 inside the kernel (llama.cpp's Q8_1 scheme), so a
    row's result does not depend on the other rows of the call.
    """

    qweight: torch.Tensor  # [G, nb, R] uint8 buffer: the kernels' packed 8-row records ([bytes] for a mixed weight)

    def __init__(self, weight_type: int, qweight: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_type, self.in_features, self.out_features = weight_type, in_features, out_features
        self.register_buffer("qweight", qweight)  # [G, nb, R] uint8
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernels = get_ops()

    @classmethod
    def from_gguf(cls, qtype: str, parts: list[torch.Tensor], in_features: int, bias: torch.Tensor | None = None,
                  empty: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> QuantLinear:
        """From GGUF row blocks ``parts`` ([rows_i, bytes] each, stacked in order) of type ``qtype``
        (one of ``kernels.reference.GGUF_TYPES``), packed into ``empty(shape)`` where given (``pack_gguf_rows``)."""
        weight_type, packed = pack_gguf_rows(qtype, parts, empty)
        return cls(weight_type, packed, in_features, sum(p.shape[0] for p in parts), bias)

    @classmethod
    def from_gguf_segments(cls, segments: list[tuple[str, torch.Tensor]], in_features: int,
                           bias: torch.Tensor | None = None) -> QuantLinear:
        """From stacked parts of different GGUF types (``(qtype, rows [n_i, bytes])`` each, in order): one mixed
        weight (``kernels.pack_gguf_segments``), so the stacked matrix still takes one call."""
        weight_type, packed = pack_gguf_segments(segments)
        return cls(weight_type, packed, in_features, sum(rows.shape[0] for _, rows in segments), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        out = self.kernels.qgemm(x2, self.qweight, self.weight_type, self.out_features, self.bias)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight_type={self.weight_type}"


class QuantEmbedding(nn.Module):
    """Token embeddings in packed GGUF blocks: ids [...] int64 -> [..., C] float32.

    ``as_lm_head`` runs the same packed matrix as the tied LM head (logits [..., V] float32).
    """

    def __init__(self, linear: QuantLinear) -> None:
        super().__init__()
        self.linear = linear
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features
        self.kernels = get_ops()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        rows = self.kernels.dequantize_rows(lin.qweight, lin.weight_type, input_ids.reshape(-1), lin.in_features)  # [n, C]
        return rows.view(*input_ids.shape, self.embedding_dim)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)
