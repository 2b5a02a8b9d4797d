"""Our gpt-oss (models/gpt_oss.py, GptOssMoeBlock in models/moe.py) vs transformers 4.55 GptOssForCausalLM (eager
attention) on the same weights: a tiny random model (4 layers alternating sliding / full with a window of 4, hidden 64,
4 heads, 2 KV heads of 16, 4 experts of 32, top 2, YaRN RoPE; every bias and sink random, non-zero) saved as a
Hugging Face directory, on the float32 path (no cache, dynamic, static, the paged engine with whole and chunked
prefill) with prompts longer than the window, and on the kernel path (a bfloat16 directory on the 16-bit kernels,
layer by layer) and a released-style checkpoint with MXFP4 experts; the routing, sinks and clamp each matter; configs
refused by name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_batch_matches_transformers,
    assert_greedy_on_every_cache,
    assert_same,
    hf_greedy,
    model_logits,
    tiny_gpt_oss,
    twin_logits,
)

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.generation import GenerationConfig, generate
from kvgen.generation.runner import positions_from_mask
from kvgen.kernels import reference
from kvgen.models import build_model, moe
from kvgen.models.gpt_oss import GptOssForCausalLM
from kvgen.models.moe import GptOssMoeBlock
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights.hf_loader import load_hf_directory

PROMPTS = [list(range(3, 23)), [5, 9, 11], list(range(40, 52)), [7] * 9 + [8, 9, 10, 11]]  # 20, 3, 12, 13 tokens
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory):
    """(transformers' model in float32, its directory in float32, the same saved in bfloat16)."""
    # seed 1: no route of these prompts nearly ties, so float16 K and V on the kernel path flip none (seeds 0, 3, 5
    # each flip one token of one prompt there, with logits still within the tolerances below)
    ref = tiny_gpt_oss(seed=1)
    f32, bf16 = tmp_path_factory.mktemp("gpt-oss-f32"), tmp_path_factory.mktemp("gpt-oss-bf16")
    ref.save_pretrained(f32, safe_serialization=True)
    copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    return ref, f32, bf16


def _ref_logits(ref, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits


def test_gpt_oss_config_from_transformers(gpt_oss):
    _, f32, _ = gpt_oss
    config, _ = load_hf_directory(f32)
    assert config.model_type == "gpt_oss" and config.num_experts == 4 and config.num_experts_per_tok == 2
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and config.sliding_window == 4
    assert config.attention_bias and config.rope_scaling["truncate"] is False
    defaults = ModelConfig.from_hf_dict({"model_type": "gpt_oss"})  # save_pretrained drops values equal to these
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.head_dim) == (128, 4, 64)
    with pytest.raises(UnsupportedArchitectureError, match="swiglu_limit"):
        ModelConfig.from_hf_dict({"model_type": "gpt_oss", "swiglu_limit": 5.0})
    with pytest.raises(ModelFormatError, match="num_experts"):
        ModelConfig.from_hf_dict({"model_type": "gpt_oss", "num_local_experts": 0})
    with pytest.raises(ModelFormatError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({"model_type": "gpt_oss", "num_experts_per_tok": 200})


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpt_oss_directory_matches_transformers(gpt_oss, cache):
    """Logits on a left-padded batch (prompts past the window) equal transformers'; 10 greedy tokens of the batch are
    its own."""
    ref, f32, _ = gpt_oss
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert isinstance(ours, GptOssForCausalLM) and ours.windows == [4, 0, 4, 0] and not ours.one_op_decoder
    assert_batch_matches_transformers(ours, ref, PROMPTS, NEW_TOKENS, cache)


def test_gpt_oss_without_attention_biases_matches_transformers(tmp_path: Path):
    """attention_bias false (GptOssConfig's flag; q/k/v/o without biases): the directory loads and its logits are
    transformers' (kvgen expected the biases whatever the flag and refused the checkpoint)."""
    ref = tiny_gpt_oss(seed=1, attention_bias=False)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = build_model(*load_hf_directory(tmp_path))
    assert ours.model.layers[0].self_attn.qkv_proj.bias is None
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref(input_ids=ids).logits
    torch.testing.assert_close(model_logits(ours, ids), want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_greedy_tokens_on_every_cache_are_transformers(gpt_oss):
    ref, f32, _ = gpt_oss
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    assert_greedy_on_every_cache(ours, PROMPTS, [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS], NEW_TOKENS)


def test_gpt_oss_sinks_clamp_and_routing_each_matter(gpt_oss, monkeypatch):
    """Dropping the sinks, the GLU's clamp, or softmaxing over every expert before the top k moves the logits far
    from transformers' (so the comparisons above would catch each)."""
    ref, f32, _ = gpt_oss
    ids = torch.tensor([PROMPTS[0]])
    want = _ref_logits(ref, ids, torch.ones_like(ids))

    def far(model) -> bool:
        return float((model_logits(model, ids) - want).abs().max()) > 1e-2

    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    torch.testing.assert_close(model_logits(ours, ids), want, rtol=1e-5, atol=1e-5)
    for layer in ours.model.layers:
        layer.self_attn.sinks = None
    assert far(ours)
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    monkeypatch.setattr(reference, "GPT_OSS_LIMIT", 1e9)  # the GLU's clamps (kvgen.kernels.reference.gpt_oss_glu)
    assert far(ours)
    monkeypatch.undo()

    def softmax_then_top_k(logits: torch.Tensor, top_k: int):
        return torch.topk(torch.softmax(logits, -1, dtype=torch.float32), top_k, dim=-1)

    monkeypatch.setattr(moe, "route_top_k_softmax", softmax_then_top_k)
    assert far(ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_16_bit_norms_are_transformers(gpt_oss, dtype):
    """Loaded in a 16-bit dtype (the float path), every RMSNorm (each layer's two and the final one) gives
    transformers' GptOssRMSNorm bits on the same rows: the product by the weight in float32, rounded once (Llama's
    order rounds the normalized rows before the product too, which moved routes and bfloat16 logits far from
    transformers')."""
    ref, f32, _ = gpt_oss
    ours = build_model(*load_hf_directory(f32, dtype=dtype), dtype)
    ref16 = copy.deepcopy(ref).to(dtype)
    pairs = [(ours.model.norm, ref16.model.norm)] + [
        (getattr(mine, name), getattr(theirs, name)) for mine, theirs in zip(ours.model.layers, ref16.model.layers)
        for name in ("input_layernorm", "post_attention_layernorm")]
    x = (torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(5)) * 30).to(dtype)  # a residual's scale
    with torch.inference_mode():
        for mine, theirs in pairs:
            assert_same(mine(x), theirs(x))


def test_gpt_oss_16_bit_kernels_match_transformers(gpt_oss):
    """A bfloat16 directory loads onto the 16-bit kernels (experts QuantLinear with biases, router dense float32,
    sinks float32): logits near transformers' on the bfloat16-rounded weights, the C++ ops and their twins agree, and
    the greedy tokens on every cache are transformers'."""
    ref, _, bf16 = gpt_oss
    ref16 = copy.deepcopy(ref).to(torch.bfloat16).float()
    ref16.model.rotary_emb.inv_freq = ref.model.rotary_emb.inv_freq.clone()  # .to(bfloat16) rounded the buffer too
    fast = build_model(*load_hf_directory(bf16, dtype=None))
    block = fast.model.layers[1].mlp
    assert fast.kernels is not None and isinstance(block, GptOssMoeBlock)
    assert isinstance(block.experts[3].gate_up_proj, QuantLinear) and type(block.router) is torch.nn.Linear
    assert block.router.weight.dtype == torch.float32 and fast.model.layers[0].self_attn.sinks.dtype == torch.float32
    ids = torch.tensor([PROMPTS[0]])
    want = _ref_logits(ref16, ids, torch.ones_like(ids))
    got = model_logits(fast, ids, torch.ones_like(ids))
    scale = float(want.abs().max())
    assert float((got - want).abs().mean()) < 2e-3 * scale
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * scale)
    assert_greedy_on_every_cache(fast, PROMPTS, [hf_greedy(ref16, p, NEW_TOKENS) for p in PROMPTS], NEW_TOKENS)
    twins = twin_logits(fast, ids, torch.ones_like(ids))
    torch.testing.assert_close(twins, got, rtol=0, atol=5e-4 * float(got.abs().max()))


def test_gpt_oss_expert_stacks_split_per_expert(gpt_oss):
    """The checkpoint's interleaved [in, out] stacks become experts.e.gate_up_proj [2I, C] (gate rows, then up) and
    down_proj [C, I]: expert 2 of layer 3 on the float32 path equals transformers' expert 2 on the same rows."""
    ref, f32, _ = gpt_oss
    ours = build_model(*load_hf_directory(f32, dtype=torch.float32))
    experts = ref.model.layers[3].mlp.experts
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        gate_up = x @ experts.gate_up_proj[2] + experts.gate_up_proj_bias[2]  # [5, 2I] interleaved
        gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(-7.0, 7.0)
        want = ((up + 1) * gate * torch.sigmoid(gate * 1.702)) @ experts.down_proj[2] + experts.down_proj_bias[2]
        got = ours.model.layers[3].mlp.experts[2](x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, K] float32 rows -> transformers' MXFP4 (blocks [E, R, K / 32, 16], scales [E, R, K / 32] uint8), the
    values quantized by the gguf package (llama.cpp's rounding), their nibbles in transformers' order (value 2j low,
    2j + 1 high in byte j)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    e, r, k = w.shape
    raw = torch.from_numpy(quantize(w.reshape(-1, k).numpy(), GGMLQuantizationType.MXFP4)).view(e, r, k // 32, 17)
    qs = raw[..., 1:]  # [E, R, G, 16]: value j low, value j + 16 high
    values = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [E, R, G, 32] in order
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous(), raw[..., 0].contiguous()


def test_gpt_oss_mxfp4_checkpoint_runs_experts_as_mxfp4(gpt_oss, tmp_path: Path):
    """A released-style checkpoint (bfloat16, experts as ``*_blocks`` / ``*_scales`` MXFP4): the float32 path equals
    transformers with the experts dequantized by its own ``convert_moe_packed_tensors``; auto keeps the experts as
    the kernels' MXFP4 blocks beside the 16-bit kernels, logits near, greedy tokens the same on every cache; a
    ``_blocks`` stack without its ``_scales`` is refused by name."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import kvgen.kernels as K

    ref, _, bf16 = gpt_oss
    want_model = copy.deepcopy(ref).to(torch.bfloat16).float()
    want_model.model.rotary_emb.inv_freq = ref.model.rotary_emb.inv_freq.clone()
    state = load_file(bf16 / "model.safetensors")
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _hf_mxfp4(state.pop(name).float().transpose(1, 2).contiguous())  # [E, out, in] rows
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, in, out]
        getattr(want_model.model.layers[layer].mlp.experts, proj).data.copy_(dequantized)
    (tmp_path / "config.json").write_text((bf16 / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.tensor([PROMPTS[0]])
    want = _ref_logits(want_model, ids, torch.ones_like(ids))
    exact = build_model(*load_hf_directory(tmp_path, dtype=torch.float32))
    torch.testing.assert_close(model_logits(exact, ids), want, rtol=1e-5, atol=1e-5)
    fast = build_model(*load_hf_directory(tmp_path, dtype=None))
    expert = fast.model.layers[1].mlp.experts[2]
    assert expert.gate_up_proj.weight_type == K.MXFP4 and expert.down_proj.weight_type == K.MXFP4
    assert fast.model.layers[1].self_attn.qkv_proj.weight_type == K.BF16
    got = model_logits(fast, ids)
    assert float((got - want).abs().mean()) < 0.1 * float(want.abs().mean())  # int8 activations of the experts
    uncached = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], use_cache=False)
    expected = [generate(fast, torch.tensor([p]), None, uncached).new_token_ids[0] for p in PROMPTS]
    assert_greedy_on_every_cache(fast, PROMPTS, expected, NEW_TOKENS)
    del state["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"alone: model\.layers\.2\.mlp\.experts\.down_proj_blocks"):
        load_hf_directory(tmp_path)
