"""Our mixture-of-experts layers (models/moe.py in the Llama decoder) vs transformers' Qwen3MoeForCausalLM,
Qwen2MoeForCausalLM and MixtralForCausalLM on the same weights: tiny random models (3 layers of hidden 64, 8 experts
of 32, top 2; Qwen3-MoE with a dense layer 1 and renormalized top-k, Qwen2-MoE with a shared expert and top-k as is,
Mixtral renormalized, its block_sparse_moe names) saved as Hugging Face directories, on the float32 path (no cache,
dynamic, static, the paged engine) and on the kernel path (bfloat16 experts on the 16-bit kernels, float32 routers,
layer by layer), the kernel path's grouping of rows by expert, and the configs refused by name."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_batch_matches_transformers,
    assert_greedy_on_every_cache,
    hf_greedy,
    make_tiny_model,
    model_logits,
    save_tiny_model_dir,
    twin_logits,
)

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.generation.runner import make_cache
from kvgen.models import build_model
from kvgen.models.llama import LlamaMLP
from kvgen.models.moe import SparseMoeBlock, route
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights.hf_loader import load_hf_directory

MOE_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral"]
PROMPTS = [list(range(3, 23)), [5, 9, 11], list(range(40, 52)), [7] * 9 + [8, 9, 10, 11]]  # 20, 3, 12, 13 tokens
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=MOE_TYPES)
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model_type, transformers' model in float32, its directory saved in float32, the same saved in bfloat16)."""
    model_type = request.param
    # seed 2: no near tie of a route or a token that the kernel path's float16 K and V would flip (with seed 1 Mixtral
    # routes one token of one prompt otherwise on the 16-bit kernels, and its greedy tokens part from there)
    ref = make_tiny_model(model_type, std=0.3, seed=2).ref
    f32, bf16 = tmp_path_factory.mktemp(f"{model_type}-f32"), tmp_path_factory.mktemp(f"{model_type}-bf16")
    ref.save_pretrained(f32, safe_serialization=True)
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    return model_type, ref, f32, bf16


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_moe_directory_matches_transformers_logits_and_greedy_tokens(moe, cache):
    """Loaded from its directory (Mixtral's w1/w3/w2 as gate/up/down, Qwen3-MoE's dense layer 1): logits on a
    left-padded batch equal transformers', and 12 greedy tokens of the batch are its own."""
    model_type, ref, f32, _ = moe
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    assert kinds == [SparseMoeBlock, LlamaMLP if model_type == "qwen3_moe" else SparseMoeBlock, SparseMoeBlock]
    assert not ours.one_op_decoder and len(ours.model.layers[0].mlp.experts) == 8
    assert_batch_matches_transformers(ours, ref, PROMPTS, NEW_TOKENS, cache)


def test_moe_greedy_tokens_on_every_cache_are_transformers(moe):
    """The float32 path alone per prompt with the static and dynamic caches and in the paged engine (whole and
    chunked prefill): every prompt's greedy tokens equal transformers'."""
    _, ref, f32, _ = moe
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert_greedy_on_every_cache(ours, PROMPTS, [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS], NEW_TOKENS)


def test_moe_16_bit_kernels_layer_by_layer_match_transformers(moe):
    """A bfloat16 directory loads onto the 16-bit kernels (every expert a QuantLinear, routers dense float32, layer by
    layer): logits near transformers' on the same (bfloat16-rounded) weights, the C++ ops and their torch twins
    agree, and greedy tokens with the static and dynamic caches and in the paged engine are transformers'."""
    _, ref, _, bf16 = moe
    ref16 = copy.deepcopy(ref).to(torch.bfloat16).float()  # the directory's weights
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    block = fast.model.layers[0].mlp
    assert fast.kernels is not None and fast._decoder_operands is None and not fast.one_op_decoder
    assert isinstance(block.experts[7].down_proj, QuantLinear) and type(block.gate) is torch.nn.Linear
    assert block.gate.weight.dtype == torch.float32
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref16(ids).logits
    got = model_logits(fast, ids, torch.ones_like(ids))
    # K and V at float16 (the kernels'): up to ~1 % of the logits' scale with these weights (dense Qwen2 too), and a
    # route whose 2nd and 3rd experts nearly tie may flip at a position (Mixtral here: one of 20), so the mean is
    # held tightly and the maximum loosely; the experts alone agree to 1e-5
    # (test_moe_kernel_block_groups_rows_by_expert)
    scale = float(want.abs().max())
    assert float((got - want).abs().mean()) < 2e-3 * scale
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * scale)
    expected = [hf_greedy(ref16, p, NEW_TOKENS) for p in PROMPTS]
    assert_greedy_on_every_cache(fast, PROMPTS, expected, NEW_TOKENS)
    twins = twin_logits(fast, ids, torch.ones_like(ids))  # the same ops in float32 torch: other summation orders
    torch.testing.assert_close(twins, got, rtol=0, atol=5e-4 * float(got.abs().max()))


def test_moe_kernel_block_groups_rows_by_expert(moe):
    """``forward_kernels`` over 12 rows runs one gate_up and one down qgemm per expert it reaches (plus the shared
    expert's two), over the rows routed there (2 per row in all), and gives what each row gives alone and what the
    float32 block gives on the same weights."""
    _, _, _, bf16 = moe
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    exact = build_model(*load_hf_directory(bf16, dtype=torch.float32))  # the bfloat16 weights, in float32 modules
    block, ops = fast.model.layers[2].mlp, fast.kernels
    rows: list[int] = []

    def counting_qgemm(x: torch.Tensor, *args):
        rows.append(x.shape[0])
        return ops.qgemm(x, *args)

    g = torch.Generator().manual_seed(0)
    h, x = torch.randn(12, 64, generator=g), torch.randn(12, 64, generator=g)  # [N, C]
    block.bind_kernels(dataclasses.replace(ops, qgemm=counting_qgemm))
    try:
        with torch.inference_mode():
            batched = block.forward_kernels(h, x)  # [N, C]
    finally:
        block.bind_kernels(ops)
    reached = route(F.linear(h, block.gate.weight), 2, block.norm_topk_prob)[1].unique().numel()
    num_shared = 2 if block.shared_expert is not None else 0
    assert len(rows) == 2 * reached + num_shared and 1 < reached <= 8
    assert sum(rows[: 2 * reached : 2]) == 12 * 2  # gate_up calls: each row at its 2 experts
    with torch.inference_mode():
        alone = torch.cat([block.forward_kernels(h[i : i + 1], x[i : i + 1]) for i in range(12)])  # N = 1 each
        reference = x + exact.model.layers[2].mlp(h[None])[0]
    assert torch.equal(batched, alone)  # a row alone (decode: no grouping) has the bits it has among others
    torch.testing.assert_close(batched, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))


def test_moe_kernel_prefill_equals_token_by_token(moe):
    """On the kernels, a 20-token prefill (each expert over all its rows at once) gives the logits of feeding the
    same tokens one at a time through a static cache (one row per step)."""
    _, _, _, bf16 = moe
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    ids = torch.tensor([PROMPTS[0]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        whole = fast.compute_logits(fast(ids, positions, make_cache(fast, "static", 1, ids.shape[1])))
        cache = make_cache(fast, "static", 1, ids.shape[1])
        steps = torch.cat([fast.compute_logits(fast(ids[:, i : i + 1], positions[:, i : i + 1], cache))
                           for i in range(ids.shape[1])], dim=1)  # [1, T, V]
    torch.testing.assert_close(steps, whole, rtol=0, atol=1e-4 * float(whole.abs().max()))


def test_moe_without_its_routing_details_no_longer_matches(moe):
    """The mutation check: with the top-k renormalization flipped (and, for Qwen2-MoE, its shared expert dropped) the
    logits move far beyond the tolerance the tests above hold."""
    model_type, ref, f32, _ = moe
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref(ids).logits
    blocks = [layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    for block in blocks:
        block.norm_topk_prob = not block.norm_topk_prob
    assert float((model_logits(ours, ids) - want).abs().max()) > 0.05 * float(want.abs().max())
    if model_type == "qwen2_moe":
        for block in blocks:
            block.norm_topk_prob, block.shared_expert = False, None
        assert float((model_logits(ours, ids) - want).abs().max()) > 0.05 * float(want.abs().max())


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_config_defaults_are_transformers(model_type):
    """A config.json that leaves out every value equal to transformers' default (save_pretrained's diff) reads as
    transformers' defaults."""
    import transformers

    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig}[model_type]
    hf = cls()
    ours = ModelConfig.from_hf_dict(hf.to_diff_dict() | {"model_type": model_type})
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "num_experts_per_tok"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.num_experts == getattr(hf, "num_experts", getattr(hf, "num_local_experts", None))
    assert ours.moe_intermediate_size == getattr(hf, "moe_intermediate_size", hf.intermediate_size)
    assert ours.norm_topk_prob == getattr(hf, "norm_topk_prob", True)  # Mixtral: always renormalized
    assert ours.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", None)
    assert ours.attention_bias == (model_type == "qwen2_moe") and ours.use_qk_norm == (model_type == "qwen3_moe")


@pytest.mark.parametrize("model_type,change,error,match", [
    ("qwen3_moe", {"num_experts_per_tok": 9}, ModelFormatError,
     r"num_experts_per_tok must be in \[1, num_experts = 8\]"),
    ("qwen3_moe", {"mlp_only_layers": [3]}, ModelFormatError, r"mlp_only_layers must hold layer indices in \[0, 3\)"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, ModelFormatError, "decoder_sparse_step must be >= 1"),
    ("qwen2_moe", {"moe_intermediate_size": 0}, ModelFormatError, "moe_intermediate_size must be positive"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, ModelFormatError, "shared_expert_intermediate_size"),
    ("mixtral", {"num_local_experts": 1}, ModelFormatError, r"num_experts_per_tok must be in \[1, num_experts = 1\]"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 3},
     UnsupportedArchitectureError, "use_sliding_window"),
])
def test_moe_bad_configs_are_refused_by_name(model_type, change, error, match):
    config = make_tiny_model(model_type, seed=2).ref.config.to_dict()
    with pytest.raises(error, match=match):
        ModelConfig.from_hf_dict(config | change)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_moe_sliding_window_is_refused_as_transformers_slides_every_layer(model_type):
    """transformers 4.55's Qwen3-MoE and Qwen2-MoE masks slide every layer by ``sliding_window`` once
    ``use_sliding_window`` is true (Qwen2-MoE's ``max_window_layers``, 28 here, is not read there; Qwen3-MoE has
    none): such a config is refused by name (kvgen ran it without a window, reading it as a Qwen2 whose sliding
    layers start at layer 28), while one whose window covers the context loads."""
    import transformers

    ref = make_tiny_model(model_type, seed=2).ref  # 3 layers, 128 positions
    sliding = ref.config.to_dict() | {"use_sliding_window": True, "sliding_window": 4}
    windowed = transformers.AutoModelForCausalLM.from_config(type(ref.config)(**sliding))
    windowed.load_state_dict(ref.state_dict())
    ids = torch.arange(3, 23)[None]  # [1, 20]: past the window
    with torch.inference_mode():
        assert float((windowed.eval()(ids).logits - ref(ids).logits).abs().max()) > 1e-3  # the reference slides
    with pytest.raises(UnsupportedArchitectureError, match=f"{model_type} with use_sliding_window=true"):
        ModelConfig.from_hf_dict(sliding)
    assert ModelConfig.from_hf_dict(sliding | {"sliding_window": 128}).max_position_embeddings == 128


def test_moe_directory_without_an_expert_is_refused(moe, tmp_path: Path):
    """A checkpoint that lacks one expert's matrix is refused naming it (Mixtral's w2 as our down_proj)."""
    from safetensors.torch import load_file, save_file

    model_type, _, f32, _ = moe
    (tmp_path / "config.json").write_text((f32 / "config.json").read_text())
    tensors = load_file(f32 / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w2.weight" if model_type == "mixtral" else
                "model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"missing keys \(1\): model.layers.2.mlp.experts.5.down_proj.weight"):
        load_hf_directory(tmp_path)


def test_info_reports_the_experts(tmp_path: Path):
    """``kvgen info`` of a Qwen3-MoE directory names its own architecture, the Llama decoder and its experts."""
    from kvgen.info import describe_model

    info = describe_model(str(save_tiny_model_dir(tmp_path / "qwen3_moe", model_type="qwen3_moe")))
    assert (info["architecture"], info["decoder"]) == ("qwen3_moe", "llama")
    assert (info["num_experts"], info["num_experts_per_tok"], info["moe_intermediate_size"]) == (8, 2, 32)


def test_moe_variants_kvgen_does_not_compute_are_refused():
    """OLMoE (q/k norms over whole projections) and DeepSeek-style routing are refused by name, not half-computed."""
    import transformers

    with pytest.raises(UnsupportedArchitectureError, match="model_type 'olmoe' is not supported"):
        ModelConfig.from_hf_dict(transformers.OlmoeConfig().to_dict())
    for arch in ("olmoe", "deepseek2"):
        with pytest.raises(UnsupportedArchitectureError, match=f"GGUF architecture '{arch}' is not supported"):
            ModelConfig.from_gguf_metadata({"general.architecture": arch})
