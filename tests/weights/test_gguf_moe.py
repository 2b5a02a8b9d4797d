"""Mixture-of-experts GGUF files (``qwen3moe``, ``qwen2moe``, and Mixtral's ``llama`` with ``expert_count``) as
llama.cpp's converter writes them (weights.moe_gguf: expert stacks [E, rows, cols], F32 routers, q/k rows permuted
for llama only), from tiny random transformers models: F32 files give transformers' logits, Q8_0 and K-quant files
run on the kernels near the float32 path of the same file, older per-expert Mixtral files load as the stacked ones,
and files whose metadata or tensors do not add up are refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from helpers import engine_greedy, make_tiny_model, mixtral_to_qwen_names, model_logits
from weights.moe_gguf import Q, copy_file_weights, llama_cpp_permute, write_moe_gguf

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.generation import GenerationConfig, generate
from kvgen.models import build_model
from kvgen.models.moe import SparseMoeBlock
from kvgen.models.quant_linear import QuantLinear
from kvgen.weights.gguf_loader import load_gguf
from kvgen.weights.quantized import GGUFBlocks

MOE_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral"]
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
IDS = torch.tensor([[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 13, 10, 12, 14, 30, 31, 40, 2, 2, 9]])  # [1, 20]


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_f32_file_matches_transformers(tmp_path: Path, model_type: str):
    """An F32 file: llama.cpp's settings (qwen3moe and llama renormalize the top k, qwen2moe does not; Qwen3-MoE's
    layer 1 written dense is dense), the router float32 [E, C] and each expert's matrices as transformers' (Mixtral:
    q/k rows un-permuted, w1/w3/w2), Qwen2-MoE's squeezed shared-expert gate as [1, C]; logits equal transformers'."""
    ref = make_tiny_model(model_type, std=0.3, seed=3).ref
    write_moe_gguf(tmp_path / "m.gguf", ref, model_type)
    config, state, _ = load_gguf(tmp_path / "m.gguf")
    assert (config.model_type, config.extra["gguf_architecture"]) == ("llama", ARCH[model_type])
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob == (model_type != "qwen2_moe")
    assert config.mlp_only_layers == ([1] if model_type == "qwen3_moe" else [])
    assert config.shared_expert_intermediate_size == (64 if model_type == "qwen2_moe" else None)
    theirs = {mixtral_to_qwen_names(k): v for k, v in ref.state_dict().items()}
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.5.down_proj.weight",
                 "model.layers.2.mlp.experts.7.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.2.self_attn.k_proj.weight",
                 *(["model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert.up_proj.weight"]
                   if model_type == "qwen2_moe" else [])):
        assert state[name].dtype == torch.float32 and torch.equal(state[name], theirs[name]), name
    with torch.inference_mode():
        want = ref(IDS).logits
    torch.testing.assert_close(model_logits(build_model(config, state), IDS), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_q8_0_file_runs_on_the_kernels(tmp_path: Path, model_type: str):
    """A Q8_0 file, dtype auto: every expert's matrix stays Q8_0 blocks (a slice of its stack, no float32 copy) and
    runs on the kernels, the router float32; logits near the float32 path of the same file (which equals
    transformers' on the dequantized weights), far nearer than with the top-k renormalization flipped; greedy tokens
    the same with the static cache, without a cache and in the paged engine."""
    ref = make_tiny_model(model_type, std=0.1, seed=3).ref
    write_moe_gguf(tmp_path / "q.gguf", ref, model_type, Q.Q8_0)
    config, state, _ = load_gguf(tmp_path / "q.gguf")
    reference = build_model(config, state)
    config_q, state_q, _ = load_gguf(tmp_path / "q.gguf", dtype=None)
    up = state_q["model.layers.2.mlp.experts.3.up_proj.weight"]
    assert isinstance(up, GGUFBlocks) and up.qtype == Q.Q8_0 and up.shape == (32, 64)
    router = state_q["model.layers.2.mlp.gate.weight"]
    assert isinstance(router, torch.Tensor) and router.dtype == torch.float32
    assert not any(isinstance(v, torch.Tensor) and v.dim() == 2 for k, v in state_q.items() if ".experts." in k)
    quantized = build_model(config_q, state_q)
    assert quantized.kernels is not None and isinstance(quantized.model.layers[2].mlp.experts[3].down_proj, QuantLinear)
    copy_file_weights(ref, state, model_type)  # the file's (dequantized) weights
    with torch.inference_mode():
        want = ref(IDS).logits
    torch.testing.assert_close(model_logits(reference, IDS), want, rtol=1e-5, atol=1e-5)
    got = model_logits(quantized, IDS)
    error = float((got - want).abs().mean())
    # int8 activations: ~1-2 % of the logits' scale on average here
    assert error < 0.05 * float(want.abs().mean())
    torch.testing.assert_close(got, want, rtol=0, atol=0.1 * float(want.abs().max()))
    static = GenerationConfig(max_new_tokens=8, eos_token_id=[], cache_implementation="static")
    tokens = generate(quantized, IDS, None, static).new_token_ids[0]
    assert generate(quantized, IDS, None, replace(static, use_cache=False)).new_token_ids[0] == tokens
    assert engine_greedy(quantized, [IDS[0].tolist()], 8, num_blocks=16)[0] == tokens
    for layer in quantized.model.layers:  # the mutation check: routing weights as the other architectures take them
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.norm_topk_prob = not layer.mlp.norm_topk_prob
    assert float((model_logits(quantized, IDS) - want).abs().mean()) > 3 * error


def test_older_mixtral_files_with_a_tensor_per_expert_load_as_stacked_ones(tmp_path: Path):
    """A Mixtral file from before expert stacks (``blk.N.ffn_gate.E.weight`` per expert) loads the same tensors as
    the stacked file, in float32 and as Q8_0 blocks on the kernels (the same logits, bit for bit)."""
    ref = make_tiny_model("mixtral", std=0.3, seed=3).ref
    for name, stacked in (("stacked", True), ("per_expert", False)):
        write_moe_gguf(tmp_path / f"{name}.gguf", ref, "mixtral", Q.Q8_0, stacked=stacked)
    _, a, _ = load_gguf(tmp_path / "stacked.gguf")
    _, b, _ = load_gguf(tmp_path / "per_expert.gguf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logits = [model_logits(build_model(*load_gguf(tmp_path / f"{name}.gguf", dtype=None)[:2]), IDS)
              for name in ("stacked", "per_expert")]
    assert torch.equal(*logits)


def _random_k_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks for a float tensor of ``shape`` [..., cols] (cols % 256 == 0): uint8
    [..., bytes per row], the float16 scales (Q4_K: d and dmin at bytes 0 and 2, dmin = 7.5 d so that d sc q - dmin m
    averages 0; Q6_K: d at 208) small enough that the weights stay below ~0.5."""
    block, size = GGML_QUANT_SIZES[qtype]
    num_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(num_blocks, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-4, size=(num_blocks, 1))
    scales = {0: d, 2: 7.5 * d} if qtype == Q.Q4_K else {208: d}
    for offset, value in scales.items():
        raw[:, offset : offset + 2] = value.astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def test_moe_k_quant_stacks_run_on_the_kernels(tmp_path: Path):
    """A Mixtral file shaped as Q4_K_M writes it (gate and up stacks Q4_K, down Q6_K, the rest Q8_0; hidden 256):
    each expert keeps its Q4_K rows (its gate and up stacked into one weight) and its Q6_K rows, and
    every sparse block on the kernels stays near the same block of the float32 path of the file (dequantized by the
    gguf package). Whole-model logits are not compared: a random 3-layer mixture amplifies int8 activation noise
    through flipped routes (by as much with Q8_0 experts of the same values), which test_moe_q8_0_file_... bounds."""
    ref = make_tiny_model("mixtral", std=0.1, seed=4, hidden_size=256, intermediate_size=256).ref
    rng = np.random.default_rng(0)
    raw = {f"blk.{i}.ffn_{kind}_exps.weight": (_random_k_blocks((8, 256, 256), qtype, rng), qtype)
           for i in range(3) for kind, qtype in (("gate", Q.Q4_K), ("up", Q.Q4_K), ("down", Q.Q6_K))}
    write_moe_gguf(tmp_path / "k.gguf", ref, "mixtral", Q.Q8_0, raw=raw)
    reference = build_model(*load_gguf(tmp_path / "k.gguf")[:2])
    config, state, _ = load_gguf(tmp_path / "k.gguf", dtype=None)
    gate, down = (state[f"model.layers.1.mlp.experts.6.{name}.weight"] for name in ("gate_proj", "down_proj"))
    assert isinstance(gate, GGUFBlocks) and isinstance(down, GGUFBlocks)
    assert (gate.qtype, down.qtype) == (Q.Q4_K, Q.Q6_K)
    quantized = build_model(config, state)
    h = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))  # [N, C]
    for exact, fast in zip(reference.model.layers, quantized.model.layers):
        with torch.inference_mode():
            want = exact.mlp(h[None])[0]  # [N, C]
            got = fast.mlp.forward_kernels(h, torch.zeros_like(h))
        assert float((got - want).abs().mean()) < 0.03 * float(want.abs().mean())  # ~1.3 %: int8 activations


def test_moe_bad_files_are_refused_by_name(tmp_path: Path):
    """A sparse layer without one of its expert stacks or its router, stacks of more experts than ``expert_count``
    and more experts used than there are: ModelFormatError naming the tensor or key."""
    ref = make_tiny_model("qwen3_moe", seed=5, mlp_only_layers=[]).ref
    cases = [({"drop": ("blk.1.ffn_up_exps.weight",)}, r"missing blk\.1\.ffn_up_exps\.weight;"),
             ({"drop": ("blk.0.ffn_gate_inp.weight",)}, r"missing keys \(1\): model\.layers\.0\.mlp\.gate\.weight"),
             ({"expert_count": 4}, r"not \[4, rows, cols\]: blk\.0\.ffn_\w+_exps\.weight \[8, "),
             ({"expert_count": 1}, r"qwen3moe\.expert_used_count \(2\) must be at most qwen3moe\.expert_count \(1\)")]
    for i, (kwargs, match) in enumerate(cases):
        write_moe_gguf(tmp_path / f"{i}.gguf", ref, "qwen3_moe", **kwargs)
        with pytest.raises(ModelFormatError, match=match):
            load_gguf(tmp_path / f"{i}.gguf")


def test_moe_metadata_llama_cpp_does_not_compute_is_refused():
    """Metadata: no expert_used_count, sigmoid gating or a weight scale (llama.cpp's DeepSeek settings, which its
    qwen3moe graph ignores) are refused naming the key; a llama file without experts stays dense."""
    meta = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2, "qwen3moe.embedding_length": 64,
            "qwen3moe.attention.head_count": 4, "qwen3moe.vocab_size": 97, "qwen3moe.expert_count": 8,
            "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    config = ModelConfig.from_gguf_metadata(meta)
    assert (config.num_experts, config.intermediate_size, config.norm_topk_prob) == (8, 32, True) and config.use_qk_norm
    for key, value, error in (("qwen3moe.expert_used_count", None, ModelFormatError),
                              ("qwen3moe.expert_gating_func", 2, UnsupportedArchitectureError),
                              ("qwen3moe.expert_weights_scale", 2.5, UnsupportedArchitectureError)):
        with pytest.raises(error, match=key.replace(".", r"\.")):
            ModelConfig.from_gguf_metadata({k: v for k, v in (meta | {key: value}).items() if v is not None})
    dense = {k.replace("qwen3moe", "llama"): v for k, v in meta.items() if "expert" not in k}
    dense["general.architecture"] = "llama"
    with pytest.raises(ModelFormatError, match="llama.feed_forward_length"):
        ModelConfig.from_gguf_metadata(dense)
    assert ModelConfig.from_gguf_metadata(dense | {"llama.feed_forward_length": 128}).num_experts == 0


def test_the_writer_permutes_mixtral_q_k_rows_as_llama_cpp_does(tmp_path: Path):
    """The writer's Mixtral q/k rows are permuted as llama.cpp's converter does (so the F32 test's equality checks
    the loader's un-permutation), Qwen's are not."""
    from gguf import GGUFReader

    ref = make_tiny_model("mixtral", seed=6).ref
    write_moe_gguf(tmp_path / "m.gguf", ref, "mixtral")
    stored = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}["blk.0.attn_q.weight"]
    q = ref.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(np.asarray(stored.data), llama_cpp_permute(q, 4))
    assert not np.array_equal(q, llama_cpp_permute(q, 4))


def test_info_names_the_files_own_architecture_and_experts(tmp_path: Path):
    """``kvgen info`` of a Q8_0 ``qwen3moe`` file (with a minimal BPE vocabulary): its own architecture, the Llama
    decoder, the experts, and every logical weight counted once (the expert stacks as E matrices each)."""
    from kvgen.info import describe_model

    ref = make_tiny_model("qwen3_moe", seed=5, mlp_only_layers=[]).ref
    tokens = ["a", "b", "ab", *(f"t{i}" for i in range(3, ref.config.vocab_size))]

    def bpe(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(["a b"])

    write_moe_gguf(tmp_path / "i.gguf", ref, "qwen3_moe", Q.Q8_0, add_keys=bpe, tokens=tokens)
    info = describe_model(str(tmp_path / "i.gguf"))
    assert (info["architecture"], info["decoder"]) == ("qwen3moe", "llama")
    assert (info["num_experts"], info["num_experts_per_tok"], info["moe_intermediate_size"]) == (8, 2, 32)
    assert info["num_parameters"] == sum(p.numel() for p in ref.parameters())
    # F32: the final norm, per layer 4 norms and the router; Q8_0: embeddings, head, per layer 4 + 3 expert stacks
    assert info["storage_types"] == {"F32": 1 + 5 * 3, "Q8_0": 2 + 7 * 3}

