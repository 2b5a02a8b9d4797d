"""Our Llama decoder vs transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import left_pad

from kvgen.generation import GenerationConfig, generate
from kvgen.generation.runner import positions_from_mask
from kvgen.models import AttentionMetadata


def _logits(model, ids, mask):
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions_from_mask(mask), None, AttentionMetadata(mask)))


@pytest.mark.parametrize("tie,kv_heads", [(False, 2), (True, 4), (False, 1)])
def test_tiny_llama_logits_match_transformers_on_padded_batch(tiny_model, tie, kv_heads):
    ref, ours = tiny_model("llama", tie=tie, kv_heads=kv_heads, rope_theta=500.0)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [1, 2, 3, 4, 5]], pad_id=0)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    got = _logits(ours, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral", "smollm3"])
def test_llama_family_checkpoints_match_transformers(tiny_model, tmp_path, model_type):
    """Qwen2 (q/k/v biases, no o_proj bias), Qwen3 (q/k norms per head, head_dim 24 with hidden 64 and 4 heads),
    Mistral and SmolLM3 (layer 1 without RoPE) saved as Hugging Face directories and loaded from them: logits on a
    padded batch and greedy tokens equal transformers'."""
    from kvgen.models import build_model
    from kvgen.weights.hf_loader import load_hf_directory

    ref, _ = tiny_model(model_type, tie=model_type == "qwen2", kv_heads=2, rope_theta=1000.0, std=0.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = build_model(*load_hf_directory(tmp_path, dtype=torch.float32))
    attn = ours.model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == ((True, False) if model_type == "qwen2"
                                                                              else (False, False))
    assert (attn.q_norm is not None) == (model_type == "qwen3")
    assert [layer.self_attn.use_rope for layer in ours.model.layers] == [True, model_type != "smollm3"]
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [1, 2, 3, 4, 5]], pad_id=0)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    real = mask.bool()
    torch.testing.assert_close(_logits(ours, ids, mask)[real], expected[real], rtol=1e-5, atol=1e-5)
    got = generate(ours, ids, mask, GenerationConfig(max_new_tokens=8, eos_token_id=[], pad_token_id=0))
    assert got.sequences.tolist() == want.tolist()


def test_mistral_sliding_window_bounds_the_context_and_qwen2_windows_are_refused():
    from kvgen.config import ModelConfig
    from kvgen.errors import UnsupportedArchitectureError

    base = {"vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 128}
    assert ModelConfig.from_hf_dict(base | {"model_type": "mistral", "sliding_window": 64}).max_position_embeddings == 64
    assert ModelConfig.from_hf_dict(base | {"model_type": "mistral", "sliding_window": None}).max_position_embeddings == 128
    with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(base | {"model_type": "qwen2", "use_sliding_window": True})


def test_default_model_logits_match_transformers(ours_default, hf_default):
    model, tok = ours_default
    rows = [tok.encode(t) for t in ["The capital of France is", "def fibonacci(n):\n    ", "Hi"]]
    ids, mask = left_pad(rows, pad_id=tok.pad_token_id)
    with torch.inference_mode():
        expected = hf_default(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    got = _logits(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_default_model_greedy_32_tokens_identical_to_transformers(ours_default, hf_default, cache):
    model, tok = ours_default
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("Once upon a time, in a small village,"),
        tok.encode("import numpy as np\n\ndef softmax(x):"),
        _chat(tok, "What is the boiling point of water?"),
    ]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = generate(model, ids, None, GenerationConfig(max_new_tokens=32, cache_implementation=cache))
        with torch.inference_mode():
            ref = hf_default.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
            )
        ref_new = ref[0, ids.shape[1]:].tolist()
        assert out.new_token_ids[0] == ref_new[: len(out.new_token_ids[0])]
        assert len(out.new_token_ids[0]) == len(ref_new) or ref_new[len(out.new_token_ids[0]):] == [tok.pad_token_id] * (len(ref_new) - len(out.new_token_ids[0]))


# ---------------------------------------------------------------- Phi-3 (stacked checkpoints, LongRoPE)

_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [1, 2, 3, 4, 5]]


def _longrope(seed: int = 1) -> dict:
    """A Phi-3 rope_scaling for head_dim 16: 8 short and 8 long divisors (float32 values, as a GGUF stores them)."""
    g = torch.Generator().manual_seed(seed)
    return {"type": "longrope", "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(8, generator=g)).tolist()}


def _assert_matches_transformers(ref, ours, prompts, max_new_tokens: int, cache: str = "dynamic") -> None:
    """Logits on a left-padded batch equal transformers'; greedy tokens with the KV cache are identical."""
    ids, mask = left_pad(prompts, pad_id=0)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    real = mask.bool()
    torch.testing.assert_close(_logits(ours, ids, mask)[real], expected[real], rtol=1e-5, atol=1e-5)
    got = generate(ours, ids, mask, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0,
                                                     cache_implementation=cache))
    assert got.sequences.tolist() == want.tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_phi3_directory_loads_its_stacked_projections_and_matches_transformers(tmp_path, cache):
    """A Phi3ForCausalLM directory (GQA: 2 KV heads of 4; qkv_proj and gate_up_proj stacked in the checkpoint;
    sliding_window 64 < 128 positions, as Phi-3-mini-4k's 2047 < 4096) through ``kvgen.load_model``: the stacked
    matrices load as they are, the window bounds the context, logits and 32 greedy tokens equal transformers'."""
    import transformers
    from helpers import save_tiny_model_dir

    import kvgen

    save_tiny_model_dir(tmp_path, model_type="phi3", tie=False, kv_heads=2, sliding_window=64, std=0.5, seed=3)
    ours, _ = kvgen.load_model(tmp_path, dtype="float32")
    ref = transformers.Phi3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    assert ours.config.max_position_embeddings == 64 and ref.config.sliding_window == 64
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    assert torch.equal(attn.qkv_proj.weight, ref.model.layers[1].self_attn.qkv_proj.weight)
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert torch.equal(mlp.gate_up_proj.weight, ref.model.layers[1].mlp.gate_up_proj.weight)
    _assert_matches_transformers(ref, ours, _PROMPTS, max_new_tokens=32, cache=cache)


def test_phi3_longrope_matches_transformers_within_the_original_length(tiny_model):
    """LongRoPE (Phi-3-mini-128k, Phi-3.5-mini: 4096 of 131072 positions here 32 of 128): the short divisors and the
    cos/sin scale sqrt(1 + ln 4 / ln 32) equal transformers'; logits on up to 30 tokens and greedy tokens up to the
    32nd position match; the context ends at the original length; without the scale the logits move."""
    from kvgen.errors import ContextLengthError

    ref, ours = tiny_model("phi3", kv_heads=2, max_position_embeddings=128, original_max_position_embeddings=32,
                           rope_scaling=_longrope(), std=0.5, seed=4)
    assert ours.config.max_position_embeddings == 32
    assert ours.rope_attention_factor == pytest.approx(ref.model.rotary_emb.attention_scaling)
    assert ours.rope_attention_factor == pytest.approx((1 + math.log(4) / math.log(32)) ** 0.5)
    torch.testing.assert_close(ours.inv_freq, ref.model.rotary_emb.original_inv_freq, rtol=0, atol=0)
    long = [list(range(3, 33)), [7, 1, 9]]  # 30 tokens: every short-factor position but the last two
    _assert_matches_transformers(ref, ours, long, max_new_tokens=2)
    _assert_matches_transformers(ref, ours, _PROMPTS, max_new_tokens=25)
    with pytest.raises(ContextLengthError, match="context window of 32 tokens"):
        generate(ours, torch.tensor([_PROMPTS[0]]), None, GenerationConfig(max_new_tokens=26))
    ids, mask = left_pad(long, pad_id=0)
    scaled = _logits(ours, ids, mask)
    ours.rope_attention_factor = 1.0
    unscaled = _logits(ours, ids, mask)
    assert float((scaled - unscaled).abs().max()) > 0.1 * float(scaled.abs().max())
