"""Fixtures of the bench tests: the shared tiny random Llama (2 layers, hidden 64, vocab 97)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    return make_tiny_model("llama", std=0.2, pad_token_id=0).ours
