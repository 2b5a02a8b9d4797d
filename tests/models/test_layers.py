"""kvgen.models.layers: RMSNorm and the kernel path's RoPE tables against transformers' Llama modules."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from kvgen.models.layers import RMSNorm, RopeTable, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_16_bits_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """Off float32, the weight multiplies the normalized x after its cast to x's dtype (``LlamaRMSNorm``), not
    before: the product is rounded once, in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)  # [B, T, C]
    weight = (torch.randn(64, generator=g) * 0.5 + 1).to(dtype)  # [C]
    ours, ref = RMSNorm(64, 1e-5).to(dtype), LlamaRMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
        got, want = ours(x), ref(x)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("last", [255, 256, 299, 511])
def test_a_fresh_rope_table_holds_the_largest_position_asked_for(last: int) -> None:
    """A table's first use with positions up to ``last`` (at, below and past its 256-row minimum) gives every row,
    the last included, as transformers' ``LlamaRotaryEmbedding``."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=1024)
    positions = torch.tensor([[0, 1, last - 1, last], [last, 7, 3, last - 2]])  # [B, T]
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)  # [B, T, D] each
    cos, sin = RopeTable().rows(positions, rope_inv_freq(16, 10000.0, None))  # [N, D] each
    torch.testing.assert_close(cos.view(2, 4, 16), want_cos)
    torch.testing.assert_close(sin.view(2, 4, 16), want_sin)
