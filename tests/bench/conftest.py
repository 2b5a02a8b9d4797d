"""Fixtures of the bench tests: a tiny random Llama (2 layers, hidden 64, vocab 97)."""

from __future__ import annotations

import pytest
import torch

from kvgen.config import ModelConfig
from kvgen.models import build_model
from kvgen.models.llama import LlamaForCausalLM


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    config = ModelConfig(
        model_type="llama",
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    state_dict = {
        name: torch.randn(p.shape, generator=gen) * 0.2 if p.dim() > 1 else torch.ones(p.shape)
        for name, p in skeleton.named_parameters()
    }
    return build_model(config, state_dict)
