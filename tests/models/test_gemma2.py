"""Our Gemma 2 decoder vs transformers' Gemma2ForCausalLM (eager attention, which applies the attention softcap) on
the same weights: a tiny random model (3 layers: sliding, full, sliding; window 6; attention softcap 5, final softcap
10, both well inside the scores' and logits' range) saved as a Hugging Face directory, prompts of up to 20 tokens that
cross the window, on the float32 reference path (dynamic and static caches, the paged engine with and without chunked
prefill) and on the kernel path (bfloat16 matrices on the 16-bit kernels, every layer in one op)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    assert_batch_matches_transformers,
    assert_greedy_on_every_cache,
    engine_greedy,
    hf_greedy,
    make_tiny_model,
    model_logits,
    twin_logits,
)

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.models import Gemma2ForCausalLM, build_model
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights.hf_loader import load_hf_directory

PROMPTS = [list(range(3, 23)), [5, 9, 11], list(range(40, 52)), [7] * 9 + [8, 9, 10, 11]]  # 20, 3, 12, 13 tokens
NEW_TOKENS = 12
STD = 0.2  # raw logits reach ~13 and attention scores well past 5: both softcaps move them


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    """(transformers' model in float32, its directory saved in float32, the same saved in bfloat16)."""
    ref = make_tiny_model("gemma2", tie=True, std=STD, seed=1).ref
    assert ref.config._attn_implementation == "eager"
    f32, bf16 = tmp_path_factory.mktemp("gemma2-f32"), tmp_path_factory.mktemp("gemma2-bf16")
    ref.save_pretrained(f32, safe_serialization=True)
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)  # .to converts in place
    return ref, f32, bf16


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gemma2_directory_matches_transformers_logits_and_greedy_tokens(gemma, cache):
    """Loaded from its directory (norm weights + 1, no q/k norms, layer kinds, window, scale, both softcaps): logits
    on a left-padded batch equal transformers', and 12 greedy tokens after prompts crossing the window are its own."""
    ref, f32, _ = gemma
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert isinstance(ours, Gemma2ForCausalLM) and ours.is_sliding == [True, False, True]
    assert [(a.window, a.softcap, a.q_norm) for a in (layer.self_attn for layer in ours.model.layers)] == [
        (6, 5.0, None), (0, 5.0, None), (6, 5.0, None)]
    assert ours.config.final_logit_softcapping == 10.0
    torch.testing.assert_close(ours.inv_freq_local, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)  # one RoPE
    assert_batch_matches_transformers(ours, ref, PROMPTS, NEW_TOKENS, cache)


def test_gemma2_without_its_softcaps_no_longer_matches(gemma):
    """The mutation checks: dropping the attention softcap (every layer) or the final one moves the logits far beyond
    the tolerance; with both kept they match (the test above)."""
    ref, f32, _ = gemma
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        expected = ref(ids).logits  # [1, 20, V]
    torch.testing.assert_close(model_logits(ours, ids, torch.ones_like(ids)), expected, rtol=1e-5, atol=1e-5)
    for layer in ours.model.layers:
        layer.self_attn.softcap = 0.0
    uncapped = model_logits(ours, ids, torch.ones_like(ids))
    assert float((uncapped - expected).abs().max()) > 0.1 * float(expected.abs().max())
    for layer in ours.model.layers:
        layer.self_attn.softcap = 5.0
    ours.config.final_logit_softcapping = None
    raw = model_logits(ours, ids, torch.ones_like(ids))
    assert float(raw.abs().max()) > 10.0 > float(expected.abs().max())  # past the cap: the final tanh mattered


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 7}], ids=["whole", "chunked_prefill"])
def test_gemma2_engine_greedy_tokens_are_transformers(gemma, engine_args):
    """The paged engine on the float32 path (capped scores in its decode and prefill attention; blocks of 4 tokens,
    so windows start inside blocks; chunked prefill attends from a chunk over its cached context): every prompt's
    greedy tokens equal transformers' alone."""
    ref, f32, _ = gemma
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert engine_greedy(ours, PROMPTS, NEW_TOKENS, **engine_args) == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]


def test_gemma2_16_bit_kernels_match_transformers(gemma):
    """A bfloat16 directory loads onto the 16-bit kernels (every linear a QuantLinear, no q/k norm
    op, K and V cached at float16, the attention ops capping the scores): logits near transformers' on the same
    (bfloat16-rounded) weights, the C++ ops and their torch twins agree, greedy tokens with the static and dynamic
    caches and in the paged engine (chunked prefill included) are transformers'; without the softcap in the ops the
    logits move far more than the 16-bit noise."""
    ref, _, bf16 = gemma
    ref16 = copy.deepcopy(ref).to(torch.bfloat16).float()  # the directory's weights
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    assert fast.kernels is not None and isinstance(fast.model.layers[1].mlp.down_proj, QuantLinear)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref16(ids).logits
    got = model_logits(fast, ids, torch.ones_like(ids))
    # K and V read at fp16: 2.4e-3 of the logits' scale at most here (3-4e-3 for the same weights without softcaps)
    torch.testing.assert_close(got, want, rtol=0, atol=4e-3 * float(want.abs().max()))
    expected = [hf_greedy(ref16, p, NEW_TOKENS) for p in PROMPTS]
    assert_greedy_on_every_cache(fast, PROMPTS, expected, NEW_TOKENS)
    twins = twin_logits(fast, ids, torch.ones_like(ids))  # the same ops in float32 torch: other summation orders
    # 1.1e-4 of the scale here (7.7e-4 for the same weights with the softcap off on both: the weights' scale)
    torch.testing.assert_close(twins, got, rtol=0, atol=3e-4 * float(got.abs().max()))
    for layer in fast.model.layers:
        layer.self_attn.softcap = 0.0
    assert float((model_logits(fast, ids, torch.ones_like(ids)) - want).abs().max()) > 0.1 * float(want.abs().max())


@pytest.mark.parametrize("variant", [
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "kv_heads": 1},  # every layer's RoPE scaled
    {"tie": False, "final_logit_softcapping": None, "sliding_window": 4, "num_hidden_layers": 4},
], ids=["linear_rope_mqa", "untied_no_final_cap_window4"])
def test_gemma2_variants_match_transformers(variant):
    """Linear RoPE scaling (transformers scales every Gemma 2 layer's RoPE, sliding ones included), one KV head, an
    untied LM head, no final softcap (None: off) and transformers' default layer kinds (even layers sliding): logits
    of a 20-token prompt equal transformers'."""
    ref, ours = make_tiny_model("gemma2", std=STD, seed=3, **variant)
    torch.testing.assert_close(ours.inv_freq_local, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
    if "num_hidden_layers" in variant:
        assert ours.config.layer_types == ref.config.layer_types == ["sliding_attention", "full_attention"] * 2
        assert ours.config.final_logit_softcapping is None
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(ours, ids, torch.ones_like(ids)), want, rtol=1e-5, atol=1e-5)


def test_gemma2_config_defaults_and_refusals():
    """A config.json that leaves out transformers' defaults gets them (softcaps 50 / 30, window 4096, alternating
    layer kinds); softcaps that are not positive are refused naming the field (ModelFormatError), so are another
    activation, another rope type and softcapping on an architecture that does not compute it
    (UnsupportedArchitectureError)."""
    config = make_tiny_model("gemma2", seed=2).ref.config.to_dict()
    minimal = {k: config[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}
    defaults = ModelConfig.from_hf_dict(minimal)
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping, defaults.sliding_window) == (50, 30, 4096)
    assert defaults.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert not defaults.use_qk_norm and defaults.rope_local_base_freq is None and defaults.query_pre_attn_scalar == 256
    for key, value in (("attn_logit_softcapping", 0.0), ("final_logit_softcapping", -30.0),
                       ("attn_logit_softcapping", float("nan"))):
        with pytest.raises(ModelFormatError, match=f"{key} must be positive"):
            ModelConfig.from_hf_dict(config | {key: value})
    for key, value, match in (("hidden_activation", "gelu", "gemma2 hidden_activation must be 'gelu_pytorch_tanh'"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling type 'yarn'")):
        with pytest.raises(UnsupportedArchitectureError, match=match):
            ModelConfig.from_hf_dict(config | {key: value})
    llama = make_tiny_model("llama", seed=2).ref.config.to_dict()
    with pytest.raises(UnsupportedArchitectureError, match="llama with final_logit_softcapping=30.0"):
        ModelConfig.from_hf_dict(llama | {"final_logit_softcapping": 30.0})
