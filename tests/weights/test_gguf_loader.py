"""GGUF loading: the default model against transformers' own GGUF loader, every
quantization type against the ``gguf`` package (and the original floats), q/k
un-permutation against transformers, and bad files.

Synthetic files are written with ``gguf.GGUFWriter``; the q/k tensors in them
are permuted with a copy of llama.cpp's converter permutation, so a loader
that forgets to undo it fails against the original floats.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from helpers import (
    assert_one_op_decoder_is_layer_by_layer,
    finish_gguf,
    llama_cpp_permute,
    model_logits,
)

from kvgen.errors import (
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from kvgen.weights import gguf_loader
from kvgen.weights.gguf_file import gguf_metadata, open_gguf
from kvgen.weights.gguf_loader import (
    SUPPORTED_QUANT_TYPES,
    dequantize_tensor,
    load_gguf,
    reverse_permute_qk,
)

Q = GGMLQuantizationType
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# types the gguf package dequantizes but cannot quantize, written as random blocks
IQ_TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0,
            Q.MXFP4]
RANDOM_TYPES = K_QUANTS + IQ_TYPES
# byte offsets of the f16 scale fields (d, dmin) in each block (ggml-common.h); IQ1_M and MXFP4: _random_kquant_bytes
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.TQ1_0: (52,),
                    Q.TQ2_0: (64,), **{q: (0,) for q in IQ_TYPES if q not in (Q.IQ1_M, Q.MXFP4, Q.TQ1_0, Q.TQ2_0)}}


def _assert_equal(ours: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Bit-exact equality (torch.equal is ~30x faster than assert_close on the 28M-element embedding)."""
    assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), name
    if not torch.equal(ours, ref):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, msg=name)  # fails, with a useful message


# --- the default model ---------------------------------------------------------


@pytest.fixture(scope="module")
def ours_f32(default_gguf_path: Path):
    return load_gguf(default_gguf_path, torch.float32)


def test_default_matches_transformers(ours_f32, hf_default) -> None:
    config, state, meta = ours_f32
    theirs = hf_default.state_dict()
    assert config.tie_word_embeddings and "lm_head.weight" not in state
    assert set(theirs) == set(state) | {"lm_head.weight"}  # theirs lists the tied head too
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        _assert_equal(tensor, theirs[name], name)
    ref = hf_default.config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "rope_theta", "max_position_embeddings"):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert meta["general.architecture"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == config.vocab_size


def test_default_bfloat16_is_rounded_float32(ours_f32, default_gguf_path: Path) -> None:
    _, state, _ = ours_f32
    _, state_bf16, _ = load_gguf(default_gguf_path, torch.bfloat16)
    assert state_bf16.keys() == state.keys()
    for name, tensor in state_bf16.items():
        assert tensor.dtype == torch.bfloat16
        _assert_equal(tensor, state[name].to(torch.bfloat16), name)


def test_fast_reader_matches_gguf_reader(default_gguf_path: Path) -> None:
    plain, fast = GGUFReader(default_gguf_path), open_gguf(default_gguf_path)
    assert list(fast.fields) == list(plain.fields)
    for key, a in plain.fields.items():
        b = fast.fields[key]
        assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), key
        assert [(p.dtype, p.shape, p.tobytes()) for p in b.parts] == [(p.dtype, p.shape, p.tobytes()) for p in a.parts]
        assert b.contents() == a.contents(), key
    assert fast.data_offset == plain.data_offset
    for a, b in zip(plain.tensors, fast.tensors, strict=True):
        assert (b.name, b.tensor_type, b.shape.tolist()) == (a.name, a.tensor_type, a.shape.tolist())
        assert b.data_offset == a.data_offset
        assert b.data.shape == a.data.shape and np.array_equal(b.data, a.data), a.name
    meta = gguf_metadata(fast)
    assert meta == {k: f.contents() for k, f in plain.fields.items() if not k.startswith("GGUF.")}
    tokens, plain_tokens = fast.fields["tokenizer.ggml.tokens"].parts, plain.fields["tokenizer.ggml.tokens"].parts
    assert [p.tobytes() for p in tokens[-3:]] == [p.tobytes() for p in plain_tokens[-3:]]  # slices, negative
    assert tokens[-1].tobytes() == plain_tokens[-1].tobytes()
    with pytest.raises(IndexError):
        tokens[len(plain_tokens)]


_PEAK_SCRIPT = """
import json, resource, sys, torch
from kvgen.weights.gguf_loader import load_gguf
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_, state, _ = load_gguf(sys.argv[1], getattr(torch, sys.argv[2]))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(t.numel() * t.element_size() for t in state.values())
print(json.dumps({"peak_increase": (after - before) * 1024, "weights": weights}))
"""


def test_peak_memory_stays_near_weight_size(default_gguf_path: Path) -> None:
    """bfloat16 is the sharp case: a float32 copy of every tensor would double the increase."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(default_gguf_path), "bfloat16"],
        capture_output=True, text=True, check=True, timeout=120,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["peak_increase"] < r["weights"] + (96 << 20), r  # measured: weights + ~40 MiB


# --- synthetic files -------------------------------------------------------------

C, I, V, H, HKV, L = 256, 512, 64, 4, 2, 2  # K-quants need rows that are multiples of 256
D = C // H


def _tiny_shapes(*, output: bool = True, bias: bool | str = False) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> torch shape of a tiny Llama (GQA: H=4, Hkv=2); ``bias``: True for q/k/v biases (Qwen2),
    "all" for o_proj's too."""
    shapes = {"token_embd.weight": (V, C), "output_norm.weight": (C,)}
    if output:
        shapes["output.weight"] = (V, C)
    for i in range(L):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (C,), b + "ffn_norm.weight": (C,), b + "attn_q.weight": (H * D, C),
                   b + "attn_k.weight": (HKV * D, C), b + "attn_v.weight": (HKV * D, C),
                   b + "attn_output.weight": (C, H * D), b + "ffn_gate.weight": (I, C), b + "ffn_up.weight": (I, C),
                   b + "ffn_down.weight": (C, I)}
        if bias:
            shapes |= {b + "attn_q.bias": (H * D,), b + "attn_k.bias": (HKV * D,), b + "attn_v.bias": (HKV * D,)}
        if bias == "all":
            shapes |= {b + "attn_output.bias": (C,)}
    return shapes


def _random_kquant_bytes(rows: int, cols: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Valid raw blocks of a K, IQ, TQ or MXFP4 type: random bits, with scales in a sane range. uint8 [rows, bytes
    per row]."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS.get(qtype, ()):
        raw[:, off : off + 2] = rng.uniform(1e-3, 2e-2, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.IQ1_M:  # the fp16 d is the top nibbles of the 4 uint16 scales (bytes 48-55): 0x1C00 = 2^-8
        raw[:, 49:56:2] = (raw[:, 49:56:2] & 0x0F) | (np.array([0x0, 0x0, 0xC, 0x1], np.uint8) << 4)
    if qtype == Q.MXFP4:  # an E8M0 exponent byte per 32 values: scales 2^-10 .. 2^-6
        raw[:, 0] = rng.integers(118, 123, size=raw.shape[0], dtype=np.uint8)
    return raw.reshape(rows, cols // block * size)


def _add(writer: GGUFWriter, name: str, x: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> None:
    """Store float32 x (torch order) as qtype; K, IQ, TQ and MXFP4 types get random blocks instead (gguf cannot
    quantize them)."""
    if qtype in RANDOM_TYPES:
        writer.add_tensor(name, _random_kquant_bytes(*x.shape, qtype, rng), raw_dtype=qtype)
    elif qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, quantize(x, qtype))
    else:
        writer.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)


def _write_llama(path: Path, types: dict[str, GGMLQuantizationType] | None = None, *, arch: str = "llama",
                 output: bool = True, bias: bool | str = False, drop: tuple[str, ...] = (),
                 extra: dict[str, np.ndarray | tuple[np.ndarray, GGMLQuantizationType]] | None = None,
                 keys: Callable[[GGUFWriter], None] | None = None) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF; returns the float32 tensors before quantization, in HF (unpermuted) order.
    q/k rows are stored permuted as llama.cpp does, except for ``arch="qwen2"`` and ``"qwen3"``.

    ``types``: storage type per GGUF name (default F32). ``extra``: tensors added as given
    (an array, or raw bytes with their type). ``keys``: called with the writer to add metadata.
    """
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(C)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    if keys is not None:
        keys(w)
    originals = {}
    for name, shape in _tiny_shapes(output=output, bias=bias).items():
        if name in drop:
            continue
        x = (rng.standard_normal(shape) * 0.05 + (1.0 if name.endswith("norm.weight") else 0.0)).astype(np.float32)
        originals[name] = x
        heads = None if arch in ("qwen2", "qwen3") else H if ".attn_q." in name else HKV if ".attn_k." in name else None
        _add(w, name, llama_cpp_permute(x, heads) if heads else x, (types or {}).get(name, Q.F32), rng)
    for name, x in (extra or {}).items():
        if isinstance(x, tuple):
            w.add_tensor(name, x[0], raw_dtype=x[1])
        else:
            w.add_tensor(name, x)
    finish_gguf(w)
    return originals


def _step(qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """One quantization step per element (x float32 [rows, cols]): a bound on round-to-nearest error."""
    if qtype == Q.F32:
        return np.zeros_like(x)
    if qtype in (Q.F16, Q.BF16):
        return np.abs(x) * (2.0**-10 if qtype == Q.F16 else 2.0**-7)
    blocks = x.reshape(x.shape[0], -1, 32)  # [rows, n_blocks, 32]
    amax, amin = np.abs(blocks).max(-1, keepdims=True), blocks.min(-1, keepdims=True)
    span = {Q.Q4_0: 2 * amax / 16, Q.Q5_0: 2 * amax / 32, Q.Q8_0: 2 * amax / 255,
            Q.Q4_1: (blocks.max(-1, keepdims=True) - amin) / 15, Q.Q5_1: (blocks.max(-1, keepdims=True) - amin) / 31}
    return np.broadcast_to(span[qtype], blocks.shape).reshape(x.shape)


@pytest.mark.parametrize("qtype", QUANTIZABLE + RANDOM_TYPES, ids=lambda q: q.name)
def test_each_type_against_gguf_and_originals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype) -> None:
    monkeypatch.setattr(gguf_loader, "_CHUNK_BYTES", 4 * 512 * 5)  # 5 rows per chunk: several chunks, a short last one
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((23, 512)) * 0.1).astype(np.float32)
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    _add(writer, "t.weight", x, qtype, rng)
    finish_gguf(writer)
    t = open_gguf(tmp_path / "t.gguf").tensors[0]
    assert t.tensor_type == qtype
    ours = dequantize_tensor(t, torch.float32)
    assert ours.shape == (23, 512) and ours.dtype == torch.float32
    reference = torch.from_numpy(dequantize(t.data, qtype).copy())  # what transformers' GGUF loader uses too
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    if qtype in RANDOM_TYPES:
        assert torch.isfinite(ours).all() and ours.unique().numel() > 20  # TQ: 3 values per block, MXFP4: 15
    else:
        err = np.abs(ours.numpy() - x)
        assert (err <= _step(qtype, x) + 1e-6).all(), float(err.max())
    torch.testing.assert_close(dequantize_tensor(t, torch.bfloat16), reference.to(torch.bfloat16), rtol=0, atol=0)


def _mixed_types() -> dict[str, GGMLQuantizationType]:
    """Every supported type but the rarer IQ ones (each checked alone above) on some matrix, q and k included; norms
    stay F32."""
    assert set(RANDOM_TYPES + QUANTIZABLE) == SUPPORTED_QUANT_TYPES
    types = K_QUANTS + QUANTIZABLE + [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
    mats = [n for n, s in _tiny_shapes().items() if len(s) == 2]
    assert len(mats) >= len(types)
    return {name: types[i % len(types)] for i, name in enumerate(mats)}


def test_tiny_llama_every_type_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(gguf_loader, "_CHUNK_BYTES", 4 * C * D)  # q/k chunks of one head: exercises head alignment
    types = _mixed_types()
    # q/k of layer 0 are K-quants (checked against transformers), of layer 1 not (checked against the originals too)
    assert {types["blk.0.attn_q.weight"], types["blk.0.attn_k.weight"]} <= set(K_QUANTS)
    assert not {types["blk.1.attn_q.weight"], types["blk.1.attn_k.weight"]} & set(K_QUANTS)
    originals = _write_llama(tmp_path / "tiny.gguf", types)
    config, state, _ = load_gguf(tmp_path / "tiny.gguf")
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (H, HKV, False)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", torch_dtype=torch.float32)
    theirs = theirs.state_dict()
    assert set(theirs) == set(state)
    for name in state:
        _assert_equal(state[name], theirs[name], name)
    # independent of transformers: the quantizable tensors are close to the original (unpermuted) floats
    names = {gguf_loader.gguf_to_kvgen_name(g): g for g in originals}
    for ours, g in names.items():
        if types.get(g, Q.F32) not in RANDOM_TYPES:
            x = originals[g].reshape(originals[g].shape[0], -1)
            err = np.abs(state[ours].numpy().reshape(x.shape) - x)
            assert (err <= _step(types.get(g, Q.F32), x) + 1e-6).all(), (g, types.get(g), float(err.max()))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (9, 3)])
def test_reverse_permute_matches_transformers(num_heads: int, num_kv_heads: int) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reverse = LlamaTensorProcessor()._reverse_permute_weights
    g = torch.Generator().manual_seed(0)
    for rows, heads in ((num_heads * 16, num_heads), (num_kv_heads * 16, num_kv_heads)):
        for shape in ((rows, 24), (rows,)):  # weight and bias
            w = torch.randn(shape, generator=g)
            ours = reverse_permute_qk(w, heads)
            # transformers picks num_kv_heads when it differs from n_head (its k path)
            theirs = reverse(w.numpy(), num_heads, heads)
            torch.testing.assert_close(ours, torch.from_numpy(theirs), rtol=0, atol=0)
            permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
            torch.testing.assert_close(reverse_permute_qk(permuted, heads), w, rtol=0, atol=0)
            assert not torch.equal(ours, w)  # the permutation is not the identity


def test_tied_when_file_has_no_output_weight(tmp_path: Path) -> None:
    originals = _write_llama(tmp_path / "t.gguf", output=False)
    config, state, _ = load_gguf(tmp_path / "t.gguf", torch.bfloat16)
    assert config.tie_word_embeddings and "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(state["model.layers.1.self_attn.k_proj.weight"],
                               torch.from_numpy(originals["blk.1.attn_k.weight"]).to(torch.bfloat16), rtol=0, atol=0)


def test_attention_biases_are_unpermuted(tmp_path: Path) -> None:
    originals = _write_llama(tmp_path / "t.gguf", bias="all")
    config, state, _ = load_gguf(tmp_path / "t.gguf")
    assert config.attention_bias and config.o_proj_bias and not config.mlp_bias
    for g, ours in (("attn_q.bias", "self_attn.q_proj.bias"), ("attn_k.bias", "self_attn.k_proj.bias"),
                    ("attn_output.bias", "self_attn.o_proj.bias")):
        want = torch.from_numpy(originals[f"blk.1.{g}"])
        torch.testing.assert_close(state[f"model.layers.1.{ours}"], want, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_qwen2_files_load_as_stored_with_q_k_v_biases(tmp_path: Path, qtype) -> None:
    """llama.cpp writes Qwen2 q/k rows unpermuted and biases q/k/v only: the tensors come back as written, and the
    model (float32, or quantized on the kernels with its biases) runs the same numbers."""
    from kvgen.models import build_model

    types = {f"blk.{i}.{n}.weight": qtype for i in range(L) for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                      "ffn_gate", "ffn_up", "ffn_down")}
    originals = _write_llama(tmp_path / "q.gguf", types, arch="qwen2", bias=True)
    config, state, _ = load_gguf(tmp_path / "q.gguf")
    assert config.attention_bias and config.o_proj_bias is False and config.model_type == "llama"
    for g, ours in (("attn_q.weight", "self_attn.q_proj.weight"), ("attn_k.weight", "self_attn.k_proj.weight"),
                    ("attn_q.bias", "self_attn.q_proj.bias"), ("attn_v.bias", "self_attn.v_proj.bias")):
        want = torch.from_numpy(originals[f"blk.1.{g}"])
        torch.testing.assert_close(state[f"model.layers.1.{ours}"], want, rtol=0, atol=0.02 if qtype == Q.Q8_0 else 0)
    reference = build_model(config, state)
    quantized = build_model(*load_gguf(tmp_path / "q.gguf", None)[:2])
    assert reference.model.layers[0].self_attn.o_proj.bias is None
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        want = reference.compute_logits(reference(ids, torch.arange(5)[None]))
        got = quantized.compute_logits(quantized(ids, torch.arange(5)[None]))
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * float(want.abs().max()))
    if qtype == Q.Q8_0:  # on the kernels
        assert quantized._decoder_operands is not None and quantized._decoder_operands.extras  # extras gathered
        assert_one_op_decoder_is_layer_by_layer(quantized, ids, want)


def test_qwen3_files_normalize_each_head_on_both_paths(tmp_path: Path) -> None:
    """A ``qwen3`` file (q/k rows unpermuted, ``attn_q_norm`` / ``attn_k_norm`` [D]): the norms load, and the
    quantized kernel path (heads normalized between the qkv matmul and RoPE) runs the float32 path's numbers."""
    from kvgen.models import build_model

    rng = np.random.default_rng(3)
    norms = {f"blk.{i}.attn_{n}_norm.weight": (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
             for i in range(L) for n in "qk"}
    types = {f"blk.{i}.{n}.weight": Q.Q8_0 for i in range(L) for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                       "ffn_gate", "ffn_up", "ffn_down")}
    originals = _write_llama(tmp_path / "q3.gguf", types, arch="qwen3", extra=dict(norms))
    config, state, _ = load_gguf(tmp_path / "q3.gguf")
    assert config.use_qk_norm and config.model_type == "llama"
    torch.testing.assert_close(state["model.layers.1.self_attn.k_norm.weight"],
                               torch.from_numpy(norms["blk.1.attn_k_norm.weight"]), rtol=0, atol=0)
    torch.testing.assert_close(state["model.layers.1.self_attn.q_proj.weight"],
                               torch.from_numpy(originals["blk.1.attn_q.weight"]), rtol=0, atol=0.02)
    reference = build_model(config, state)
    quantized = build_model(*load_gguf(tmp_path / "q3.gguf", None)[:2])
    assert quantized.kernels is not None
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        want = reference.compute_logits(reference(ids, torch.arange(5)[None]))
        got = quantized.compute_logits(quantized(ids, torch.arange(5)[None]))
        for layer in reference.model.layers:  # without the norms the logits move far more than quantization does
            layer.self_attn.q_norm.weight.fill_(1.0)
        unnormed = reference.compute_logits(reference(ids, torch.arange(5)[None]))
    tol = 0.05 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    assert float((unnormed - want).abs().max()) > 4 * tol
    assert quantized._decoder_operands is not None and quantized._decoder_operands.extras  # extras gathered
    assert_one_op_decoder_is_layer_by_layer(quantized, ids, want)


def test_rope_freqs_of_ones_is_ignored(tmp_path: Path) -> None:
    _write_llama(tmp_path / "t.gguf", extra={"rope_freqs.weight": np.ones(D // 2, dtype=np.float32)})
    _, state, _ = load_gguf(tmp_path / "t.gguf")
    assert not any("rope" in k for k in state)


# --- bad input ---------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        load_gguf(tmp_path / "absent.gguf")
    assert str(tmp_path / "absent.gguf") in str(info.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(ModelFormatError, match="is not a GGUF file"):
        load_gguf(tmp_path / "x.gguf")


_CUTS = ["header", "mid_metadata", "tensor_info", "tensor_data_start", "mid_data", "last_byte"]


@pytest.mark.parametrize("where", _CUTS)
def test_truncated_default_file(tmp_path: Path, default_gguf_path: Path, where: str) -> None:
    data_offset = open_gguf(default_gguf_path).data_offset  # end of metadata and tensor infos
    size = default_gguf_path.stat().st_size
    cut = {"header": 24, "mid_metadata": data_offset // 2, "tensor_info": data_offset - 100,
           "tensor_data_start": data_offset + 1000, "mid_data": size // 2, "last_byte": size - 1}[where]
    with open(default_gguf_path, "rb") as src:
        (tmp_path / "cut.gguf").write_bytes(src.read(cut))
    with pytest.raises(ModelFormatError, match="truncated or corrupt") as info:
        load_gguf(tmp_path / "cut.gguf")
    assert str(tmp_path / "cut.gguf") in str(info.value)


@pytest.mark.parametrize("block_count", [0xFFFFFFFF, L + 1])
def test_a_block_count_beyond_the_file_is_refused_before_building_layers(tmp_path: Path, block_count: int) -> None:
    """2^32 - 1 blocks hung enumerating the expected shapes of every layer."""
    _write_llama(tmp_path / "t.gguf", keys=lambda w: w.add_block_count(block_count))
    with pytest.raises(ModelFormatError, match=rf"llama.block_count must be at most the {L} layers whose tensors "
                                               rf".*t.gguf holds, got {block_count}"):
        load_gguf(tmp_path / "t.gguf")


def _set_tensor_info(path: Path, name: str, part_index: int, value: int, num_bytes: int) -> None:
    """Overwrite one little-endian field of tensor ``name``'s info in the file: ``part_index`` -1 its data offset
    (uint64, relative to the data section), -2 its type (uint32)."""
    reader = open_gguf(path)
    part = next(t for t in reader.tensors if t.name == name).field.parts[part_index]  # a view of the file
    at = part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
    del reader, part
    data = bytearray(path.read_bytes())
    data[at : at + num_bytes] = value.to_bytes(num_bytes, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [2**64 - 64, 1], ids=["wraps-around", "unaligned"])
def test_a_bad_tensor_offset_is_refused_naming_the_tensor(tmp_path: Path, offset: int) -> None:
    """An offset of 2^64 - 64 read bytes before the data section (NaN logits); an unaligned one was read as is."""
    _write_llama(tmp_path / "t.gguf")
    _set_tensor_info(tmp_path / "t.gguf", "blk.1.ffn_up.weight", -1, offset, 8)
    with pytest.raises(ModelFormatError, match=rf"tensor 'blk.1.ffn_up.weight' has data offset {offset}, which is "
                                               rf"not a multiple of the alignment 32 or runs past the end"):
        load_gguf(tmp_path / "t.gguf")


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_0], ids=lambda q: q.name)
def test_a_tensor_type_that_does_not_match_its_data_is_refused(tmp_path: Path, qtype) -> None:
    """A Q8_0 tensor relabelled F32 read 4x its bytes, into the next tensors' (Q4_0: half of them), and loaded; as
    llama.cpp's gguf_init_from_file, each tensor must start where the one before it ends."""
    _write_llama(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": Q.Q8_0})
    _set_tensor_info(tmp_path / "t.gguf", "blk.0.ffn_up.weight", -2, int(qtype), 4)
    with pytest.raises(ModelFormatError, match=rf"tensor 'blk.0.ffn_down.weight' has data offset \d+, but the tensor "
                                               rf"before it, 'blk.0.ffn_up.weight' \({qtype.name}, shape \[{I}, {C}\]"):
        load_gguf(tmp_path / "t.gguf")


def test_expert_count_without_expert_tensors_is_refused(tmp_path: Path) -> None:
    """llama.expert_count = 4 over a dense file loaded as the dense model."""
    _write_llama(tmp_path / "t.gguf", keys=lambda w: (w.add_expert_count(4), w.add_expert_used_count(2)))
    with pytest.raises(ModelFormatError, match=r"announces 4 experts \(llama.expert_count\) but no layer has a router"):
        load_gguf(tmp_path / "t.gguf")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("rope.freq_base", 0.0, "rope_theta must be a positive number, got 0.0"),
    ("rope.freq_base", math.nan, "rope_theta must be a positive number, got nan"),
    ("attention.layer_norm_rms_epsilon", math.nan, "rms_norm_eps must be a number >= 0, got nan"),
    ("attention.layer_norm_rms_epsilon", -1.0, "rms_norm_eps must be a number >= 0, got -1.0"),
])
def test_values_that_give_nan_logits_are_refused(tmp_path: Path, key: str, value: float, message: str) -> None:
    _write_llama(tmp_path / "t.gguf", keys=lambda w: w.add_float32(f"llama.{key}", value))
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        load_gguf(tmp_path / "t.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    _write_llama(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'"):
        load_gguf(tmp_path / "falcon.gguf")


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.Q8_K], ids=lambda q: q.name)
def test_unsupported_quantization_type(tmp_path: Path, qtype) -> None:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((I, C // block * size), np.uint8)  # [rows, bytes per row]
    _write_llama(tmp_path / "t.gguf", drop=("blk.1.ffn_up.weight",), extra={"blk.1.ffn_up.weight": (raw, qtype)})
    with pytest.raises(UnsupportedQuantizationError) as info:
        load_gguf(tmp_path / "t.gguf")
    assert "'blk.1.ffn_up.weight'" in str(info.value) and f"stored as {qtype.name}" in str(info.value)


def test_unknown_tensor_is_listed(tmp_path: Path) -> None:
    _write_llama(tmp_path / "t.gguf", extra={"blk.0.attn_qkv.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ModelFormatError, match=r"does not know: blk\.0\.attn_qkv\.weight \(F32, \[4, 8\]\)"):
        load_gguf(tmp_path / "t.gguf")


def _llama_cpp_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): Llama 3 rope scaling as per-frequency divisors."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_rope_freqs_are_llama_3_rope_scaling(tmp_path: Path) -> None:
    """A Llama 3.1/3.2 file's rope_freqs.weight (llama.cpp's divisors of each frequency): the frequencies equal
    transformers' llama3 rope scaling, and the model equals ours built with that rope_scaling."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvgen.models import build_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    _write_llama(tmp_path / "t.gguf", extra={"rope_freqs.weight": _llama_cpp_rope_factors(D, 10000.0, scaling)})
    config, state, _ = load_gguf(tmp_path / "t.gguf")
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "freq_factors"
    model = build_model(config, state)
    hf = LlamaConfig(hidden_size=C, num_attention_heads=H, rope_theta=10000.0, rope_scaling=scaling,
                     max_position_embeddings=128)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(model.inv_freq, want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(model.inv_freq, build_model(replace(config, rope_scaling=None), state).inv_freq)
    llama3 = build_model(replace(config, rope_scaling=scaling), load_gguf(tmp_path / "t.gguf")[1])
    ids, positions = torch.tensor([[3, 9, 1, 7, 4, 2]]), torch.tensor([[0, 1, 2, 90, 91, 127]])
    with torch.inference_mode():
        got = model.compute_logits(model(ids, positions))
        ref = llama3.compute_logits(llama3(ids, positions))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    _write_llama(tmp_path / "bad.gguf", extra={"rope_freqs.weight": np.full(D // 2 + 1, 2.0, dtype=np.float32)})
    with pytest.raises(ModelFormatError, match="rope_freqs.weight must hold rotary_dim / 2"):
        load_gguf(tmp_path / "bad.gguf")


def test_missing_tensor_is_listed(tmp_path: Path) -> None:
    _write_llama(tmp_path / "t.gguf", drop=("blk.1.ffn_up.weight", "output_norm.weight"))
    missing = r"missing keys \(2\): model.layers.1.mlp.up_proj.weight, model.norm.weight"
    with pytest.raises(ModelFormatError, match=missing):
        load_gguf(tmp_path / "t.gguf")


def test_wrong_shape_is_listed(tmp_path: Path) -> None:
    _write_llama(tmp_path / "t.gguf", drop=("blk.0.ffn_norm.weight",),
                 extra={"blk.0.ffn_norm.weight": np.ones(C + 1, np.float32)})
    with pytest.raises(ModelFormatError, match=rf"post_attention_layernorm.weight: expected \[{C}\], got \[{C + 1}\]"):
        load_gguf(tmp_path / "t.gguf")


def test_auto_keeps_blocks_and_reencodes_other_types_as_q8_0(tmp_path: Path) -> None:
    """dtype=None (auto): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS/MXFP4 matrices keep their
    bytes (the lattice and ternary types: the test after the 16-bit one), every other type (float) becomes Q8_0, q/k/v
    of three types stack into one
    mixed weight, and the quantized model's logits stay close to the float32 model's."""
    from kvgen.models import build_model
    from kvgen.models.quant_linear import QuantLinear
    from kvgen.weights.quantized import GGUFBlocks

    types = _mixed_types()
    _write_llama(tmp_path / "tiny.gguf", types)
    config, compact, _ = load_gguf(tmp_path / "tiny.gguf", dtype=None)
    config32, dense, _ = load_gguf(tmp_path / "tiny.gguf")
    for g, qtype in types.items():
        blocks = compact[gguf_loader.gguf_to_kvgen_name(g)]
        assert isinstance(blocks, GGUFBlocks)
        own = qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
                        Q.IQ4_XS, Q.MXFP4)
        assert blocks.qtype == (qtype if own else Q.Q8_0), g
    assert not isinstance(compact["model.norm.weight"], GGUFBlocks)
    quant, ref = build_model(config, compact), build_model(config32, dense)
    assert all(isinstance(m, QuantLinear) for m in (quant.model.layers[0].self_attn.qkv_proj, quant.lm_head))
    from kvgen.kernels import MIXED

    assert quant.model.layers[0].self_attn.qkv_proj.weight_type == MIXED  # Q4_K, Q5_K, Q6_K
    ids = torch.arange(1, 9)[None] % V
    with torch.inference_mode():
        got = quant.compute_logits(quant(ids, torch.arange(8)[None]))
        want = ref.compute_logits(ref(ids, torch.arange(8)[None]))
    err = (got - want).abs()
    assert float(err.mean()) < 0.05 * float(want.abs().mean())  # int8 activations on random weights: ~3 %; a wrong
    # repack or permutation gives ~100 %
    assert float(err.max()) < 0.1 * float(want.abs().max())


@pytest.mark.parametrize("exponents,kept", [((104, 143), True), ((100, 120), False)], ids=["in-range", "beyond-fp16"])
def test_auto_keeps_mxfp4_blocks_whose_scales_fit_float16(tmp_path: Path, exponents, kept) -> None:
    """An MXFP4 matrix (gpt-oss's experts) stays MXFP4 blocks on the MXFP4 kernel when every exponent gives a scale
    float16 holds exactly (2^-24 .. 2^15), else it is re-encoded as Q8_0; either way the linear layer computes the
    file's exact values (gguf's dequantization) within int8-activation error."""
    from kvgen.models.quant_linear import QuantLinear
    from kvgen.weights.quantized import GGUFBlocks

    rng = np.random.default_rng(3)
    raw = _random_kquant_bytes(24, 256, Q.MXFP4, rng).reshape(-1, 17)
    raw[:, 0] = rng.integers(exponents[0], exponents[1] + 1, size=raw.shape[0], dtype=np.uint8)
    raw[:2, 0] = exponents  # both ends
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_tensor("t.weight", raw.reshape(24, -1), raw_dtype=Q.MXFP4)
    finish_gguf(writer)
    t = open_gguf(tmp_path / "m.gguf").tensors[0]
    blocks = gguf_loader._compact_tensor(t, None, keep_16bit=False)
    assert isinstance(blocks, GGUFBlocks) and blocks.qtype == (Q.MXFP4 if kept else Q.Q8_0)
    exact = torch.from_numpy(dequantize(t.data, Q.MXFP4).copy())  # [24, 256]
    linear = QuantLinear.from_gguf(blocks.qtype.name, blocks.parts, 256, None)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    want = x @ exact.T
    assert float((linear(x) - want).abs().max()) < 0.03 * float(want.abs().max())


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_auto_runs_a_16_bit_file_on_the_16_bit_kernels(tmp_path: Path, qtype) -> None:
    """dtype=None (auto) on a file of F16 (BF16) matrices: they stay F16 (BF16) blocks (bytes as stored, q/k rows
    unpermuted) and run unquantized on the 16-bit kernels, the logits within float rounding of the float32
    path; an F32 matrix beside them becomes Q8_0."""
    from kvgen.models import build_model
    from kvgen.models.quant_linear import QuantLinear
    from kvgen.weights.quantized import GGUFBlocks

    types = {name: qtype for name, shape in _tiny_shapes().items() if len(shape) == 2}
    originals = _write_llama(tmp_path / "f16.gguf", types)
    config, compact, _ = load_gguf(tmp_path / "f16.gguf", dtype=None)
    q = compact["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, GGUFBlocks) and q.qtype == qtype
    want_q = torch.from_numpy(dequantize(quantize(originals["blk.0.attn_q.weight"], qtype), qtype))
    half = torch.float16 if qtype == Q.F16 else torch.bfloat16
    torch.testing.assert_close(q.parts[0].view(half).float(), want_q, rtol=0, atol=0)
    quant = build_model(config, compact)
    ref = build_model(*load_gguf(tmp_path / "f16.gguf")[:2])
    assert isinstance(quant.model.layers[0].mlp.gate_up_proj, QuantLinear)
    ids = torch.arange(1, 9)[None] % V
    with torch.inference_mode():
        got = quant.compute_logits(quant(ids, torch.arange(8)[None]))
        want = ref.compute_logits(ref(ids, torch.arange(8)[None]))
    # fp16 K/V only: ~0.03 %; int8 activations (the quantized kernels) would give ~1.4 % here
    assert float((got - want).abs().mean()) < 0.002 * float(want.abs().mean())
    _write_llama(tmp_path / "mixed.gguf", types | {"blk.1.ffn_down.weight": Q.F32})
    assert load_gguf(tmp_path / "mixed.gguf", dtype=None)[1]["model.layers.1.mlp.down_proj.weight"].qtype == Q.Q8_0


def test_auto_runs_lattice_and_ternary_types_from_their_own_values(tmp_path: Path) -> None:
    """dtype=None (auto) on a file whose matrices are IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0, IQ2_XS, IQ2_S and
    IQ1_M (the embedding and LM head too; q, k and v of three types, stacked into one mixed weight): each keeps its
    type, no Q8_0 (the kernels run them as IQ4_XS or XS16 records, ``kernels/recode.py``), and the logits are the
    float32 path's (gguf's dequantization of the file) within int8-activation error."""
    from kvgen.kernels import MIXED
    from kvgen.kernels.reference import RECODED_TYPES
    from kvgen.models import build_model
    from kvgen.weights.quantized import GGUFBlocks

    recoded = [Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ1_S, Q.TQ1_0, Q.TQ2_0, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M]
    mats = [n for n, shape in _tiny_shapes().items() if len(shape) == 2]
    types = {name: recoded[i % len(recoded)] for i, name in enumerate(mats)}
    _write_llama(tmp_path / "iq.gguf", types)
    config, compact, _ = load_gguf(tmp_path / "iq.gguf", dtype=None)
    for g, qtype in types.items():
        blocks = compact[gguf_loader.gguf_to_kvgen_name(g)]
        assert isinstance(blocks, GGUFBlocks) and blocks.qtype == qtype, g
    quant, ref = build_model(config, compact), build_model(*load_gguf(tmp_path / "iq.gguf")[:2])
    layer = quant.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_type == MIXED
    assert layer.mlp.down_proj.weight_type == RECODED_TYPES[types["blk.0.ffn_down.weight"].name]
    ids = torch.arange(1, 9)[None] % V
    with torch.inference_mode():
        got = quant.compute_logits(quant(ids, torch.arange(8)[None]))
        want = ref.compute_logits(ref(ids, torch.arange(8)[None]))
    err = (got - want).abs()  # int8 activations on random weights: a few %; a wrong code or table gives ~100 %
    assert float(err.mean()) < 0.05 * float(want.abs().mean())
    assert float(err.max()) < 0.1 * float(want.abs().max())


# --- phi3 (llama.cpp's Phi3MiniModel: stacked attn_qkv, gate and up in one ffn_up, LongRoPE factor tensors) ---------

_PHI3_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_PHI3_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def test_yarn_rope_scaling_keys_load_as_transformers_yarn(tmp_path: Path) -> None:
    """A file with llama.cpp's yarn keys (rope.scaling.type, factor 4, original_context_length 32 of 128 positions, as
    its converter writes them for such a config.json): the model's frequencies and cos/sin scale equal transformers'
    for that config.json, and its logits are not those of the same file without the keys."""
    from gguf import RopeScalingType
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvgen.models import build_model

    def yarn(w: GGUFWriter) -> None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)

    _write_llama(tmp_path / "t.gguf", keys=yarn)
    config, state, _ = load_gguf(tmp_path / "t.gguf")
    model = build_model(config, state)
    hf = LlamaConfig(hidden_size=C, num_attention_heads=H, rope_theta=10000.0, max_position_embeddings=128,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(model.inv_freq, want, rtol=0, atol=0)
    assert model.rope_attention_factor == pytest.approx(want_scale, rel=1e-15) and want_scale > 1.1
    plain = build_model(replace(config, rope_scaling=None), load_gguf(tmp_path / "t.gguf")[1])
    ids, positions = torch.tensor([[3, 9, 1, 7, 4, 2]]), torch.tensor([[0, 1, 2, 90, 91, 127]])
    with torch.inference_mode():
        got = model.compute_logits(model(ids, positions))
        unscaled = plain.compute_logits(plain(ids, positions))
    assert float((got - unscaled).abs().max()) > 0.01 * float(unscaled.abs().max())


def _phi3_ref(longrope: bool, std: float = 0.3, partial_rotary_factor: float = 1.0):
    """transformers' Phi3ForCausalLM (hidden 64, 4 heads of 16, 2 KV heads, I = 128): 128 positions, of which 32
    original ones with LongRoPE (Phi-3-mini-128k's shape), else a sliding window of 48 (Phi-3-mini-4k's); with
    ``partial_rotary_factor`` < 1 (Phi-4-mini's shape) only that share of each head rotated.
    Weights N(0, std²): 0.3 makes every mix-up show in the logits, 0.1 keeps int8 activations' noise small."""
    from helpers import make_tiny_model

    partial = {} if partial_rotary_factor == 1.0 else {"partial_rotary_factor": partial_rotary_factor}
    if not longrope:
        return make_tiny_model("phi3", kv_heads=2, sliding_window=48, std=std, seed=5, **partial).ref
    g, num_freqs = torch.Generator().manual_seed(2), int(8 * partial_rotary_factor)
    scaling = {"type": "longrope", "short_factor": (1 + torch.rand(num_freqs, generator=g)).tolist(),
               "long_factor": (1 + 8 * torch.rand(num_freqs, generator=g)).tolist()}
    return make_tiny_model("phi3", kv_heads=2, original_max_position_embeddings=32, rope_scaling=scaling,
                           sliding_window=256, std=std, seed=5, **partial).ref


def _gguf_name(hf_name: str) -> str:
    if hf_name in _PHI3_GLOBAL:
        return _PHI3_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_PHI3_NAMES[rest]}"


def _write_phi3(path: Path, ref, types: dict[str, GGMLQuantizationType] | None = None,
                swap_gate_up: bool = False) -> None:
    """Write ``ref`` (a Phi3ForCausalLM) as llama.cpp's converter does: its tensors stacked as they are (q/k rows
    unpermuted: NEOX rope), phi3.* metadata, and for LongRoPE the factor tensors and rope.scaling.attn_factor.
    ``types``: storage type per GGUF name (default F32); ``swap_gate_up``: up rows first (a broken file)."""
    cfg, rng = ref.config, np.random.default_rng(0)
    w = GGUFWriter(str(path), "phi3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(int(cfg.hidden_size // cfg.num_attention_heads * cfg.partial_rotary_factor))
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_sliding_window(cfg.sliding_window or 0)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, p in ref.state_dict().items():
        x = p.detach().numpy().astype(np.float32)
        if swap_gate_up and name.endswith("gate_up_proj.weight"):
            x = np.concatenate(np.split(x, 2)[::-1])
        _add(w, _gguf_name(name), x, (types or {}).get(_gguf_name(name), Q.F32), rng)
    if cfg.rope_scaling:
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
        w.add_tensor("rope_factors_long.weight", np.array(cfg.rope_scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(cfg.rope_scaling["short_factor"], np.float32))
    finish_gguf(w)


@pytest.mark.parametrize(("longrope", "partial"), [(False, 1.0), (True, 1.0), (True, 0.5)],
                         ids=["4k", "128k", "phi4-mini"])
def test_phi3_file_matches_transformers(tmp_path: Path, longrope: bool, partial: float) -> None:
    """A phi3 file of F32 tensors: attn_qkv and ffn_up load as our stacked qkv_proj / gate_up_proj (bit for bit),
    the context ends at the sliding window (4k) or the original length (128k: LongRoPE from the factor tensors and
    attn_factor; Phi-4-mini's shape: rope.dimension_count half the head, 4 factors of each kind), and the logits of
    30 tokens equal transformers'; a file with up before gate does not."""
    from kvgen.models import build_model

    ref = _phi3_ref(longrope, partial_rotary_factor=partial)
    _write_phi3(tmp_path / "phi3.gguf", ref)
    config, state, _ = load_gguf(tmp_path / "phi3.gguf")
    assert config.max_position_embeddings == (32 if longrope else 48) and config.rotary_dim == int(16 * partial)
    for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        _assert_equal(state[name], ref.state_dict()[name], name)
    if longrope:
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["attention_factor"] == pytest.approx(ref.model.rotary_emb.attention_scaling)
    else:
        assert config.rope_scaling is None
    ids = torch.arange(3, 33)[None] % config.vocab_size  # [1, 30]
    with torch.inference_mode():
        want = ref(ids).logits
    torch.testing.assert_close(model_logits(build_model(config, state), ids), want, rtol=1e-5, atol=1e-5)
    _write_phi3(tmp_path / "swapped.gguf", ref, swap_gate_up=True)
    swapped = model_logits(build_model(*load_gguf(tmp_path / "swapped.gguf")[:2]), ids)
    assert float((swapped - want).abs().max()) > 0.1 * float(want.abs().max())


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["phi3", "phi4-mini"])
def test_phi3_quantized_file_runs_on_the_kernels(tmp_path: Path, partial: float) -> None:
    """A phi3 file of Q8_0 / Q4_0 matrices on the default path (dtype auto): the stacked matrices keep their blocks
    and run through the kernels, whose RoPE tables carry LongRoPE's cos/sin scale (and, Phi-4-mini's shape, rotate
    half of each head): the logits stay as close to the float32 path on the same file as the other architectures'
    do, and without the scale they do not."""
    from kvgen.models import build_model
    from kvgen.models.quant_linear import QuantLinear
    from kvgen.weights.quantized import GGUFBlocks

    ref = _phi3_ref(longrope=True, std=0.1, partial_rotary_factor=partial)
    types = {_gguf_name(n): Q.Q4_0 if "mlp." in n else Q.Q8_0 for n, p in ref.state_dict().items() if p.dim() == 2}
    _write_phi3(tmp_path / "q.gguf", ref, types)
    config, compact, _ = load_gguf(tmp_path / "q.gguf", dtype=None)
    blocks = compact["model.layers.0.mlp.gate_up_proj.weight"]
    assert isinstance(blocks, GGUFBlocks) and blocks.qtype == Q.Q4_0 and blocks.shape == (256, 64)
    quantized = build_model(config, compact)
    layer = quantized.model.layers[0]
    assert quantized.kernels is not None
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    reference = build_model(*load_gguf(tmp_path / "q.gguf")[:2])
    unscaled_config, unscaled_state, _ = load_gguf(tmp_path / "q.gguf", dtype=None)
    assert unscaled_config.rope_scaling is not None
    no_scale = unscaled_config.rope_scaling | {"attention_factor": 1.0}
    unscaled = build_model(replace(unscaled_config, rope_scaling=no_scale), unscaled_state)
    ids = torch.arange(3, 33)[None] % config.vocab_size  # [1, 30]
    want, got = model_logits(reference, ids), model_logits(quantized, ids)
    tol = 0.05 * float(want.abs().max())  # int8 activations: ~3 % here; the qwen2 / qwen3 files' bound
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    assert float((model_logits(unscaled, ids) - want).abs().max()) > 4 * tol  # measured: ~10x tol


def test_smollm3_files_load_as_llama_files_with_nope_flags(tmp_path: Path) -> None:
    """A ``smollm3`` file holds llama's tensors, q/k rows permuted as llama.cpp's converter writes them (its
    SmolLM3Model is a LlamaModel): the same weights as the ``llama`` file of the same tensors, and the NoPE flags
    of llama.cpp's fixed step of 4 (two layers here: both rotate)."""
    from kvgen.models import build_model

    _write_llama(tmp_path / "s.gguf", arch="smollm3")
    _write_llama(tmp_path / "l.gguf")
    config, state, _ = load_gguf(tmp_path / "s.gguf")
    llama_config, llama_state, _ = load_gguf(tmp_path / "l.gguf")
    assert config.no_rope_layers == [1, 1] and llama_config.no_rope_layers is None
    assert state.keys() == llama_state.keys() and all(torch.equal(state[k], llama_state[k]) for k in state)
    model = build_model(config, state)
    assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, True]


def test_kernel_bytes_stay_views_of_the_file_until_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype=None: a Q8_0 / Q6_K matrix that needs no change is a view of the mapped file (no copy), its pages
    released once ``build_model`` has packed it; a row-permuted one (llama q/k) is a copy,
    released at load. Every tensor is released once, and the packed model computes the float32 model's logits."""
    from kvgen.models import build_model
    from kvgen.weights.quantized import GGUFBlocks

    types = {name: Q.Q8_0 for name, shape in _tiny_shapes().items() if len(shape) == 2}
    types["blk.0.ffn_down.weight"], types["blk.1.ffn_up.weight"], types["blk.1.ffn_gate.weight"] = Q.Q6_K, Q.IQ4_XS, Q.Q4_K
    _write_llama(tmp_path / "v.gguf", types)
    released: list[str] = []
    original = gguf_loader._release_pages
    monkeypatch.setattr(gguf_loader, "_release_pages", lambda reader, t: released.append(t.name) or original(reader, t))
    config, compact, _ = load_gguf(tmp_path / "v.gguf", dtype=None)
    views = {name for name, b in compact.items() if isinstance(b, GGUFBlocks) and b.release}
    assert "model.layers.0.mlp.down_proj.weight" in views and "model.layers.0.self_attn.v_proj.weight" in views
    assert {"model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_proj.weight"} <= views  # IQ4_XS, Q4_K
    assert not {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"} & views
    assert not {"blk.0.ffn_down.weight", "blk.1.ffn_up.weight"} & set(released) and "blk.0.attn_q.weight" in released
    quant = build_model(config, compact)
    assert sorted(released) == sorted(_tiny_shapes())  # each once
    ref = build_model(*load_gguf(tmp_path / "v.gguf")[:2])
    ids = torch.arange(1, 9)[None] % V
    with torch.inference_mode():
        got = quant.compute_logits(quant(ids, torch.arange(8)[None]))
        want = ref.compute_logits(ref(ids, torch.arange(8)[None]))
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())


@pytest.mark.parametrize("stored", [Q.F32, Q.F16], ids=lambda q: q.name)
def test_quantization_encodes_a_float_file_and_keeps_a_quantized_one(tmp_path: Path, stored) -> None:
    """quantization=Q4_0 on a file of float matrices: each is the gguf package's Q4_0 encoding of the file's values
    (q/k rows un-permuted first), the embedding and output matrices Q8_0; on a quantized file (Q5_1 beside one F32
    matrix) the quantized matrices stay as stored and only the float one is encoded; the model runs them."""
    from kvgen.models import build_model
    from kvgen.weights.quantized import GGUFBlocks

    types = {name: stored for name, shape in _tiny_shapes().items() if len(shape) == 2}
    originals = _write_llama(tmp_path / "float.gguf", types)
    config, state, _ = load_gguf(tmp_path / "float.gguf", dtype=None, quantization=Q.Q4_0)
    for gguf_name, ours, qtype in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", Q.Q4_0),
                                   ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight", Q.Q4_0),
                                   ("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0),
                                   ("output.weight", "lm_head.weight", Q.Q8_0)):
        values = originals[gguf_name].astype(np.float16).astype(np.float32) if stored == Q.F16 else originals[gguf_name]
        got = state[ours]
        assert isinstance(got, GGUFBlocks) and got.qtype == qtype, ours
        assert np.array_equal(got.parts[0].numpy(), quantize(values, qtype)), ours
    ids = torch.arange(1, 9)[None] % V
    quant, ref = build_model(config, state), build_model(*load_gguf(tmp_path / "float.gguf")[:2])
    with torch.inference_mode():
        got_logits = quant.compute_logits(quant(ids, torch.arange(8)[None]))
        want_logits = ref.compute_logits(ref(ids, torch.arange(8)[None]))
    assert float((got_logits - want_logits).abs().mean()) < 0.3 * float(want_logits.abs().mean())
    _write_llama(tmp_path / "q5.gguf", {**dict.fromkeys(types, Q.Q5_1), "blk.1.ffn_down.weight": Q.F32})
    _, kept, _ = load_gguf(tmp_path / "q5.gguf", dtype=None, quantization=Q.Q8_0)
    assert kept["model.layers.0.mlp.up_proj.weight"].qtype == Q.Q5_1
    assert kept["model.layers.1.mlp.down_proj.weight"].qtype == Q.Q8_0
    with pytest.raises(ValueError, match="needs dtype 'auto'"):
        load_gguf(tmp_path / "q5.gguf", dtype=torch.float32, quantization=Q.Q8_0)
