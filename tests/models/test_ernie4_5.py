"""ERNIE 4.5 (dense, e.g. ERNIE-4.5-0.3B) vs transformers' Ernie4_5ForCausalLM: Llama's layers with RoPE over
interleaved pairs (2j, 2j + 1). From a Hugging Face directory the loader reorders q/k rows into rotate-half order
(tests/models/test_llama.py); an ``ernie4_5`` GGUF file holds the checkpoint's rows as they are (llama.cpp's converter
does not permute them, its graph rotates interleaved pairs), the order of a llama file's, so they load the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import (
    assert_one_op_decoder_is_layer_by_layer,
    make_tiny_model,
    model_logits,
    write_dense_gguf,
)

from kvgen.models import build_model
from kvgen.weights.gguf_loader import load_gguf

Q = GGMLQuantizationType
@pytest.fixture(scope="module")
def ernie():
    """transformers' tiny Ernie4_5ForCausalLM (tied, 2 KV heads of 4, head_dim 16, biases), float32."""
    return make_tiny_model("ernie4_5", tie=True, bias=True, std=0.3, seed=8).ref


def _write_ernie(path: Path, ref, qtype: Q = Q.F32) -> None:
    """``ref`` as llama.cpp's converter (``Ernie4_5Model``) writes it: llama's tensor names, every row as the
    checkpoint stores it (not permuted), the head size as key and value lengths, no ``output.weight`` (tied)."""

    def keys(w) -> None:
        w.add_key_length(ref.config.head_dim)
        w.add_value_length(ref.config.head_dim)

    write_dense_gguf(path, ref, "ernie4_5", qtype, permute_qk=False, add_keys=keys)


def test_ernie4_5_gguf_file_matches_transformers(ernie, tmp_path):
    """An F32 ``ernie4_5`` file: biases on every projection, tied embeddings, and logits of a 20-token prompt equal
    to transformers' (the interleaved q/k rows un-permuted as a llama file's)."""
    _write_ernie(tmp_path / "e.gguf", ernie)
    config, state, _ = load_gguf(tmp_path / "e.gguf")
    assert (config.attention_bias, config.tie_word_embeddings, config.head_dim) == (True, True, 16)
    ids = torch.arange(3, 23)[None]  # [1, 20]
    with torch.inference_mode():
        want = ernie(ids).logits
    torch.testing.assert_close(model_logits(build_model(config, state), ids), want, rtol=1e-5, atol=1e-5)


def test_ernie4_5_quantized_file_runs_in_one_op(tmp_path):
    """A Q8_0 ``ernie4_5`` file on the default path: every layer in one op with a static cache and in the paged
    engine, bit for bit the layer-by-layer path, logits near transformers' (weights of std 0.1: int8 activations'
    noise stays small, as the other quantized files' tests)."""
    ernie = make_tiny_model("ernie4_5", tie=True, bias=True, std=0.1, seed=8).ref
    _write_ernie(tmp_path / "q8.gguf", ernie, Q.Q8_0)
    model = build_model(*load_gguf(tmp_path / "q8.gguf", dtype=None)[:2])
    assert model.kernels is not None
    ids = torch.arange(3, 23)[None]  # [1, 20]
    with torch.inference_mode():
        want = ernie(ids).logits
    assert_one_op_decoder_is_layer_by_layer(model, ids, want)
