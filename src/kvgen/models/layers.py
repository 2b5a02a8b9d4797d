"""Building blocks shared by the decoders: RMSNorm and rotary embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import KernelOps
from kvgen.rope_scaling import yarn_inv_freq


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), as HF ``LlamaRMSNorm``.

    x: [..., C] any float dtype; statistics in float32, result in x's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.kernels: KernelOps | None = None  # the fused norm on the quantized fast path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x.view(-1, x.shape[-1]), self.weight, self.variance_epsilon).view(x.shape)
        if x.dtype == torch.float32:  # one fused kernel: ~2x fewer µs per call than the op chain below
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` float32: theta^(-2i/D), with optional scaling.

    Supports no scaling, ``linear`` (positions / factor), ``llama3``
    (Meta's wavelength-dependent smoothing, as in HF ``_compute_llama3_parameters``), ``freq_factors``
    (a GGUF file's ``rope_freqs.weight``: each frequency divided by its factor, as llama.cpp's ``ggml_rope_ext``;
    llama.cpp's converter stores Llama 3's smoothing this way) and ``longrope`` (its ``short_factor`` divisors, as
    HF ``_compute_longrope_parameters`` within ``original_max_position_embeddings``, the only lengths kvgen serves
    it at; its cos/sin scale is :func:`rope_attention_factor`) and ``yarn`` (kvgen's form:
    :func:`kvgen.rope_scaling.yarn_inv_freq`); ``dynamic`` (NTK) is plain RoPE within ``max_position_embeddings``,
    as in transformers. Raises ``ValueError`` for factors that are not D/2.
    """
    arange = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")  # CPU even when building on meta
    inv_freq = 1.0 / (rope_theta ** (arange.float() / head_dim))
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "freq_factors":
        return inv_freq / _rope_factors(rope_scaling, "freq_factors", inv_freq.numel())
    if kind == "yarn":
        return yarn_inv_freq(head_dim, rope_theta, rope_scaling)
    if kind == "longrope":  # HF's expression, bit for bit: 1 / (factor * theta^(2i/D))
        short = _rope_factors(rope_scaling, "short_factor", inv_freq.numel())  # [D/2]
        return 1.0 / (short * rope_theta ** (arange.float() / head_dim))
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _rope_factors(rope_scaling: dict[str, Any], key: str, num_freqs: int) -> torch.Tensor:
    """rope_scaling[key] as float32 ``[D/2]``; ``ValueError`` when it holds another number of values."""
    factors = torch.tensor(rope_scaling[key], dtype=torch.float32, device="cpu")  # [D/2]
    if factors.shape != (num_freqs,):
        raise ValueError(f"rope {key} must hold rotary_dim / 2 = {num_freqs} values, got {factors.numel()}")
    return factors


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """The scale of cos and sin: the ``attention_factor`` of LongRoPE (``kvgen.llama_config.longrope_scaling``) and of
    YaRN (``kvgen.rope_scaling``), else 1.

    Both RoPE paths (float tensors and the kernels' tables) take it from here. Source: transformers 4.55
    ``Phi3RotaryEmbedding.forward`` / ``LlamaRotaryEmbedding.forward`` (``cos * attention_scaling``).
    """
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("longrope", "yarn"):
        return 1.0
    return float(rope_scaling.get("attention_factor", 1.0))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, 1, T, D]`` for integer positions ``[B, T]`` (computed in float32), scaled by
    ``attention_factor`` (:func:`rope_attention_factor`) before the cast to ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos, sin = emb.cos(), emb.sin()  # [B, T, D] float32
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [B, 1, T, D]


class RopeTable:
    """The kernel path's cos, sin tables ``[P, D]`` float32 of one set of frequencies, grown to the largest position
    asked for, so a position gets the same bits whatever the batch."""

    def __init__(self) -> None:
        self.cos: torch.Tensor | None = None  # [P, D]
        self.sin: torch.Tensor | None = None  # [P, D]

    def rows(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D] float32 for positions [B, T] (N = B T) of ``inv_freq`` [D/2] (:func:`rope_cos_sin`)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self.cos is None or self.cos.shape[0] < need:
            size = max(need, 2 * (0 if self.cos is None else self.cos.shape[0]), 256)
            cos, sin = rope_cos_sin(torch.arange(size)[None], inv_freq, torch.float32, attention_factor)  # [1, 1, P, D]
            self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()
        assert self.sin is not None  # grown together with cos
        flat = positions.reshape(-1)  # [N]
        return self.cos.index_select(0, flat), self.sin.index_select(0, flat)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their positions.

    x: [B, H, T, D]; cos, sin: [B, 1, T, R], R <= D: the first R dimensions are rotated (pairs i, i + R/2), the
    other D - R pass through (partial rotary, Phi-4-mini). Returns [B, H, T, D], x's dtype.
    Source: Su et al. 2021, RoFormer, eq. 34 (rotate-half form as in HF Llama; partial as HF Phi3's
    ``apply_rotary_pos_emb``).
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)  # [B, H, T, D]
    half = r // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, H, T, D]
    return x * cos + rotated * sin
