"""Shared fixtures: the default model loaded by kvgen and by transformers, tiny random checkpoints.

transformers is the reference everywhere; its GGUF load of the default model
takes ~30 s, so it is done once per session.
"""

from __future__ import annotations

import os

# One torch thread for the whole suite (and, through the environment, its CLI
# subprocesses): on a 2-core machine shared with anything else, two OpenMP
# threads made model tests 5-10x slower (measured); timings never go in tests.
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("KVGEN_TEST_THREADS", "1"))

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from kvgen.default_model import find_default_gguf


@pytest.fixture(scope="session")
def default_gguf_path():
    return find_default_gguf()


@pytest.fixture(scope="session")
def ours_default():
    """(model, tokenizer) of the default GGUF loaded by kvgen in float32."""
    from kvgen.loader import load_model

    return load_model("default", dtype=torch.float32)


@pytest.fixture(scope="session")
def ours_default_auto():
    """(model, tokenizer) of the default GGUF on the default path: Q4_1/Q8_0 blocks through kvgen's kernels."""
    from kvgen.loader import load_model

    return load_model("default", dtype="auto")


@pytest.fixture(scope="session")
def hf_default(default_gguf_path):
    """transformers' LlamaForCausalLM on the same GGUF, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, torch_dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)
