"""gpt-oss GGUF files (architecture ``gpt-oss``, written as llama.cpp's converter does: weights.gpt_oss_gguf) from a
tiny random transformers GptOssForCausalLM: an F32 file equals transformers; a file with MXFP4 expert stacks runs its
experts on the kernels' MXFP4 blocks, near the float32 path of the same (dequantized) file, with the same greedy
tokens on every cache; bad metadata and missing tensors are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_on_every_cache, model_logits, tiny_gpt_oss
from weights.gpt_oss_gguf import Q, write_gpt_oss_gguf

import kvgen.kernels as K
from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.generation import GenerationConfig, generate
from kvgen.models import build_model
from kvgen.models.gpt_oss import GptOssForCausalLM
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights.gguf_loader import load_gguf

PROMPTS = [list(range(3, 23)), [5, 9, 11], list(range(40, 52))]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ref():
    return tiny_gpt_oss(seed=1)


def test_gpt_oss_f32_file_matches_transformers(ref, tmp_path: Path):
    """Config (experts, even layers sliding, yarn unrounded, biases) and logits over a prompt past the window equal
    transformers' (also with fused ``ffn_gate_up_exps`` stacks); greedy tokens with the static cache too."""
    write_gpt_oss_gguf(tmp_path / "f32.gguf", ref)
    config, state, _ = load_gguf(tmp_path / "f32.gguf")
    assert config.model_type == "gpt_oss" and (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and config.sliding_window == 4
    assert config.attention_bias and config.o_proj_bias and config.rope_scaling["truncate"] is False
    ours = build_model(config, state)
    assert isinstance(ours, GptOssForCausalLM)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(ours, ids), want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    got = generate(ours, ids, None, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                                     cache_implementation="static"))
    assert got.sequences.tolist() == expected.tolist()
    write_gpt_oss_gguf(tmp_path / "fused.gguf", ref, fuse_gate_up=True)  # ffn_gate_up_exps: the same model
    fused = build_model(*load_gguf(tmp_path / "fused.gguf")[:2])
    torch.testing.assert_close(model_logits(fused, ids), want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_mxfp4_experts_run_on_the_kernels(ref, tmp_path: Path):
    """MXFP4 expert stacks (the other matrices Q8_0) stay MXFP4 blocks: one QuantLinear per expert (gate and up
    stacked, with biases), the router dense float32. Each layer's experts on the kernels stay near the same block of
    the float32 path of the file (dequantized by the gguf package), the logits near its logits, and the greedy tokens
    are the same without a cache, with the static and dynamic caches and in the paged engine (whole and chunked); a
    file with fused ``ffn_gate_up_exps`` stacks gives the same logits bit for bit."""
    write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", ref, Q.MXFP4, Q.Q8_0)
    exact = build_model(*load_gguf(tmp_path / "mxfp4.gguf")[:2])
    config, state, _ = load_gguf(tmp_path / "mxfp4.gguf", dtype=None)
    assert state["model.layers.2.mlp.experts.1.up_proj.weight"].qtype == Q.MXFP4
    fast = build_model(config, state)
    expert = fast.model.layers[2].mlp.experts[1]
    assert fast.kernels is not None and isinstance(expert.gate_up_proj, QuantLinear)
    assert expert.gate_up_proj.weight_type == K.MXFP4 and expert.down_proj.weight_type == K.MXFP4
    assert expert.gate_up_proj.bias is not None and type(fast.model.layers[2].mlp.router) is torch.nn.Linear
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))  # [N, C]
    for slow, quick in zip(exact.model.layers, fast.model.layers):
        with torch.inference_mode():
            want = slow.mlp(h[None])[0]  # [N, C]
            got = quick.mlp.forward_kernels(h, torch.zeros_like(h))
        assert float((got - want).abs().mean()) < 0.02 * float(want.abs().mean())  # ~1 %: int8 activations
    ids = torch.tensor([PROMPTS[0]])
    want, got = model_logits(exact, ids), model_logits(fast, ids)
    # int8 activations through four random layers whose routes nearly tie (and Q8_0 K, V at float16): ~7 % of the
    # logits' mean magnitude on average here; the blocks above and the F32 file hold the computation itself
    assert float((got - want).abs().mean()) < 0.12 * float(want.abs().mean())
    torch.testing.assert_close(got, want, rtol=0, atol=0.35 * float(want.abs().max()))
    write_gpt_oss_gguf(tmp_path / "fused.gguf", ref, Q.MXFP4, Q.Q8_0, fuse_gate_up=True)  # one gate_up stack
    assert torch.equal(model_logits(build_model(*load_gguf(tmp_path / "fused.gguf", dtype=None)[:2]), ids), got)
    uncached = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], use_cache=False)
    expected = [generate(fast, torch.tensor([p]), None, uncached).new_token_ids[0] for p in PROMPTS]
    assert_greedy_on_every_cache(fast, PROMPTS, expected, NEW_TOKENS)


def test_gpt_oss_bad_files_are_refused_by_name(ref, tmp_path: Path):
    """No sliding window, another rope scaling or gating function, missing sinks or expert biases: refused naming the
    key or tensor."""
    unsupported = UnsupportedArchitectureError
    cases = [({"meta": {"gpt-oss.attention.sliding_window": None}}, ModelFormatError, r"\.attention\.sliding_window"),
             ({"meta": {"gpt-oss.rope.scaling.type": "linear"}}, unsupported, r"gpt-oss\.rope\.scaling\.type"),
             ({"meta": {"gpt-oss.expert_gating_func": 1}}, unsupported, r"gpt-oss\.expert_gating_func"),
             ({"meta": {"gpt-oss.expert_used_count": None}}, ModelFormatError, r"gpt-oss\.expert_used_count"),
             ({"drop": ("blk.1.attn_sinks.weight",)}, ModelFormatError, r"model\.layers\.1\.self_attn\.sinks"),
             ({"drop": ("blk.0.ffn_up_exps.bias",)}, ModelFormatError, r"layers\.0\.mlp\.experts\.0\.up_proj\.bias")]
    for i, (kwargs, error, match) in enumerate(cases):
        write_gpt_oss_gguf(tmp_path / f"{i}.gguf", ref, **kwargs)
        with pytest.raises(error, match=match):
            load_gguf(tmp_path / f"{i}.gguf")
    meta = {"general.architecture": "gpt-oss", "gpt-oss.block_count": 2, "gpt-oss.embedding_length": 64,
            "gpt-oss.attention.head_count": 4, "gpt-oss.vocab_size": 97, "gpt-oss.expert_count": 4,
            "gpt-oss.expert_used_count": 2, "gpt-oss.expert_feed_forward_length": 32,
            "gpt-oss.attention.sliding_window": 128, "gpt-oss.expert_gating_func": 3}
    assert ModelConfig.from_gguf_metadata(meta).rope_scaling is None


def test_info_names_gpt_oss_and_its_experts(ref, tmp_path: Path):
    """``kvgen info`` of an MXFP4 gpt-oss file (with a minimal BPE vocabulary): its architecture, decoder, experts,
    every logical weight counted once (sinks and biases included) and its storage types."""
    from kvgen.info import describe_model

    tokens = ["a", "b", "ab", *(f"t{i}" for i in range(3, ref.config.vocab_size))]

    def bpe(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(["a b"])

    write_gpt_oss_gguf(tmp_path / "i.gguf", ref, Q.MXFP4, Q.Q8_0, add_keys=bpe, tokens=tokens)
    info = describe_model(str(tmp_path / "i.gguf"))
    assert (info["architecture"], info["decoder"], info["rope_theta"]) == ("gpt-oss", "gpt_oss", 10000.0)
    assert (info["num_experts"], info["num_experts_per_tok"], info["moe_intermediate_size"]) == (4, 2, 32)
    assert info["num_parameters"] == sum(p.numel() for p in ref.parameters())
    # per layer: MXFP4 the 3 expert stacks; Q8_0 q, k, v, o; F32 2 norms, sinks, 4 biases, router and its bias, 3
    # expert bias stacks; and the embeddings and head (Q8_0), the final norm (F32)
    assert info["storage_types"] == {"MXFP4": 3 * 4, "Q8_0": 2 + 4 * 4, "F32": 1 + 12 * 4}
