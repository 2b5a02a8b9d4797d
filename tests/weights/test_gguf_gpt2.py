"""GGUF files of llama.cpp's ``gpt2`` architecture, written here as its converter writes them (convert_hf_to_gguf
``GPT2Model``: Conv1D matrices transposed to [out, in], ``output.weight`` a copy of ``token_embd``), from transformers'
tiny GPT-2, whose logits and greedy tokens are the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers import add_gguf_matrix, finish_gguf, hf_greedy, make_tiny_model

from kvgen.errors import ModelFormatError
from kvgen.generation import GenerationConfig, generate
from kvgen.models import build_model
from kvgen.models.quant_linear import QuantEmbedding, QuantLinear
from kvgen.weights.gguf_loader import load_gguf
from kvgen.weights.quantized import GGUFBlocks

Q = GGMLQuantizationType
_GLOBAL = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
           "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias"}
_BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
          "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    return make_tiny_model("gpt2", vocab_size=128, max_position_embeddings=64).ref


def _write(path: Path, ref: torch.nn.Module, qtype: GGMLQuantizationType = Q.F32, skip_key: str = "") -> Path:
    """``ref`` as a ``gpt2`` GGUF: matrices but the position table as ``qtype``, vectors F32; ``output.weight`` is
    ``ref``'s own head (the embedding's copy when tied)."""
    cfg = ref.config
    w = GGUFWriter(str(path), "gpt2")
    keys = {"block_count": cfg.n_layer, "context_length": cfg.n_positions, "embedding_length": cfg.n_embd,
            "feed_forward_length": 4 * cfg.n_embd, "head_count": cfg.n_head, "layer_norm_eps": cfg.layer_norm_epsilon,
            "vocab_size": cfg.vocab_size}
    for key, value in keys.items():
        if key != skip_key:
            getattr(w, f"add_{key}")(value)
    for name, value in ref.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        x = value.float().numpy()
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            x = np.ascontiguousarray(x.T)  # Conv1D [in, out] -> [out, in]
        parts = name.split(".")
        gguf_name = _GLOBAL.get(name) or f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"
        add_gguf_matrix(w, gguf_name, x, Q.F32 if gguf_name == "position_embd.weight" else qtype)
    add_gguf_matrix(w, "output.weight", ref.lm_head.weight.detach().float().numpy(), qtype)
    finish_gguf(w)
    return path


def test_a_float_gpt2_file_gives_transformers_logits_and_tokens(gpt2, tmp_path: Path) -> None:
    """An F32 file loads as transformers' GPT-2: logits within float rounding, the same greedy tokens (the file's
    output.weight, the embedding's copy, is left out: the head is tied)."""
    config, state, _ = load_gguf(_write(tmp_path / "gpt2.gguf", gpt2), dtype=torch.float32)
    assert config.model_type == "gpt2" and config.tie_word_embeddings and "lm_head.weight" not in state
    model = build_model(config, state).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(12)[None].expand(2, -1)))
        want = gpt2(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    prompt = [5, 17, 99, 3]
    out = generate(model, torch.tensor([prompt]), None, GenerationConfig(max_new_tokens=10, do_sample=False,
                                                                         eos_token_id=[], pad_token_id=0))
    assert out.new_token_ids[0] == hf_greedy(gpt2, prompt, 10)[:10]


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_an_untied_gpt2_files_own_output_weight_is_its_head(qtype, tmp_path: Path) -> None:
    """A file whose output.weight is not the embedding's copy (an untied checkpoint's) loads it as ``lm_head``, as
    llama.cpp reads it: transformers' logits (F32: float rounding; Q8_0: its error) and greedy tokens."""
    ref = make_tiny_model("gpt2", tie=False, vocab_size=128, max_position_embeddings=64).ref
    assert not torch.equal(ref.lm_head.weight, ref.transformer.wte.weight)
    config, state, _ = load_gguf(_write(tmp_path / "untied.gguf", ref, qtype), dtype=None)
    assert not config.tie_word_embeddings and "lm_head.weight" in state
    model = build_model(config, state).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got, want = model.compute_logits(model(ids, torch.arange(12)[None])), ref(ids).logits
    if qtype == Q.F32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        prompt = [5, 17, 99, 3]
        out = generate(model, torch.tensor([prompt]), None, GenerationConfig(max_new_tokens=10, do_sample=False,
                                                                             eos_token_id=[], pad_token_id=0))
        assert out.new_token_ids[0] == hf_greedy(ref, prompt, 10)[:10]
    else:
        assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())


def test_a_quantized_gpt2_file_runs_on_the_kernels(gpt2, tmp_path: Path) -> None:
    """A Q8_0 file under auto: its matrices on the kernels as stored, the position table dense (F32), the logits
    within Q8_0's error of transformers'; quantization=q4_0 on the F32 file encodes its matrices, the embedding
    (the head) as Q8_0."""
    model = build_model(*load_gguf(_write(tmp_path / "q8.gguf", gpt2, Q.Q8_0), dtype=None)[:2]).eval()
    tr = model.transformer
    assert isinstance(tr.wte, QuantEmbedding) and isinstance(tr.h[0].attn.c_attn, QuantLinear)
    assert isinstance(tr.wpe.weight, torch.Tensor) and tr.wpe.weight.dtype == torch.float32
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(12)[None]))
        want = gpt2(ids).logits
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())
    _, state, _ = load_gguf(_write(tmp_path / "f32.gguf", gpt2), dtype=None, quantization=Q.Q4_0)
    fc = state["transformer.h.1.mlp.c_fc.weight"]
    assert isinstance(fc, GGUFBlocks) and fc.qtype == Q.Q4_0
    assert state["transformer.wte.weight"].qtype == Q.Q8_0
    assert isinstance(state["transformer.wpe.weight"], torch.Tensor)


def test_a_gpt2_file_without_its_layer_norm_eps_is_refused(gpt2, tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="gpt2.attention.layer_norm_epsilon"):
        load_gguf(_write(tmp_path / "bad.gguf", gpt2, skip_key="layer_norm_eps"))
