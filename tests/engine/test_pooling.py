"""``PoolingParams`` (kvgen.engine.pooling) against vLLM's: ``normalize=None`` means "not set", the embedding task's
default (normalized), as vLLM's ``PoolingParams._set_default_parameters``; the embeddings are transformers' base model's
last hidden state, pooled and L2-normalized (see test_embeddings.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_tiny_model

from kvgen.engine.llm import LLM
from kvgen.engine.pooling import PoolingParams


def test_normalize_none_is_vllms_default_unit_norm() -> None:
    tiny = make_tiny_model("llama", std=0.5)
    prompt = [5, 17, 42, 8]
    with torch.inference_mode():
        wanted = F.normalize(tiny.ref.model(torch.tensor([prompt])).last_hidden_state[0, -1], dim=0)  # [C]
    params = PoolingParams(normalize=None)
    assert params.normalize is True
    got = LLM(tiny.ours, None).embed(prompt, params, use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(got), wanted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalize must be a bool, got 1"):
        PoolingParams(normalize=1)  # type: ignore[arg-type]
