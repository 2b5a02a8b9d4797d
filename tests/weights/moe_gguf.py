"""Mixture-of-experts GGUF files as llama.cpp's converter writes them, from a tiny random transformers model, for the
MoE tests (``from weights.moe_gguf import ...``: ``tests`` is on pytest's ``pythonpath``).

``convert_hf_to_gguf.py``: ``Qwen3MoeModel`` / ``Qwen2MoeModel`` (architectures ``qwen3moe`` / ``qwen2moe``: q/k rows
as Hugging Face's) and ``LlamaModel`` for Mixtral (``llama`` with ``expert_count``; q/k rows permuted). Each sparse
layer's experts are stacked into ``ffn_{gate,up,down}_exps`` [E, rows, cols] (or, ``stacked=False``, written one
tensor per expert as older Mixtral files are: ``ffn_gate.E``); the router ``ffn_gate_inp`` stays F32 (the converter's
rule for FFN_GATE_INP), Qwen2-MoE's ``ffn_gate_inp_shexp`` is squeezed to [C].
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from helpers import finish_gguf, gguf_writer_for, llama_cpp_permute

Q = GGMLQuantizationType
_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# an expert's matrix: transformers' name (Qwen-MoE or Mixtral) -> (layer, expert, llama.cpp's gate / up / down)
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_KIND = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def _tensors(ref: torch.nn.Module, model_type: str, stacked: bool) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (torch order) of every tensor the converter writes, q/k rows permuted for llama."""
    cfg = ref.config
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, p in ref.state_dict().items():
        x = p.detach().float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:  # no output.weight
            continue
        m = _EXPERT_RE.fullmatch(name)
        if m is not None:
            layer, expert, kind = int(m.group(1)), int(m.group(2)), _KIND[m.group(3)]
            experts.setdefault((layer, kind), {})[expert] = x
            continue
        g = _gguf_name(name)
        if model_type == "mixtral" and (".attn_q." in g or ".attn_k." in g):
            x = llama_cpp_permute(x, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        out[g] = x.reshape(-1) if g.endswith("ffn_gate_inp_shexp.weight") else x  # squeezed [1, C] -> [C]
    for (layer, kind), by_expert in experts.items():
        if stacked:
            out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
        else:
            out |= {f"blk.{layer}.ffn_{kind}.{e}.weight": x for e, x in by_expert.items()}
    return out


def write_moe_gguf(path: Path, ref: torch.nn.Module, model_type: str, qtype: GGMLQuantizationType = Q.F32, *,
                   stacked: bool = True, add_keys: Callable[[GGUFWriter], None] | None = None,
                   drop: tuple[str, ...] = (), raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
                   expert_count: int | None = None, tokens: list[str] | None = None) -> None:
    """``ref`` (a float32 transformers ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` or ``MixtralForCausalLM``)
    as llama.cpp's converter writes it: its architecture's keys (``expert_count``, ``expert_used_count``, the
    qwen ones' ``expert_feed_forward_length`` and qwen2moe's ``expert_shared_feed_forward_length``), then
    ``add_keys(writer)``, a token list ``t0 .. t{V-1}`` (or ``tokens``); matrices (expert stacks included) as
    ``qtype``, vectors and the router ``ffn_gate_inp`` as F32; tensors in ``drop`` left out, those in ``raw``
    written as the given blocks and type instead; ``expert_count`` written in place of the model's."""
    cfg = ref.config
    w = gguf_writer_for(path, _ARCH[model_type], cfg)
    w.add_rope_freq_base(cfg.rope_theta)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_expert_count(expert_count or (cfg.num_local_experts if model_type == "mixtral" else cfg.num_experts))
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if model_type != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if add_keys is not None:
        add_keys(w)
    w.add_token_list(tokens or [f"t{i}" for i in range(cfg.vocab_size)])
    raws = raw or {}
    for name, x in _tensors(ref, model_type, stacked).items():
        if name in drop:
            continue
        if name in raws:
            w.add_tensor(name, raws[name][0], raw_dtype=raws[name][1])
        elif x.ndim == 1 or name.endswith("ffn_gate_inp.weight") or qtype == Q.F32:
            w.add_tensor(name, x.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    finish_gguf(w)


def copy_file_weights(ref: torch.nn.Module, state: dict[str, torch.Tensor], model_type: str) -> None:
    """Copy a loaded file's (dequantized, float32, kvgen-named) weights ``state`` into transformers' ``ref`` in place,
    so the reference runs the file's rounded weights."""
    from helpers import mixtral_to_qwen_names

    with torch.no_grad():
        for name, p in ref.named_parameters():
            ours = mixtral_to_qwen_names(name) if model_type == "mixtral" else name
            p.copy_(state[ours].view(p.shape))
