"""Our Gemma 3 decoder vs transformers' Gemma3ForCausalLM on the same weights: a tiny random model (3 layers:
sliding, full, sliding; window 6) saved as a Hugging Face directory, prompts of up to 20 tokens that cross the window,
on the float32 reference path (no cache, dynamic, static, the paged engine) and on the kernel path (bfloat16
matrices on the 16-bit kernels, every layer in one op, over the same caches)."""

from __future__ import annotations

import copy
from pathlib import Path

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

from kvgen.models import build_model
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights.hf_loader import load_hf_directory

PROMPTS = [list(range(3, 23)), [5, 9, 11], list(range(40, 52)), [7] * 9 + [8, 9, 10, 11]]  # 20, 3, 12, 13 tokens
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    """(transformers' model in float32, its directory saved in float32, the same saved in bfloat16)."""
    ref = make_tiny_model("gemma3_text", tie=True, std=0.5, seed=1).ref
    f32, bf16 = tmp_path_factory.mktemp("gemma3-f32"), tmp_path_factory.mktemp("gemma3-bf16")
    ref.save_pretrained(f32, safe_serialization=True)
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)  # .to converts in place
    return ref, f32, bf16


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gemma3_directory_matches_transformers_logits_and_greedy_tokens(gemma, cache):
    """Loaded from its directory (norm weights + 1, q/k norms, layer kinds, window, scale, two RoPE bases): logits
    on a left-padded batch equal transformers', and 12 greedy tokens after prompts crossing the window are its own."""
    ref, f32, _ = gemma
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert ours.is_sliding == [True, False, True] and ours.config.sliding_window == 6
    assert [layer.self_attn.window for layer in ours.model.layers] == [6, 0, 6]
    torch.testing.assert_close(ours.model.layers[0].input_layernorm.weight, 1 + ref.model.layers[0].input_layernorm.weight)
    assert_batch_matches_transformers(ours, ref, PROMPTS, NEW_TOKENS, cache)


def test_gemma3_without_its_sliding_window_no_longer_matches(gemma):
    """The mutation check: the same model with the window dropped (every layer full attention) moves the logits of
    the 20-token prompt past the window far beyond the tolerance, and leaves those within the window alone."""
    ref, f32, _ = gemma
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        expected = ref(ids).logits  # [1, 20, V]
    for layer in ours.model.layers:
        layer.self_attn.window = 0
    ours.config.sliding_window = None
    unwindowed = model_logits(ours, ids, torch.ones_like(ids))
    torch.testing.assert_close(unwindowed[:, :6], expected[:, :6], rtol=1e-5, atol=1e-5)
    assert float((unwindowed[:, 6:] - expected[:, 6:]).abs().max()) > 0.1 * float(expected.abs().max())


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 7}], ids=["whole", "chunked_prefill"])
def test_gemma3_engine_greedy_tokens_are_transformers(gemma, engine_args):
    """The paged engine on the float32 path (blocks of 4 tokens, so windows start inside blocks; chunked prefill
    attends from a chunk over its cached context): every prompt's greedy tokens equal transformers' alone."""
    ref, f32, _ = gemma
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert engine_greedy(ours, PROMPTS, NEW_TOKENS, **engine_args) == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]


def test_gemma3_16_bit_kernels_match_transformers(gemma):
    """A bfloat16 directory loads onto the 16-bit kernels (every linear a QuantLinear, K and V cached
    at float16): logits near transformers' on the same (bfloat16-rounded) weights without a cache, the C++ ops and
    their torch twins agree, and greedy tokens with the static and dynamic caches and in the paged engine (chunked
    prefill included) are transformers'."""
    ref, _, bf16 = gemma
    ref16 = copy.deepcopy(ref).to(torch.bfloat16).float()  # the directory's weights
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    assert fast.kernels is not None and isinstance(fast.model.layers[1].mlp.down_proj, QuantLinear)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref16(ids).logits
    got = model_logits(fast, ids, torch.ones_like(ids))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
    expected = [hf_greedy(ref16, p, NEW_TOKENS) for p in PROMPTS]
    assert_greedy_on_every_cache(fast, PROMPTS, expected, NEW_TOKENS)
    twins = twin_logits(fast, ids, torch.ones_like(ids))  # the same ops in float32 torch: other summation orders
    torch.testing.assert_close(twins, got, rtol=0, atol=1e-4 * float(got.abs().max()))


def test_gemma3_refuses_what_it_does_not_compute(tmp_path: Path):
    """Logit softcapping (Gemma 2's; None in Gemma 3) and another activation are refused by name, at config time."""
    from kvgen.config import ModelConfig
    from kvgen.errors import UnsupportedArchitectureError

    config = make_tiny_model("gemma3_text", seed=2).ref.config.to_dict()
    for key, value, match in (("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
                              ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
                              ("hidden_activation", "gelu", "hidden_activation must be 'gelu_pytorch_tanh'"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling type 'yarn'")):
        with pytest.raises(UnsupportedArchitectureError, match=match):
            ModelConfig.from_hf_dict(config | {key: value})


@pytest.mark.parametrize("variant", [
    {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "kv_heads": 1},  # Gemma-3-4B+: full layers scaled only
    {"tie": False, "kv_heads": 4, "sliding_window": 3},
], ids=["linear_rope_mqa", "untied_window3"])
def test_gemma3_variants_match_transformers(variant):
    """Linear RoPE scaling (transformers and llama.cpp scale only the full-attention layers' RoPE), one KV head,
    an untied LM head and another window: logits of a 20-token prompt equal transformers'."""
    ref, ours = make_tiny_model("gemma3_text", std=0.5, seed=3, **variant)
    if "rope_scaling" in variant:
        torch.testing.assert_close(ours.inv_freq, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
        torch.testing.assert_close(ours.inv_freq_local, ref.model.rotary_emb_local.inv_freq, rtol=0, atol=0)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(ours, ids, torch.ones_like(ids)), want, rtol=1e-5, atol=1e-5)
