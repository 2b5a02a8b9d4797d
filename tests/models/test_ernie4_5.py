"""ERNIE 4.5 (dense, e.g. ERNIE-4.5-0.3B) vs transformers' Ernie4_5ForCausalLM: Llama's layers with RoPE over
interleaved pairs (2j, 2j + 1). From a Hugging Face directory the loader reorders q/k rows into rotate-half order
(tests/models/test_llama.py); an ``ernie4_5`` GGUF file holds the checkpoint's rows as they are (llama.cpp's converter
does not permute them, its graph rotates interleaved pairs), the order of a llama file's, so they load the same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from helpers import (
    assert_one_op_decoder_is_layer_by_layer,
    gguf_writer_for,
    make_tiny_model,
    model_logits,
)

from kvgen.models import build_model
from kvgen.weights.gguf_loader import load_gguf

Q = GGMLQuantizationType
_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


@pytest.fixture(scope="module")
def ernie():
    """transformers' tiny Ernie4_5ForCausalLM (tied, 2 KV heads of 4, head_dim 16, biases), float32."""
    return make_tiny_model("ernie4_5", tie=True, bias=True, std=0.3, seed=8).ref


def _write_ernie(path: Path, ref, qtype: Q = Q.F32) -> None:
    """``ref`` as llama.cpp's converter (``Ernie4_5Model``) writes it: llama's tensor names, every row as the
    checkpoint stores it, matrices as ``qtype`` (vectors F32), no ``output.weight`` (tied), a token list t0 ..."""
    cfg = ref.config
    w = gguf_writer_for(path, "ernie4_5", cfg)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, p in ref.state_dict().items():
        if name == "lm_head.weight":
            continue
        x = np.ascontiguousarray(p.detach().float().numpy())
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_NAMES[module]}.{kind}"
        if qtype != Q.F32 and x.ndim == 2:
            w.add_tensor(gguf_name, quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
