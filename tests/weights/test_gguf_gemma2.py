"""``gemma2`` GGUF files (llama.cpp's ``Gemma2Model`` converter: norm weights stored as 1 + w, q/k rows as Hugging
Face's, no output.weight, the softcaps and the window as keys, llama.cpp's constants for the layer pattern and the
attention scale) written with gguf's GGUFWriter from a tiny random transformers Gemma2ForCausalLM: an F32 file gives
transformers' logits, a Q8_0 file runs on the kernels with the same greedy tokens on every cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers import (
    assert_one_op_decoder_is_layer_by_layer,
    engine_greedy,
    make_tiny_model,
    model_logits,
)
from weights.gemma_gguf import Q, copy_file_weights, write_gemma_gguf

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError
from kvgen.generation import GenerationConfig, generate
from kvgen.models import Gemma2ForCausalLM, build_model
from kvgen.weights.gguf_loader import load_gguf

STD = 0.2  # scores and logits well past the caps of the tiny config (5, 10)
ROPE = {"rope_theta": 10000.0}  # the converter writes no rope base: llama.cpp's default, Gemma2Config's


def _write_gemma2(path: Path, ref, qtype: GGMLQuantizationType = Q.F32) -> None:
    """``ref`` as llama.cpp's ``Gemma2Model`` converter writes it: its gemma2.* keys (softcaps, sliding window; no rope
    base, no layer pattern), every ``*norm.weight`` + 1, matrices as ``qtype``, no output.weight when tied."""

    def softcaps(w: GGUFWriter) -> None:
        w.add_attn_logit_softcapping(ref.config.attn_logit_softcapping)
        w.add_final_logit_softcapping(ref.config.final_logit_softcapping)

    write_gemma_gguf(path, ref, "gemma2", qtype, softcaps)


def test_gemma2_f32_file_matches_transformers(tmp_path: Path):
    """Four layers with transformers' default layer kinds (even layers sliding, llama.cpp's pattern of 2), the scale
    head_dim^-0.5 (query_pre_attn_scalar = head_dim, llama.cpp's for all but the 27B) and the file's softcaps and
    window: logits on 24 tokens (window 6) equal transformers'; the norms load as stored (1 + w), the embeddings
    tied."""
    ref = make_tiny_model("gemma2", tie=True, num_hidden_layers=4, query_pre_attn_scalar=16, std=STD, seed=6,
                          **ROPE).ref
    assert ref.config.layer_types == ["sliding_attention", "full_attention"] * 2
    _write_gemma2(tmp_path / "g.gguf", ref)
    config, state, _ = load_gguf(tmp_path / "g.gguf")
    assert (config.model_type, config.layer_types, config.sliding_window) == ("gemma2", ref.config.layer_types, 6)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (5.0, 10.0)
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 16 and not config.use_qk_norm
    torch.testing.assert_close(state["model.layers.2.pre_feedforward_layernorm.weight"],
                               1 + ref.model.layers[2].pre_feedforward_layernorm.weight, rtol=0, atol=0)
    model = build_model(config, state)
    assert isinstance(model, Gemma2ForCausalLM)
    ids = torch.arange(3, 27)[None]  # [1, 24]
    with torch.inference_mode():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_gemma2_q8_0_file_runs_on_the_kernels(tmp_path: Path):
    """A Q8_0 file, untied (output.weight is the LM head): dtype auto keeps the blocks on the kernels, whose logits stay
    near transformers' on the dequantized weights (which the float32 path on the same file equals); the kernels' greedy
    tokens are the same with the static cache, without a cache and in the paged engine; without the attention softcap
    in the kernels the logits move far more than quantization noise."""
    ref = make_tiny_model("gemma2", tie=False, query_pre_attn_scalar=16, std=STD, seed=7, **ROPE).ref
    _write_gemma2(tmp_path / "q.gguf", ref, Q.Q8_0)
    config, state, _ = load_gguf(tmp_path / "q.gguf")
    reference = build_model(config, state)
    quantized = build_model(*load_gguf(tmp_path / "q.gguf", dtype=None)[:2])
    assert quantized.kernels is not None and not config.tie_word_embeddings
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 13, 10, 12, 14]])  # 14 tokens: past the window of 6
    copy_file_weights(ref, state)  # the file's (dequantized) weights, norms back to w
    with torch.no_grad():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(reference, ids), want, rtol=1e-5, atol=1e-5)
    got = model_logits(quantized, ids)
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())  # int8 activations
    torch.testing.assert_close(got, want, rtol=0, atol=0.1 * float(want.abs().max()))
    static = GenerationConfig(max_new_tokens=8, eos_token_id=[], cache_implementation="static")
    tokens = generate(quantized, ids, None, static).new_token_ids[0]
    assert generate(quantized, ids, None, replace(static, use_cache=False)).new_token_ids[0] == tokens
    assert engine_greedy(quantized, [ids[0].tolist()], 8, num_blocks=16)[0] == tokens  # blocks of 4
    assert_one_op_decoder_is_layer_by_layer(quantized, ids)  # every layer in one op: the same bits
    for layer in quantized.model.layers:  # the kernels without the attention softcap: far beyond quantization noise
        layer.self_attn.softcap = 0.0
    assert float((model_logits(quantized, ids) - want).abs().mean()) > 0.2 * float(want.abs().mean())


def test_gemma2_metadata_defaults_and_bad_values():
    """Keys the file leaves out take llama.cpp's values (window 4096, softcaps 50 and 30, every other layer sliding);
    the 46-layer 27B scales queries by (hidden / heads)^-0.5; a softcap that is not positive is refused by name."""
    meta = {"general.architecture": "gemma2", "gemma2.block_count": 3, "gemma2.embedding_length": 64,
            "gemma2.feed_forward_length": 128, "gemma2.attention.head_count": 4, "gemma2.vocab_size": 97,
            "gemma2.attention.key_length": 32}
    config = ModelConfig.from_gguf_metadata(meta)
    assert (config.model_type, config.sliding_window) == ("gemma2", 4096)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.query_pre_attn_scalar == 32 and config.rms_norm_eps == 1e-6
    big = ModelConfig.from_gguf_metadata(meta | {"gemma2.block_count": 46, "gemma2.embedding_length": 4608,
                                                 "gemma2.attention.head_count": 32, "gemma2.attention.key_length": 128})
    assert big.query_pre_attn_scalar == 144 and big.head_dim == 128  # Gemma-2-27B: 4608 / 32, not 128
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        with pytest.raises(ModelFormatError, match=f"{key} must be positive"):
            ModelConfig.from_gguf_metadata(meta | {f"gemma2.{key}": 0.0})
