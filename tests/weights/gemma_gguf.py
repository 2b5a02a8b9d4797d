"""Gemma 2 and Gemma 3 GGUF files as llama.cpp's converters write them, from a tiny random transformers model, for
the GGUF tests (``from weights.gemma_gguf import ...``: ``tests`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers import add_gguf_matrix, finish_gguf, gguf_writer_for

Q = GGMLQuantizationType
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # q/k norms: Gemma 3's
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a transformers Gemma parameter (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def write_gemma_gguf(path: Path, ref: torch.nn.Module, arch: str, qtype: GGMLQuantizationType = Q.F32,
                     add_keys: Callable[[GGUFWriter], None] | None = None) -> None:
    """``ref`` (a float32 transformers Gemma2/Gemma3ForCausalLM) as llama.cpp's converter for ``arch`` writes it.

    Keys: the shapes, the RMS norm eps, ``add_keys(writer)`` (the architecture's own), the sliding window and a
    token list ``t0 .. t{V-1}``. Tensors: every ``*norm.weight`` stored as 1 + w (float32), 2-D ones [rows, cols] as
    ``qtype`` (1-D ones stay F32), no output.weight when the embeddings are tied.
    """
    cfg = ref.config
    w = gguf_writer_for(path, arch, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if add_keys is not None:
        add_keys(w)
    w.add_sliding_window(cfg.sliding_window)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for name, p in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:  # the converter writes no output.weight
            continue
        x = p.detach().numpy().astype(np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
        add_gguf_matrix(w, gguf_name(name), x, qtype)
    finish_gguf(w)


def copy_file_weights(ref: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a loaded file's (dequantized, float32) weights ``state`` into ``ref`` in place, the norms (stored as
    1 + w) back to w."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(state[name] - (1.0 if name.endswith("norm.weight") else 0.0))
