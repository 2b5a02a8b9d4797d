"""Our Llama decoder vs transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_batch_matches_transformers, left_pad, make_tiny_model

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


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral", "smollm3", "ernie4_5"])
def test_llama_family_checkpoints_match_transformers(tiny_model, tmp_path, model_type):
    """Qwen2 (q/k/v biases, no o_proj bias), Qwen3 (q/k norms per head, head_dim 24 with hidden 64 and 4 heads),
    Mistral, SmolLM3 (layer 1 without RoPE) and ERNIE 4.5 (RoPE over interleaved pairs: the loader reorders its q/k
    rows) saved as Hugging Face directories and loaded from them: logits on a padded batch and greedy tokens equal
    transformers'."""
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


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"])
def test_bias_flags_transformers_does_not_read_add_no_biases(tmp_path, model_type):
    """A config.json with ``attention_bias`` and ``mlp_bias`` true where transformers' modules have no such biases
    (Mistral, Phi-3 and Mixtral attentions; every MLP here, Qwen3-MoE's dense layer 1 included) loads as transformers
    builds it and gives its logits and greedy tokens (kvgen expected bias tensors the checkpoint lacks)."""
    from kvgen.models import build_model
    from kvgen.weights.hf_loader import load_hf_directory

    ref = make_tiny_model(model_type, std=0.3, attention_bias=True, mlp_bias=True).ref
    no_attention_bias = model_type in ("mistral", "phi3", "mixtral")
    unbiased = ("mlp.down_proj.bias", "o_proj.bias") if no_attention_bias else ("mlp.down_proj.bias",)
    assert not any(name.endswith(unbiased) for name, _ in ref.named_parameters())
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = build_model(*load_hf_directory(tmp_path, dtype=torch.float32))
    assert_batch_matches_transformers(ours, ref, [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]], 6, "dynamic")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "phi3"])
def test_other_models_fields_transformers_does_not_read_change_nothing(tmp_path, model_type):
    """Granite's four multipliers, SmolLM3's ``no_rope_layers`` and a ``use_qk_norm`` in the config.json of another
    Llama-family model_type are not read by transformers' modules for it: the directory gives transformers' logits and
    greedy tokens (kvgen scaled by the multipliers and skipped RoPE on layer 1, or expected q/k norm weights)."""
    from kvgen.config import ModelConfig
    from kvgen.models import build_model
    from kvgen.weights.hf_loader import load_hf_directory

    stray = {"attention_multiplier": 0.5, "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 4.0,
             "no_rope_layers": [1, 0]}
    ref = make_tiny_model(model_type, std=0.3, **stray).ref
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = build_model(*load_hf_directory(tmp_path, dtype=torch.float32))
    assert_batch_matches_transformers(ours, ref, [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]], 6, "dynamic")
    assert not ModelConfig.from_hf_dict(ref.config.to_dict() | {"use_qk_norm": True}).use_qk_norm


def test_mistral_sliding_window_bounds_the_context_and_qwen2_windows_are_refused():
    from kvgen.config import ModelConfig
    from kvgen.errors import UnsupportedArchitectureError

    base = {"vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 128}
    assert ModelConfig.from_hf_dict(base | {"model_type": "mistral", "sliding_window": 64}).max_position_embeddings == 64
    assert ModelConfig.from_hf_dict(base | {"model_type": "mistral", "sliding_window": None}).max_position_embeddings == 128
    qwen2 = base | {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}
    with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(qwen2 | {"max_window_layers": 1})  # layer 1 slides
    with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(qwen2 | {"layer_types": ["full_attention", "sliding_attention"]})
    # as transformers' Qwen2Config: no layer slides (max_window_layers 28 >= 2 layers; a window covering the context;
    # layer_types all full), so the config is a plain Qwen2
    for no_sliding in ({}, {"max_window_layers": 1, "sliding_window": 128},
                       {"max_window_layers": 0, "layer_types": ["full_attention"] * 2}):
        assert ModelConfig.from_hf_dict(qwen2 | no_sliding).max_position_embeddings == 128


def test_smollm3_sliding_layers_are_refused_as_transformers_slides_them():
    """transformers 4.55 slides the SmolLM3 layers its ``layer_types`` name ``sliding_attention`` (absent: the NoPE
    layers, given ``use_sliding_window`` and a ``sliding_window``) by ``sliding_window`` even with
    ``use_sliding_window`` false (its mask reads the config's window): both configs are refused by name (kvgen ran
    them without a window), while those where no layer slides load."""
    import transformers

    from kvgen.config import ModelConfig
    from kvgen.errors import UnsupportedArchitectureError

    base = {"model_type": "smollm3", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
            "no_rope_layers": [1, 0], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    given = {"use_sliding_window": False, "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}
    ids = torch.arange(3, 23)[None]  # [1, 20]: past the window
    logits = []
    for layer_types in (given["layer_types"], ["full_attention"] * 2):
        torch.manual_seed(0)
        ref = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**base | given | {"layer_types": layer_types}))
        with torch.inference_mode():
            logits.append(ref.eval()(ids).logits)  # [1, 20, V]
    assert float((logits[0] - logits[1]).abs().max()) > 1e-3  # the reference slides layer 1
    derived = {"use_sliding_window": True, "sliding_window": 4}  # layer_types absent: the NoPE layer 1 slides
    assert transformers.SmolLM3Config(**base | derived).layer_types == given["layer_types"]
    for sliding in (given, derived):
        with pytest.raises(UnsupportedArchitectureError, match="smollm3 with sliding-window layers"):
            ModelConfig.from_hf_dict(base | sliding)
    for plain in ({"use_sliding_window": False, "sliding_window": 4}, {"use_sliding_window": True}):
        assert "sliding_attention" not in transformers.SmolLM3Config(**base | plain).layer_types
        assert ModelConfig.from_hf_dict(base | plain).no_rope_layers == [1, 0]


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


def _longrope(seed: int = 1, num_freqs: int = 8) -> dict:
    """A Phi-3 rope_scaling for head_dim 16 (or 2 num_freqs rotated dimensions): num_freqs short and long divisors
    (float32 values, as a GGUF stores them)."""
    g = torch.Generator().manual_seed(seed)
    return {"type": "longrope", "short_factor": (1 + torch.rand(num_freqs, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(num_freqs, generator=g)).tolist()}


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
    assert_batch_matches_transformers(ours, ref, _PROMPTS, 32, cache)


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
    assert_batch_matches_transformers(ours, ref, long, 2, "dynamic")
    assert_batch_matches_transformers(ours, ref, _PROMPTS, 25, "dynamic")
    with pytest.raises(ContextLengthError, match="context window of 32 tokens"):
        generate(ours, torch.tensor([_PROMPTS[0]]), None, GenerationConfig(max_new_tokens=26))
    ids, mask = left_pad(long, pad_id=0)
    scaled = _logits(ours, ids, mask)
    ours.rope_attention_factor = 1.0
    unscaled = _logits(ours, ids, mask)
    assert float((scaled - unscaled).abs().max()) > 0.1 * float(scaled.abs().max())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_phi4_mini_partial_rotary_matches_transformers(tiny_model, cache):
    """Phi-4-mini's partial rotary (model_type phi3, partial_rotary_factor 0.75 of 128 with LongRoPE; here 0.5 of 16,
    4 divisors of each kind): the 4 frequencies equal transformers', and logits and greedy tokens equal transformers'
    on the float path; the dimensions past the rotated 8 pass through (rotating them too moves the logits)."""
    ref, ours = tiny_model("phi3", kv_heads=2, max_position_embeddings=128, original_max_position_embeddings=32,
                           rope_scaling=_longrope(num_freqs=4), partial_rotary_factor=0.5, std=0.5, seed=6)
    assert (ours.config.head_dim, ours.config.rotary_dim) == (16, 8)
    torch.testing.assert_close(ours.inv_freq, ref.model.rotary_emb.original_inv_freq, rtol=0, atol=0)
    assert_batch_matches_transformers(ours, ref, _PROMPTS, 25, cache)
    ids, mask = left_pad(_PROMPTS, pad_id=0)
    partial = _logits(ours, ids, mask)
    ours.inv_freq = torch.cat([ours.inv_freq, ours.inv_freq])  # 16 rotated dimensions of the same frequencies
    assert float((_logits(ours, ids, mask) - partial).abs().max()) > 0.1 * float(partial.abs().max())


# ---------------------------------------------------------------- YaRN (Qwen3 long context, gpt-oss)

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": False}
_YARN_PROMPTS = [list(range(3, 43)), [5, 9, 11], list(range(40, 52)), [7] * 9 + [8, 9, 10, 11]]  # 40, 3, 12, 13 tokens


def _save_yarn_model(model_type: str, tmp_path_factory: pytest.TempPathFactory, std: float):
    """(transformers' ``model_type`` with YaRN 4x over 32 of 128 positions and gpt-oss's unrounded ramp, weights of
    ``std``, in float32; its directory saved in float32; the same saved in bfloat16)."""
    import copy

    from helpers import make_tiny_model

    ref = make_tiny_model(model_type, kv_heads=2, rope_theta=1000.0, rope_scaling=dict(_YARN), std=std, seed=5).ref
    f32, bf16 = tmp_path_factory.mktemp(f"yarn-{model_type}-f32"), tmp_path_factory.mktemp(f"yarn-{model_type}-bf16")
    ref.save_pretrained(f32, safe_serialization=True)
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)  # .to converts in place
    return ref, f32, bf16


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def yarn_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Qwen3 (q/k norms, head_dim 24) or Llama (head_dim 16) with YaRN: see ``_save_yarn_model``."""
    return _save_yarn_model(request.param, tmp_path_factory, std=0.5)


def test_yarn_directory_matches_transformers(yarn_model):
    """A Qwen3 or Llama directory with a yarn rope_scaling on the float32 path: frequencies and the cos/sin scale
    0.1 ln 4 + 1 equal transformers', logits on a left-padded batch (positions past the original 32) too, greedy
    tokens alone with the static and dynamic caches and in the paged engine (whole and chunked prefill) are its own;
    without the scale, or with every frequency interpolated (no ramp), the logits move far past the tolerance."""
    from helpers import assert_greedy_on_every_cache, hf_greedy, model_logits

    from kvgen.models import build_model
    from kvgen.models.layers import rope_inv_freq
    from kvgen.weights.hf_loader import load_hf_directory

    ref, f32, _ = yarn_model
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling["factor"] == 4.0
    torch.testing.assert_close(ours.inv_freq, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert ours.rope_attention_factor == ref.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    ids, mask = left_pad(_YARN_PROMPTS, pad_id=0)
    with torch.inference_mode():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    real = mask.bool()
    torch.testing.assert_close(model_logits(ours, ids, mask)[real], expected[real], rtol=1e-5, atol=1e-5)
    assert_greedy_on_every_cache(ours, _YARN_PROMPTS, [hf_greedy(ref, p, 12) for p in _YARN_PROMPTS], 12)
    scale = float(expected[real].abs().max())
    ours.rope_attention_factor = 1.0
    assert float((model_logits(ours, ids, mask)[real] - expected[real]).abs().max()) > 0.05 * scale
    ours.rope_attention_factor = ref.model.rotary_emb.attention_scaling
    ours.inv_freq = rope_inv_freq(ours.config.head_dim, 1000.0, None) / 4.0  # [D/2]: interpolated everywhere
    assert float((model_logits(ours, ids, mask)[real] - expected[real]).abs().max()) > 0.05 * scale


@pytest.fixture(scope="module")
def yarn_llama(tmp_path_factory: pytest.TempPathFactory):
    """Llama with YaRN (head_dim 16: the kernels' rope op takes multiples of 16): see ``_save_yarn_model``. Weights of
    std 0.3: with 0.5 (and these frequencies) the attention is sharp enough that the C++ ops and their twins, which
    read the same tables, part by 5e-3 of the logits' scale from summation order alone."""
    return _save_yarn_model("llama", tmp_path_factory, std=0.3)


def test_yarn_16_bit_kernels_match_transformers(yarn_llama):
    """The bfloat16 directory on the 16-bit kernels (cos/sin tables scaled by YaRN's factor in every op): logits near
    transformers' on the same rounded weights, the C++ ops and their torch twins agree, greedy tokens on every cache
    are transformers'; tables without the scale move the logits far past the 16-bit noise."""
    import copy

    from helpers import (
        assert_greedy_on_every_cache,
        hf_greedy,
        model_logits,
        twin_logits,
    )

    from kvgen.models import build_model
    from kvgen.models.layers import RopeTable
    from kvgen.weights.hf_loader import load_hf_directory

    ref, _, bf16 = yarn_llama
    ref16 = copy.deepcopy(ref).to(torch.bfloat16).float()  # the directory's weights
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    assert fast.kernels is not None and fast.rope_attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    ids = torch.tensor([_YARN_PROMPTS[0]])
    with torch.inference_mode():
        want = ref16(ids).logits  # [1, 40, V]
    got = model_logits(fast, ids, torch.ones_like(ids))
    # K and V at float16: ~5e-4 of the logits' scale on average, 1e-2 at most here (2.2e-2 for the same weights
    # without YaRN), so the mean is held tightly and the maximum loosely
    scale = float(want.abs().max())
    assert float((got - want).abs().mean()) < 1e-3 * scale
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * scale)
    assert_greedy_on_every_cache(fast, _YARN_PROMPTS, [hf_greedy(ref16, p, 12) for p in _YARN_PROMPTS], 12)
    twins = twin_logits(fast, ids, torch.ones_like(ids))  # the same ops in float32 torch: other summation orders
    torch.testing.assert_close(twins, got, rtol=0, atol=5e-4 * float(got.abs().max()))
    fast.rope_attention_factor, fast._rope = 1.0, RopeTable()  # tables rebuilt without the scale
    assert float((model_logits(fast, ids, torch.ones_like(ids)) - want).abs().mean()) > 1e-2 * scale


# ---------------------------------------------------------------- dynamic NTK RoPE


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_dynamic_rope_scaling_matches_transformers_within_the_context(model_type: str) -> None:
    """transformers 4.55's dynamic NTK scaling raises the RoPE base only past ``max_position_embeddings``, where kvgen's
    context ends: logits over a prompt up to the last position equal its own (the config was refused as unsupported).
    A factor below 1 is refused, as transformers' validation does."""
    from helpers import make_tiny_model, model_logits

    from kvgen.config import ModelConfig
    from kvgen.errors import ModelFormatError

    tiny = make_tiny_model(model_type, rope_scaling={"rope_type": "dynamic", "factor": 4.0}, std=0.5, seed=7)
    assert tiny.ours.config.rope_scaling == {"rope_type": "dynamic", "factor": 4.0}
    ids = torch.randint(0, 97, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = tiny.ref(ids).logits
    torch.testing.assert_close(model_logits(tiny.ours, ids), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelFormatError, match="dynamic rope_scaling factor must be >= 1, got 0.5"):
        ModelConfig.from_hf_dict(tiny.ref.config.to_dict() | {"rope_scaling": {"rope_type": "dynamic", "factor": 0.5}})
