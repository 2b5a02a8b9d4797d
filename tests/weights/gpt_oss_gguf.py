"""gpt-oss GGUF files as llama.cpp's converter writes them (``convert_hf_to_gguf.py`` ``GptOssModel``, architecture
``gpt-oss``) from a tiny transformers ``GptOssForCausalLM``, for the gpt-oss GGUF tests (``from weights.gpt_oss_gguf
import ...``).

Tensors: llama.cpp's names, q/k rows as Hugging Face's (no permutation), ``attn_sinks.weight`` [H], the router
``ffn_gate_inp`` (weight and bias, F32), ``post_attention_norm`` (the norm before the experts), and the experts'
stacks de-interleaved from transformers' ``gate_up_proj`` [E, C, 2I] (gate = ``[..., ::2]``, up = ``[..., 1::2]``),
transposed to ``[E, rows, cols]``: ``ffn_{gate,up,down}_exps.weight`` and their ``.bias`` stacks [E, rows].
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from helpers import finish_gguf

Q = GGMLQuantizationType
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gpt_oss_tensors(ref: torch.nn.Module) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (torch order) of every tensor llama.cpp's converter writes for ``ref``."""
    out: dict[str, np.ndarray] = {}
    for name, p in ref.state_dict().items():
        x = p.detach().float()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = x.numpy()
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "self_attn.sinks":
            out[blk + "attn_sinks.weight"] = x.numpy()
        elif rest == "mlp.experts.gate_up_proj":  # [E, C, 2I] -> gate, up [E, I, C]
            w = x.transpose(-1, -2)
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = w[:, ::2].numpy(), w[:, 1::2].numpy()
        elif rest == "mlp.experts.gate_up_proj_bias":  # [E, 2I] -> [E, I] each
            out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = x[:, ::2].numpy(), x[:, 1::2].numpy()
        elif rest == "mlp.experts.down_proj":  # [E, I, C] -> [E, C, I]
            out[blk + "ffn_down_exps.weight"] = x.transpose(-1, -2).numpy()
        elif rest == "mlp.experts.down_proj_bias":
            out[blk + "ffn_down_exps.bias"] = x.numpy()
        else:
            module, kind = rest.rsplit(".", 1)
            out[f"{blk}{_BLOCK[module]}.{kind}"] = x.numpy()
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_gpt_oss_gguf(path: Path, ref: torch.nn.Module, expert_qtype: GGMLQuantizationType = Q.F32,
                       qtype: GGMLQuantizationType = Q.F32, *, meta: dict[str, object] | None = None,
                       drop: tuple[str, ...] = (), add_keys: Callable[[GGUFWriter], None] | None = None,
                       tokens: list[str] | None = None, fuse_gate_up: bool = False) -> None:
    """``ref`` as a ``gpt-oss`` GGUF file: the converter's keys (``meta`` entries replace them by full key; a value
    None leaves the key out), then ``add_keys(writer)``, a token list ``t0 ..`` (or ``tokens``), the expert weight
    stacks as ``expert_qtype`` and the other matrices (not the router) as ``qtype`` (quantized by the gguf package),
    vectors, bias stacks and the router F32; tensors in ``drop`` left out; with ``fuse_gate_up`` each layer's gate
    and up stacks as one ``ffn_gate_up_exps`` (gate rows, then up: the converter's ``--fuse-gate-up-exps``)."""
    cfg = ref.config
    scaling = cfg.rope_scaling
    keys: dict[str, object] = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.freq_base": float(cfg.rope_theta), "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.intermediate_size, "attention.sliding_window": cfg.sliding_window,
        "rope.scaling.type": "yarn", "rope.scaling.factor": float(scaling["factor"]),
        "rope.scaling.original_context_length": scaling["original_max_position_embeddings"],
    }
    keys = {f"gpt-oss.{k}": v for k, v in keys.items()} | (meta or {})
    w = GGUFWriter(str(path), "gpt-oss")
    for key, value in keys.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    if add_keys is not None:
        add_keys(w)
    w.add_token_list(tokens or [f"t{i}" for i in range(cfg.vocab_size)])
    tensors = gpt_oss_tensors(ref)
    for name in [n for n in tensors if fuse_gate_up and ".ffn_gate_exps." in n]:
        up = tensors.pop(name.replace("_gate_", "_up_"))
        tensors[name.replace("_gate_", "_gate_up_")] = np.concatenate([tensors.pop(name), up], axis=1)
    for name, x in tensors.items():
        if name in drop:
            continue
        kind = expert_qtype if name.endswith("_exps.weight") else qtype
        if kind != Q.F32 and x.ndim >= 2 and name.endswith(".weight") and not name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, quantize(x, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, x.astype(np.float32))
    finish_gguf(w)
