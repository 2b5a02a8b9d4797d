"""``gemma3`` GGUF files (llama.cpp's converter: norm weights stored as 1 + w, q/k rows as Hugging Face's, no
output.weight, llama.cpp's constants for the keys it leaves out) written with gguf's GGUFWriter from a tiny random
transformers Gemma3ForCausalLM: F32 files give transformers' logits, a Q8_0 file runs on the kernels."""

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

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.generation import GenerationConfig, generate
from kvgen.models import build_model
from kvgen.weights.gguf_loader import load_gguf


def _write_gemma3(path: Path, ref, qtype: GGMLQuantizationType = Q.F32, pattern: list[bool] | None = None,
                  extra: dict[str, float] | None = None) -> None:
    """``ref`` as llama.cpp's ``Gemma3Model`` converter writes it: every ``*norm.weight`` + 1, matrices as ``qtype``,
    the gemma3.* keys it writes (no layer pattern, no local RoPE base: llama.cpp's constants) unless ``pattern`` (a
    per-layer sliding flag array, as newer converters write) or ``extra`` float keys are given."""

    def keys(w: GGUFWriter) -> None:
        w.add_rope_freq_base(ref.config.rope_theta)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
        for key, value in (extra or {}).items():
            w.add_float32(f"gemma3.{key}", value)

    write_gemma_gguf(path, ref, "gemma3", qtype, keys)


def test_gemma3_f32_file_matches_transformers_with_llama_cpp_defaults(tmp_path: Path):
    """Six layers with transformers' default layer kinds (every 6th full) and a file that states neither the pattern
    nor the local RoPE base: llama.cpp's constants (6, 10000) and scale head_dim^-0.5 give transformers' logits on
    24 tokens (window 6); the norms load as stored (1 + w), the embeddings tied."""
    ref = make_tiny_model("gemma3_text", tie=True, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16,
                          rope_local_base_freq=10000.0, std=0.5, seed=6).ref
    assert ref.config.layer_types[4:] == ["sliding_attention", "full_attention"]
    _write_gemma3(tmp_path / "g.gguf", ref)
    config, state, _ = load_gguf(tmp_path / "g.gguf")
    assert (config.model_type, config.layer_types, config.sliding_window) == ("gemma3_text", ref.config.layer_types, 6)
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 16 and config.rope_local_base_freq == 10000
    torch.testing.assert_close(state["model.layers.2.pre_feedforward_layernorm.weight"],
                               1 + ref.model.layers[2].pre_feedforward_layernorm.weight, rtol=0, atol=0)
    ids = torch.arange(3, 27)[None]  # [1, 24]
    with torch.inference_mode():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(build_model(config, state), ids), want, rtol=1e-5, atol=1e-5)


def test_gemma3_q8_0_file_runs_on_the_kernels(tmp_path: Path):
    """A Q8_0 file with a per-layer pattern array and a local RoPE base key (sliding, full, sliding; base 100): dtype
    auto keeps the blocks on the kernels, whose logits stay near the float32 path's on the same file, which equals
    transformers' on the dequantized weights; the kernels' greedy tokens are the same with the static cache, without
    a cache and in the paged engine; without the window the logits move far more. Untied: output.weight is the LM
    head."""
    ref = make_tiny_model("gemma3_text", tie=False, query_pre_attn_scalar=16, std=0.1, seed=7).ref
    _write_gemma3(tmp_path / "q.gguf", ref, Q.Q8_0, pattern=[True, False, True], extra={"rope.freq_base_swa": 100.0})
    config, state, _ = load_gguf(tmp_path / "q.gguf")
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    reference = build_model(config, state)
    quantized = build_model(*load_gguf(tmp_path / "q.gguf", dtype=None)[:2])
    assert quantized.kernels is not None
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 13, 10, 12, 14]])  # 14 tokens: past the window of 6
    assert not config.tie_word_embeddings
    copy_file_weights(ref, state)  # the file's (dequantized) weights, norms back to w
    with torch.no_grad():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(reference, ids), want, rtol=1e-5, atol=1e-5)
    got = model_logits(quantized, ids)
    # int8 activations: ~3 % of the logits' scale on average here (the 16-bit kernels: 0.1 %, tests/models)
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())
    torch.testing.assert_close(got, want, rtol=0, atol=0.1 * float(want.abs().max()))
    static = GenerationConfig(max_new_tokens=8, eos_token_id=[], cache_implementation="static")
    tokens = generate(quantized, ids, None, static).new_token_ids[0]
    assert generate(quantized, ids, None, replace(static, use_cache=False)).new_token_ids[0] == tokens
    assert engine_greedy(quantized, [ids[0].tolist()], 8, num_blocks=16)[0] == tokens  # blocks of 4
    assert_one_op_decoder_is_layer_by_layer(quantized, ids)  # every layer in one op: the same bits
    for layer in quantized.model.layers:  # the kernels without the window: far beyond quantization noise
        layer.self_attn.window = 0
    assert float((model_logits(quantized, ids) - want).abs().mean()) > 0.2 * float(want.abs().mean())


def test_gemma3_bad_files_are_refused_by_name(tmp_path: Path):
    """A file with final logit softcapping, metadata without its sliding window or with a pattern of the wrong length
    or another rope scaling type are refused naming the key; a linear scaling is read for the full layers."""
    ref = make_tiny_model("gemma3_text", seed=8).ref
    _write_gemma3(tmp_path / "cap.gguf", ref, extra={"final_logit_softcapping": 30.0})
    with pytest.raises(UnsupportedArchitectureError, match="final_logit_softcapping"):
        load_gguf(tmp_path / "cap.gguf")
    from kvgen.config import ModelConfig

    meta = {"general.architecture": "gemma3", "gemma3.block_count": 3, "gemma3.embedding_length": 64,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 4, "gemma3.vocab_size": 97}
    with pytest.raises(ModelFormatError, match="gemma3.attention.sliding_window"):
        ModelConfig.from_gguf_metadata(meta)
    meta["gemma3.attention.sliding_window"] = 512
    assert ModelConfig.from_gguf_metadata(meta).layer_types == ["sliding_attention"] * 3  # llama.cpp's pattern of 6
    with pytest.raises(ModelFormatError, match="sliding_window_pattern must hold a flag per layer"):
        ModelConfig.from_gguf_metadata(meta | {"gemma3.attention.sliding_window_pattern": [True, False]})
    with pytest.raises(UnsupportedArchitectureError, match="rope.scaling.type 'yarn'"):
        ModelConfig.from_gguf_metadata(meta | {"gemma3.rope.scaling.type": "yarn"})
    scaled = ModelConfig.from_gguf_metadata(meta | {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0}  # the full layers' (4B and larger)
