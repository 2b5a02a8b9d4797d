"""``quantization`` (load_model, EngineArgs, ``--quantization``): float checkpoints encoded at load for the kernels.

The reference for the encoding is the ``gguf`` package's quantizers (llama.cpp's ``quantize_row_*_ref``) applied
to transformers' own parameters; the reference for the model is transformers' float model on the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from helpers import (
    engine_greedy,
    hf_params_in_kvgen_layout,
    make_tiny_model,
    save_tiny_model_dir,
)

from kvgen.engine import EngineArgs
from kvgen.generation import GenerationConfig, generate
from kvgen.loader import load_model
from kvgen.models.quant_linear import QuantEmbedding, QuantLinear
from kvgen.weights import quantized
from kvgen.weights.hf_loader import load_hf_directory
from kvgen.weights.quantized import QUANTIZATIONS, GGUFBlocks, parse_quantization

Q = GGMLQuantizationType
TYPES = list(QUANTIZATIONS.values())


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny random Llama (untied LM head, GQA, hidden 64) saved in float32, and transformers' model."""
    path = tmp_path_factory.mktemp("quantize-me")
    save_tiny_model_dir(path, tie=False, kv_heads=2, max_position_embeddings=256)
    from transformers import LlamaForCausalLM

    return path, LlamaForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_matrix_is_the_gguf_encoding_of_the_checkpoint(tiny_llama_dir, qtype, monkeypatch) -> None:
    """Every matrix (embedding and LM head as Q8_0 under a 4- or 5-bit type) holds exactly the bytes that the gguf
    package's quantizer makes of transformers' parameter, also when the rows are encoded a few at a time; vectors
    stay float32."""
    path, ref = tiny_llama_dir
    monkeypatch.setattr(quantized, "_QUANTIZE_CHUNK_VALUES", 64 * 5)  # 5 rows a step: the last step is partial
    _, state = load_hf_directory(path, dtype=None, quantization=qtype)
    want = hf_params_in_kvgen_layout(ref)
    assert sorted(state) == sorted(want)
    for name, w in want.items():
        got = state[name]
        if w.dim() == 1:
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and torch.equal(got, w), name
            continue
        assert isinstance(got, GGUFBlocks), name
        expected_type = Q.Q8_0 if name in ("model.embed_tokens.weight", "lm_head.weight") else qtype
        assert got.qtype == expected_type and got.shape == tuple(w.shape), name
        assert torch.equal(torch.cat(got.parts), torch.from_numpy(quantize(w.numpy(), expected_type))), name


@pytest.mark.parametrize(("quantization", "tolerance"), [("q8_0", 0.05), ("q5_1", 0.15), ("q4_0", 0.4)])
def test_quantized_model_stays_near_transformers(tiny_llama_dir, quantization, tolerance) -> None:
    """The quantized model runs every matrix through the kernels; its logits stay within the quantization's error
    of transformers' float32 logits (mean absolute difference relative to their mean magnitude), the errors
    growing as the bits shrink; q8_0 picks transformers' top token at most positions."""
    path, ref = tiny_llama_dir
    model, _ = load_model(path, quantization=quantization)
    layer = model.model.layers[0]
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert all(isinstance(m, QuantLinear) for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj))
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(24)[None].expand(2, -1)))
        want = ref(ids).logits
    error = float((got - want).abs().mean() / want.abs().mean())
    assert error < tolerance, error
    if quantization == "q8_0":
        assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.9


def test_the_engine_and_generate_agree_on_a_quantized_model(tiny_llama_dir) -> None:
    """LLM(..., quantization=...) (EngineArgs) loads the same quantized model as load_model: the engine's greedy
    tokens equal generate()'s, and its LM head is Q8_0 under a 4-bit type."""
    from kvgen.engine import LLM
    from kvgen.kernels import Q8

    path, _ = tiny_llama_dir
    model, _ = load_model(path, quantization="q4_1")
    prompts = [[5, 9, 14, 2, 7], [3, 3, 8]]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=[])
    want = [generate(model, torch.tensor([p]), None, config).new_token_ids[0] for p in prompts]
    llm = LLM(str(path), quantization="q4_1", num_blocks=64, block_size=4)
    assert llm.llm_engine.model.lm_head.weight_type == Q8
    assert engine_greedy(llm.llm_engine.model, prompts, 6) == want


def test_bad_quantization_requests_are_refused(tiny_llama_dir, tmp_path: Path) -> None:
    """A name that is not a type, a dtype other than auto, gpt-oss (its MXFP4 expert stacks), in_features not a
    multiple of 32: ValueError naming the problem (load_model, EngineArgs)."""
    from helpers import tiny_gpt_oss

    path, _ = tiny_llama_dir
    with pytest.raises(ValueError, match="quantization must be one of q8_0, q5_1, q5_0, q4_1, q4_0"):
        load_model(path, quantization="q3_k")
    with pytest.raises(ValueError, match="needs dtype 'auto'"):
        load_model(path, dtype="float32", quantization="q8_0")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int8")
    with pytest.raises(ValueError, match="needs dtype 'auto'"):
        EngineArgs(quantization="q8_0", dtype="bfloat16")
    assert parse_quantization("Q4_0") == Q.Q4_0 and parse_quantization(None) is None
    tiny_gpt_oss().save_pretrained(tmp_path / "gpt-oss", safe_serialization=True)
    with pytest.raises(ValueError, match="not supported for model_type 'gpt_oss'"):
        load_hf_directory(tmp_path / "gpt-oss", dtype=None, quantization=Q.Q8_0)
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2))
    odd.save_pretrained(tmp_path / "odd", safe_serialization=True)
    with pytest.raises(ValueError, match="in_features is a multiple of 32"):
        load_hf_directory(tmp_path / "odd", dtype=None, quantization=Q.Q4_0)


def test_cli_choices_are_the_quantizations() -> None:
    """The CLI's --quantization choices (named there without importing torch) are QUANTIZATIONS'."""
    from kvgen.cli_flags import QUANTIZATION_CHOICES

    assert QUANTIZATION_CHOICES == tuple(QUANTIZATIONS)


@pytest.mark.parametrize("model_type", ["gpt2", "qwen2", "qwen3", "mistral", "smollm3", "gemma3_text", "gemma2",
                                        "ernie4_5", "granite", "phi3", "mixtral", "qwen3_moe", "qwen2_moe"])
def test_every_family_quantizes(tmp_path: Path, model_type) -> None:
    """q8_0 on each other family kvgen decodes (GPT-2's transposed Conv1D matrices and tied head, biases, q/k norms,
    stacked phi3 matrices, experts, shared experts): every matrix but the routers and GPT-2's position table is Q8_0,
    those stay dense float32, and the logits stay within q8_0's error of transformers' (< 8 % mean absolute
    difference here; measured 1.6-5 %)."""
    from kvgen.models import build_model
    from kvgen.weights.name_maps import is_router_weight

    ref = make_tiny_model(model_type, vocab_size=96).ref
    ref.save_pretrained(tmp_path, safe_serialization=True)
    config, state = load_hf_directory(tmp_path, dtype=None, quantization=Q.Q8_0)
    matrices = {n: v for n, v in state.items() if isinstance(v, GGUFBlocks) or v.dim() == 2}
    routers = {n for n in matrices if is_router_weight(n)}
    assert bool(routers) == (model_type in ("mixtral", "qwen3_moe", "qwen2_moe"))
    dense = routers | ({"transformer.wpe.weight"} if model_type == "gpt2" else set())
    assert dense == {n for n, v in matrices.items() if not isinstance(v, GGUFBlocks)}
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for n, v in matrices.items() if n in dense)
    assert all(v.qtype == Q.Q8_0 for n, v in matrices.items() if n not in dense)
    if model_type == "gpt2":  # the Conv1D [in, out] matrices were encoded as [out, in], as the kernels take them
        want = hf_params_in_kvgen_layout(ref)
        for n in set(matrices) - dense:
            assert torch.equal(torch.cat(matrices[n].parts), torch.from_numpy(quantize(want[n].numpy(), Q.Q8_0))), n
    model = build_model(config, state).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(12)[None]))
        want = ref(ids).logits
    assert float((got - want).abs().mean()) < 0.08 * float(want.abs().mean())


def test_head_dim_not_a_multiple_of_8_stays_off_the_kernels(tmp_path: Path) -> None:
    """head_dim 12 (in_features 96, a multiple of 32): dtype auto loads a bfloat16 checkpoint as float32 and its logits
    are transformers' on the same weights; quantization is refused naming head_dim. The kernels' attention takes head
    dims that are multiples of 8: kvgen loaded both onto them and the first forward raised a RuntimeError."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=12)).eval()
    ref.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    _, state = load_hf_directory(tmp_path, dtype=None)
    assert not any(isinstance(t, GGUFBlocks) for t in state.values())
    with pytest.raises(ValueError, match="needs a head_dim that is a multiple of 8, got 12"):
        load_hf_directory(tmp_path, dtype=None, quantization=Q.Q8_0)
    from kvgen.models import build_model

    ours = build_model(*load_hf_directory(tmp_path, dtype=None))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        want = ref.float()(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(5)[None]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_q8_0_re_encoding_is_the_gguf_encoding() -> None:
    """``dense_to_q8_0`` (F32 matrices of a quantized GGUF file, mixed stacks) holds exactly the bytes of the gguf
    package's Q8_0 quantizer (llama.cpp's ``quantize_row_q8_0_ref``, roundf): on random rows, an all-zero row, a row
    with an outlier, a negative row, values on x.5 ties, and 0.49999997 after scaling (which roundf takes to 0 and
    floor(|q| + 0.5) to 1)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 64, generator=g)
    rows[1] = 0.0
    rows[2, 7] = 1e4
    rows[3] = -rows[3].abs()
    rows[4] = torch.randint(-126, 126, (64,), generator=g) + 0.5
    rows[4, 0] = 127.0  # d = 1: the row's values stay on their ties
    rows[5, 0], rows[5, 1], rows[5, 2] = 127.0, 0.5 - 2.0**-25, -(0.5 - 2.0**-25)
    got = quantized.dense_to_q8_0(rows)
    assert got.qtype == Q.Q8_0 and got.shape == (6, 64)
    assert torch.equal(got.parts[0], torch.from_numpy(quantize(rows.numpy(), Q.Q8_0)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_non_finite_or_overflowing_matrices_are_refused(qtype) -> None:
    """A matrix holding NaN or inf, or a value whose block scale overflows float16 in the gguf encoding (llama.cpp's
    ``llama-quantize`` refuses such blocks: "quantized data validation failed"), is a ValueError naming the matrix;
    the largest value whose encoding stays finite still quantizes, to the gguf bytes."""
    from gguf.constants import GGML_QUANT_SIZES

    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        w_bad = w.clone()
        w_bad[1, 40] = bad
        with pytest.raises(ValueError, match=f"mlp.down_proj.weight holds NaN or inf values: .* {qtype.name.lower()}"):
            quantized.quantize_matrix("mlp.down_proj.weight", w_bad, qtype)
    num_scales = 2 if qtype in (Q.Q4_1, Q.Q5_1) else 1
    for big, overflows in ((1e7, True), (6e4, False)):
        w_big = w.clone()
        w_big[2, 5] = -big
        with np.errstate(over="ignore", invalid="ignore"):
            want = quantize(w_big.numpy(), qtype)
        scales = torch.from_numpy(want).reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, :2 * num_scales]  # fp16 d (, m)
        assert bool(torch.isfinite(scales.contiguous().view(torch.float16)).all()) != overflows
        if overflows:
            with pytest.raises(ValueError, match="up to 1e\\+07 in magnitude: .* block scale overflows float16"):
                quantized.quantize_matrix("mlp.down_proj.weight", w_big, qtype)
        else:
            got = quantized.quantize_matrix("mlp.down_proj.weight", w_big, qtype)
            assert torch.equal(got.parts[0], torch.from_numpy(want))


def test_a_checkpoint_with_a_nan_weight_is_refused_at_load(tiny_llama_dir, tmp_path: Path) -> None:
    """load_model(..., quantization=...) on a checkpoint with a NaN in one matrix: ValueError naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = tiny_llama_dir
    shutil.copytree(path, tmp_path / "nan", dirs_exist_ok=True)
    state = load_file(tmp_path / "nan" / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight"][3, 9] = float("nan")
    save_file(state, tmp_path / "nan" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.weight holds NaN or inf values"):
        load_model(tmp_path / "nan", quantization="q4_0")
