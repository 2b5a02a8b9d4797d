"""IBM Granite (3.x dense) vs transformers' GraniteForCausalLM: Llama's layers with four multipliers (embeddings x3,
attention and MLP outputs x0.5 before their residual adds, attention scores x0.125 instead of head_dim^-0.5, logits
/2.5), from a Hugging Face directory and from ``granite`` GGUF files as llama.cpp's converter writes them (llama's
tensors, q/k rows permuted, the multipliers as ``granite.*_scale`` keys), on the float path and the kernels."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import (
    assert_one_op_decoder_is_layer_by_layer,
    assert_batch_matches_transformers,
    engine_greedy,
    hf_greedy,
    make_tiny_model,
    model_logits,
    write_dense_gguf,
)

from kvgen.config import ModelConfig
from kvgen.models import build_model
from kvgen.weights.gguf_loader import load_gguf
from kvgen.weights.hf_loader import load_hf_directory

Q = GGMLQuantizationType
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [1, 2, 3, 4, 5]]
@pytest.fixture(scope="module")
def granite():
    """transformers' tiny GraniteForCausalLM (untied, 2 KV heads of 4; multipliers 3, 0.5, 0.125, 2.5), float32."""
    return make_tiny_model("granite", std=0.3, seed=7).ref


def _write_granite(path: Path, ref, qtype: Q = Q.F32, attention_scale: bool = True) -> None:
    """``ref`` as llama.cpp's converter (``GraniteModel``, a ``LlamaModel``) writes it: llama's tensors, q/k rows
    permuted, ``granite.attention.scale`` (left out when not ``attention_scale``), ``embedding_scale``,
    ``residual_scale`` and ``logit_scale``."""
    cfg = ref.config

    def keys(w) -> None:
        if attention_scale:
            w.add_float32("granite.attention.scale", cfg.attention_multiplier)
        w.add_float32("granite.embedding_scale", cfg.embedding_multiplier)
        w.add_float32("granite.residual_scale", cfg.residual_multiplier)
        w.add_float32("granite.logit_scale", cfg.logits_scaling)

    write_dense_gguf(path, ref, "granite", qtype, permute_qk=True, add_keys=keys)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_granite_directory_matches_transformers(granite, tmp_path, cache):
    """A saved Granite directory (save_pretrained leaves out values equal to GraniteConfig's defaults) loads with its
    four multipliers; logits on a padded batch and greedy tokens equal transformers', and each multiplier set back
    to 1 moves the logits."""
    granite.save_pretrained(tmp_path, safe_serialization=True)
    ours = build_model(*load_hf_directory(tmp_path, dtype=torch.float32))
    c = ours.config
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling) == (3.0, 0.5,
                                                                                                         0.125, 2.5)
    assert_batch_matches_transformers(ours, granite, PROMPTS, 12, cache)
    ids = torch.tensor([PROMPTS[0]])
    want = model_logits(ours, ids)
    state = ours.state_dict()
    for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        plain = build_model(dataclasses.replace(c, **{name: 1.0}), state)
        assert float((model_logits(plain, ids) - want).abs().max()) > 0.05 * float(want.abs().max()), name


def test_granite_gguf_file_matches_transformers(granite, tmp_path):
    """An F32 ``granite`` file: the multipliers come from its keys, the q/k rows are un-permuted, and the logits of
    a 20-token prompt equal transformers'. Without ``attention.scale`` the scale is head_dim^-0.5 (llama.cpp's
    rule)."""
    _write_granite(tmp_path / "g.gguf", granite)
    config, state, _ = load_gguf(tmp_path / "g.gguf")
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_multiplier,
            config.logits_scaling) == (3.0, 0.5, 0.125, 2.5)
    ids = torch.arange(3, 23)[None]  # [1, 20]
    with torch.inference_mode():
        want = granite(ids).logits
    torch.testing.assert_close(model_logits(build_model(config, state), ids), want, rtol=1e-5, atol=1e-5)
    _write_granite(tmp_path / "no_scale.gguf", granite, attention_scale=False)
    assert load_gguf(tmp_path / "no_scale.gguf")[0].attention_multiplier is None


def test_granite_quantized_file_runs_on_the_kernels(granite, tmp_path):
    """A Q8_0 ``granite`` file on the default path: its layers run on the kernels one by one (the one-op decoder has
    no residual multiplier), the logits stay near the float path of the same file, and greedy tokens agree between
    generate (static and dynamic caches) and the paged engine, whole and chunked prefill."""
    _write_granite(tmp_path / "q8.gguf", granite, Q.Q8_0)
    quantized = build_model(*load_gguf(tmp_path / "q8.gguf", dtype=None)[:2])  # the default path: kernels
    reference = build_model(*load_gguf(tmp_path / "q8.gguf")[:2])  # float32
    assert quantized.kernels is not None and not quantized.one_op_decoder and reference.kernels is None
    ids = torch.arange(3, 23)[None]  # [1, 20]
    want = model_logits(reference, ids)
    torch.testing.assert_close(model_logits(quantized, ids), want, rtol=0, atol=0.05 * float(want.abs().max()))
    from kvgen.generation import GenerationConfig, generate

    expected = []
    for prompt in PROMPTS:
        runs = [generate(quantized, torch.tensor([prompt]), None, GenerationConfig(
            max_new_tokens=8, eos_token_id=[], cache_implementation=cache)).new_token_ids[0]
            for cache in ("static", "dynamic")]
        assert runs[0] == runs[1]
        expected.append(runs[0])
    assert engine_greedy(quantized, PROMPTS, 8) == expected
    assert engine_greedy(quantized, PROMPTS, 8, max_num_batched_tokens=3) == expected


def test_granite_float_greedy_equals_transformers_alone(granite):
    """Each prompt alone through kvgen's float path gives transformers' greedy tokens (no padding involved)."""
    ours = make_tiny_model("granite", std=0.3, seed=7).ours
    from kvgen.generation import GenerationConfig, generate

    for prompt in PROMPTS:
        got = generate(ours, torch.tensor([prompt]), None, GenerationConfig(max_new_tokens=10, eos_token_id=[]))
        assert got.new_token_ids[0] == hf_greedy(granite, prompt, 10)


def test_granite_multipliers_must_be_positive():
    with pytest.raises(ValueError, match="residual_multiplier must be a positive number, got -0.5"):
        ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                    residual_multiplier=-0.5)


def test_granite_without_a_residual_multiplier_runs_the_one_op_decoder_at_its_attention_scale(granite, tmp_path):
    """With residual_multiplier 1 a Q8_0 Granite file runs on the one-op decoder, which scales scores by
    attention_multiplier (0.125, not head_dim^-0.5): its hidden states, cache and greedy tokens equal the
    layer-by-layer kernels', whose attention reads the layer's own scale."""
    ref = copy.deepcopy(granite)
    ref.config.residual_multiplier = 1.0
    for layer in ref.model.layers:
        layer.residual_multiplier = 1.0
    _write_granite(tmp_path / "q8.gguf", ref, Q.Q8_0)
    quantized = build_model(*load_gguf(tmp_path / "q8.gguf", dtype=None)[:2])
    assert quantized.one_op_decoder and quantized.config.attention_multiplier == 0.125
    assert_one_op_decoder_is_layer_by_layer(quantized, torch.tensor([PROMPTS[0]]))
