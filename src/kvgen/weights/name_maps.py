"""Parameter names and shapes per architecture, and checkpoint-name maps.

Our models keep Hugging Face checkpoint names (``model.layers.0.self_attn.q_proj.weight``,
``transformer.h.0.attn.c_attn.weight``), with every matrix stored like
``nn.Linear``: ``[out_features, in_features]``. This module says which names and
shapes a config expects (:func:`expected_param_shapes`) and how names in a
GGUF file (:func:`gguf_to_kvgen_name`) or an HF checkpoint
(:func:`hf_to_kvgen_name`) map onto them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError

Shapes = dict[str, tuple[int, ...]]

# Checkpoints that store q/k/v and gate/up already stacked as our model does (``qkv_proj`` rows q, k, v;
# ``gate_up_proj`` rows gate, then up), by HF model_type or GGUF architecture: Phi-3 (transformers
# ``Phi3Attention`` / ``Phi3MLP``; llama.cpp's ``attn_qkv`` and a [2I, C] ``ffn_up``).
_STACKED_CHECKPOINTS = frozenset({"phi3"})


def has_stacked_projections(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s checkpoint holds ``qkv_proj`` / ``gate_up_proj`` instead of their parts (Phi-3)."""
    return bool({cfg.extra.get("hf_model_type"), cfg.extra.get("gguf_architecture")} & _STACKED_CHECKPOINTS)


def _llama_shapes(cfg: ModelConfig) -> Shapes:
    c, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out = cfg.num_attention_heads * cfg.head_dim  # H*D
    kv_out = cfg.num_key_value_heads * cfg.head_dim  # Hkv*D
    shapes: Shapes = {"model.embed_tokens.weight": (v, c), "model.norm.weight": (c,)}
    if has_stacked_projections(cfg):
        linears = {"self_attn.qkv_proj": ((q_out + 2 * kv_out, c), cfg.attention_bias),
                   "mlp.gate_up_proj": ((2 * i, c), cfg.mlp_bias)}
    else:
        linears = {
            "self_attn.q_proj": ((q_out, c), cfg.attention_bias),
            "self_attn.k_proj": ((kv_out, c), cfg.attention_bias),
            "self_attn.v_proj": ((kv_out, c), cfg.attention_bias),
            "mlp.gate_proj": ((i, c), cfg.mlp_bias),
            "mlp.up_proj": ((i, c), cfg.mlp_bias),
        }
    linears |= {
        "self_attn.o_proj": ((c, q_out), cfg.attention_bias if cfg.o_proj_bias is None else cfg.o_proj_bias),
        "mlp.down_proj": ((c, i), cfg.mlp_bias),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (c,)
        shapes[p + "post_attention_layernorm.weight"] = (c,)
        if cfg.use_qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        is_sparse = cfg.is_sparse_layer(layer)
        for name, (shape, has_bias) in linears.items():
            if is_sparse and name.startswith("mlp."):
                continue
            shapes[f"{p}{name}.weight"] = shape
            if has_bias:
                shapes[f"{p}{name}.bias"] = (shape[0],)
        if is_sparse:
            shapes |= _moe_shapes(cfg, p + "mlp.")
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, c)
    return shapes


def _moe_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
    """A sparse layer's parameters (``models.moe.SparseMoeBlock``, transformers' Qwen-MoE names): the router
    ``gate`` [E, C], each expert's gate/up [I_moe, C] and down [C, I_moe], and where ``shared_expert_intermediate_size``
    is set the shared expert's and its ``shared_expert_gate`` [1, C]."""
    c, i = cfg.hidden_size, cfg.moe_intermediate_size
    shapes: Shapes = {prefix + "gate.weight": (cfg.num_experts, c)}
    experts = [(f"experts.{e}.", i) for e in range(cfg.num_experts)]
    if cfg.shared_expert_intermediate_size:
        experts.append(("shared_expert.", cfg.shared_expert_intermediate_size))
        shapes[prefix + "shared_expert_gate.weight"] = (1, c)
    for name, size in experts:
        shapes |= {f"{prefix}{name}gate_proj.weight": (size, c), f"{prefix}{name}up_proj.weight": (size, c),
                   f"{prefix}{name}down_proj.weight": (c, size)}
    return shapes


def _gpt_oss_shapes(cfg: ModelConfig) -> Shapes:
    """Llama's attention and norms with biases, each layer's ``self_attn.sinks`` [H] and its
    ``models.moe.GptOssMoeBlock``: ``router`` [E, C] + [E], experts' ``gate_proj`` and ``up_proj`` [I, C] + [I]
    (stacked into ``gate_up_proj`` by the model) and ``down_proj`` [C, I] + [C]."""
    c, i = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {k: v for k, v in _llama_shapes(cfg).items() if ".mlp." not in k}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.sinks": (cfg.num_attention_heads,), p + "mlp.router.weight": (cfg.num_experts, c),
                   p + "mlp.router.bias": (cfg.num_experts,)}
        for e in range(cfg.num_experts):
            x = f"{p}mlp.experts.{e}."
            shapes |= {x + "gate_proj.weight": (i, c), x + "gate_proj.bias": (i,), x + "up_proj.weight": (i, c),
                       x + "up_proj.bias": (i,), x + "down_proj.weight": (c, i), x + "down_proj.bias": (c,)}
    return shapes


def is_router_weight(name: str) -> bool:
    """Whether our parameter ``name`` is a mixture of experts' router (``mlp.gate``, ``mlp.shared_expert_gate``,
    gpt-oss's ``mlp.router``):
    kept dense (float32 on the kernel path) whatever the file stores, as llama.cpp computes them (its converter
    writes ``ffn_gate_inp`` as F32 and llama-quantize leaves it so)."""
    return name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight", ".mlp.router.weight"))


def _gpt2_shapes(cfg: ModelConfig) -> Shapes:
    c, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: Shapes = {
        "transformer.wte.weight": (v, c),
        "transformer.wpe.weight": (cfg.max_position_embeddings, c),
        "transformer.ln_f.weight": (c,),
        "transformer.ln_f.bias": (c,),
    }
    per_layer: Shapes = {
        "ln_1.weight": (c,),
        "ln_1.bias": (c,),
        "attn.c_attn.weight": (3 * c, c),
        "attn.c_attn.bias": (3 * c,),
        "attn.c_proj.weight": (c, c),
        "attn.c_proj.bias": (c,),
        "ln_2.weight": (c,),
        "ln_2.bias": (c,),
        "mlp.c_fc.weight": (i, c),
        "mlp.c_fc.bias": (i,),
        "mlp.c_proj.weight": (c, i),
        "mlp.c_proj.bias": (c,),
    }
    for layer in range(cfg.num_hidden_layers):
        for name, shape in per_layer.items():
            shapes[f"transformer.h.{layer}.{name}"] = shape
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, c)
    return shapes


def _gemma3_shapes(cfg: ModelConfig) -> Shapes:
    """Llama's parameters (q/k norms where ``use_qk_norm``: Gemma 3, not Gemma 2) plus the two feed-forward norms per
    layer of Gemma 3 and Gemma 2."""
    shapes = _llama_shapes(cfg)
    for layer in range(cfg.num_hidden_layers):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[f"model.layers.{layer}.{norm}.weight"] = (cfg.hidden_size,)
    return shapes


_SHAPES: dict[str, Callable[[ModelConfig], Shapes]] = {
    "llama": _llama_shapes, "gpt2": _gpt2_shapes, "gemma3_text": _gemma3_shapes, "gemma2": _gemma3_shapes,
    "gpt_oss": _gpt_oss_shapes,
}


def expected_param_shapes(config: ModelConfig) -> Shapes:
    """Every parameter our model for ``config`` has, name -> torch shape ``[out, in]``.

    Raises ``UnsupportedArchitectureError`` for a ``model_type`` with no entry.
    """
    fn = _SHAPES.get(config.model_type)
    if fn is None:
        raise UnsupportedArchitectureError(f"no parameter layout for model_type {config.model_type!r}")
    return fn(config)


# a layer's index in a checkpoint or GGUF tensor name: model.layers.N., transformer.h.N., blk.N.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")


def check_layer_count(field: str, value: Any, tensor_names: Iterable[str], where: str) -> None:
    """``ModelFormatError`` when ``value``, the layer count that ``field`` declares, exceeds the layers whose tensors
    ``tensor_names`` hold (``blk.N.``, ``layers.N.``, ``h.N.``): run before anything is built per layer, where a
    count of 2^32 would take every byte of memory. A value that is no integer is left to ModelConfig's checks."""
    if isinstance(value, bool) or not isinstance(value, int):
        return
    present = 1 + max((int(m.group(1)) for name in tensor_names if (m := _LAYER_INDEX.search(name))), default=-1)
    if value > present:
        raise ModelFormatError(f"{field} must be at most the {present} layers whose tensors {where} holds, got {value}")


def check_state_dict(
    shapes: Shapes, actual: dict[str, tuple[int, ...]], source: str, ignored: Iterable[str] = ()
) -> None:
    """Strict key and shape check of a (mapped) checkpoint against ``shapes``.

    ``actual`` maps our names to the shapes found in ``source`` (a path, for
    messages). Raises ``ModelFormatError`` listing every missing key, unexpected
    key and shape mismatch.
    """
    missing = sorted(set(shapes) - set(actual))
    unexpected = sorted(set(actual) - set(shapes))
    wrong = sorted(
        f"{k}: expected {list(shapes[k])}, got {list(actual[k])}"
        for k in set(shapes) & set(actual)
        if tuple(actual[k]) != tuple(shapes[k])
    )
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if wrong:
        problems.append(f"shape mismatches ({len(wrong)}): {'; '.join(wrong)}")
    if problems:
        note = f" (ignored: {', '.join(sorted(ignored))})" if ignored else ""
        raise ModelFormatError(f"{source} does not match the model: {' | '.join(problems)}{note}")


# --- GGUF (llama.cpp names) -------------------------------------------------

_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture-of-experts layers (qwen2moe, qwen3moe, Mixtral's llama): router, Qwen2-MoE's shared expert and its gate
    # (ffn_gate_inp_shexp: [C] in the file, squeezed by the converter); the experts: _GGUF_EXPERT_STACKS
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# every expert's matrix of a sparse layer in one 3-D tensor [E, rows, cols] (llama.cpp's converter since 2024)
_GGUF_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                       # convert_hf_to_gguf.py --fuse-gate-up-exps: gate rows, then up rows, in one stack
                       "ffn_gate_up_exps": "gate_up_proj"}
# older Mixtral files: one 2-D tensor per expert, blk.N.ffn_gate.E.weight (llama.cpp's LLM_TENSOR_FFN_GATE_EXP)
_GGUF_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# phi3 (llama.cpp's converter): q/k/v stacked in attn_qkv, and ffn_up holds gate then up ([2I, C]; no ffn_gate)
_GGUF_STACKED_BLOCK = {k: v for k, v in _GGUF_BLOCK.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate")} | {
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
# gemma3 and gemma2 (llama.cpp's tensor names): ffn_norm is the pre-feedforward norm, with post-attention / post-feedforward norms
_GGUF_GEMMA3_BLOCK = {k: v for k, v in _GGUF_BLOCK.items() if k != "ffn_norm"} | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE): post_attention_norm is the norm before the experts, attn_sinks [H] the
# sinks, ffn_gate_inp (weight and bias) the router; its expert stacks carry biases too (ffn_{gate,up,down}_exps.bias)
_GGUF_GPT_OSS_BLOCK = {k: v for k, v in _GGUF_BLOCK.items() if k.startswith("attn_") and "norm" not in k} | {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's gpt2 architecture (convert_hf_to_gguf GPT2Model: Conv1D matrices stored transposed, as [out, in];
# output.weight usually a copy of token_embd, which the loader then leaves out: a tied head) -> Hugging Face GPT-2
# names
_GGUF_GPT2_GLOBAL = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                     "output_norm": "transformer.ln_f", "output": "lm_head"}
_GGUF_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def _gguf_gpt2_name(name: str) -> str | None:
    """Our (Hugging Face) GPT-2 name of a tensor of a llama.cpp ``gpt2`` file, or None."""
    base, _, kind = name.rpartition(".")
    if base in _GGUF_GPT2_GLOBAL and kind in ("weight", "bias") and (kind == "weight" or base == "output_norm"):
        return f"{_GGUF_GPT2_GLOBAL[base]}.{kind}"
    m = _GGUF_BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in _GGUF_GPT2_BLOCK:
        return None
    return f"transformer.h.{int(m.group(1))}.{_GGUF_GPT2_BLOCK[m.group(2)]}.{m.group(3)}"


def gguf_to_kvgen_name(name: str, arch: str = "llama") -> str | None:
    """Our Llama parameter name for a llama.cpp tensor name of a file of architecture ``arch``, or None if unknown.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; in a ``phi3`` file
    ``blk.3.attn_qkv.weight`` -> ``...self_attn.qkv_proj.weight`` and ``blk.3.ffn_up.weight`` ->
    ``...mlp.gate_up_proj.weight``; in a ``gemma3`` file ``blk.3.ffn_norm.weight`` ->
    ``...pre_feedforward_layernorm.weight``, ``post_attention_norm`` / ``post_ffw_norm`` -> the post norms. Norms map only their ``.weight`` (a norm ``.bias`` is unknown).
    In a ``gpt-oss`` file ``post_attention_norm`` -> ``post_attention_layernorm``, ``attn_sinks.weight`` ->
    ``self_attn.sinks``, ``ffn_gate_inp`` -> ``mlp.router`` (weight and bias).
    Mixtures of experts: ``ffn_gate_inp`` -> ``mlp.gate``, ``ffn_{gate,up,down}_shexp`` / ``ffn_gate_inp_shexp`` ->
    ``mlp.shared_expert.*`` / ``mlp.shared_expert_gate``, an older file's ``blk.3.ffn_up.5.weight`` ->
    ``model.layers.3.mlp.experts.5.up_proj.weight`` (expert stacks: :func:`gguf_expert_stack_name`).
    A ``gpt2`` file's names map to Hugging Face GPT-2's (``blk.3.attn_qkv.bias`` -> ``transformer.h.3.attn.c_attn.bias``;
    its ``output.weight`` -> ``lm_head.weight``, which the loader leaves out when it is the embedding's copy).
    """
    if arch == "gpt2":
        return _gguf_gpt2_name(name)
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    expert = _GGUF_EXPERT_RE.fullmatch(name)
    if expert is not None:
        return f"model.layers.{int(expert.group(1))}.mlp.experts.{int(expert.group(3))}.{expert.group(2)}_proj.weight"
    gemma = arch in ("gemma3", "gemma2")  # the same four norms per layer
    block = _GGUF_STACKED_BLOCK if arch in _STACKED_CHECKPOINTS else _GGUF_GEMMA3_BLOCK if gemma else _GGUF_BLOCK
    block = _GGUF_GPT_OSS_BLOCK if arch == "gpt-oss" else block
    m = _GGUF_BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in block:
        return None
    ours = block[m.group(2)]
    if ours == "self_attn.sinks":  # a parameter of its own, not a module's weight
        return f"model.layers.{int(m.group(1))}.{ours}" if m.group(3) == "weight" else None
    if ours.endswith(("layernorm", "_norm")) and m.group(3) != "weight":
        return None
    return f"model.layers.{int(m.group(1))}.{ours}.{m.group(3)}"


def gguf_expert_stack_name(name: str, arch: str = "llama") -> str | None:
    """For a llama.cpp expert stack (``blk.3.ffn_up_exps.weight``, [E, rows, cols]; in a ``gpt-oss`` file also its
    bias stack ``blk.3.ffn_up_exps.bias``, [E, rows]) the name of its expert ``e``'s matrix (vector) as a format
    string (``model.layers.3.mlp.experts.{}.up_proj.weight``); None for any other tensor."""
    m = _GGUF_BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in _GGUF_EXPERT_STACKS or (m.group(3) != "weight" and arch != "gpt-oss"):
        return None
    return f"model.layers.{int(m.group(1))}.mlp.experts.{{}}.{_GGUF_EXPERT_STACKS[m.group(2)]}.{m.group(3)}"


# --- Hugging Face checkpoints -------------------------------------------------

# Non-persistent buffers that some older checkpoints saved: causal masks and RoPE tables.
_GPT2_BUFFER_RE = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")
_LLAMA_BUFFER_RE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# GPT-2 stores these as transformers' Conv1D: weight [in, out].
# Mixtral's sparse block: block_sparse_moe.gate is our mlp.gate, its experts' w1 / w3 / w2 our gate / up / down
_MIXTRAL_RE = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# a base model's (LlamaModel's) own modules: its checkpoint's keys lack the "model." of a ForCausalLM's
_BASE_MODEL_KEY_RE = re.compile(r"(embed_tokens|layers|norm)\.")
_GPT2_CONV1D_RE = re.compile(r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")


def hf_to_kvgen_name(key: str, config: ModelConfig) -> str | None:
    """Our parameter name for an HF checkpoint key, or None when the key is ignored.

    Ignored: saved buffers (GPT-2 ``attn.bias``/``attn.masked_bias``, Llama
    ``rotary_emb.inv_freq``) and ``lm_head.weight`` when embeddings are tied. Mixtral's
    ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.E.w1`` (w3, w2) become ``mlp.gate`` /
    ``mlp.experts.E.gate_proj`` (up_proj, down_proj).
    GPT-2 keys without the ``transformer.`` prefix (original OpenAI-style and
    ``GPT2Model`` checkpoints) get it added, as do the other models' base-model keys without ``model.``
    (``embed_tokens.``, ``layers.``, ``norm.``: a ``LlamaModel``'s checkpoint, which transformers' ``from_pretrained``
    loads into ``LlamaForCausalLM``).
    """
    if key == "lm_head.weight":
        return None if config.tie_word_embeddings else key
    if config.model_type == "gpt2":
        if _GPT2_BUFFER_RE.fullmatch(key):
            return None
        return key if key.startswith("transformer.") else "transformer." + key
    if config.model_type in ("llama", "gemma3_text", "gemma2", "gpt_oss"):
        key = "model." + key if _BASE_MODEL_KEY_RE.match(key) else key
        mixtral = _MIXTRAL_RE.fullmatch(key) if config.extra.get("hf_model_type") == "mixtral" else None
        if mixtral is not None:
            prefix, part = mixtral.groups()
            *expert, w = part.split(".")  # "gate" or "experts", E, "w1"
            if not expert:
                return f"{prefix}mlp.gate.weight"
            return f"{prefix}mlp.{'.'.join(expert)}.{_MIXTRAL_EXPERT[w]}.weight"
        return None if _LLAMA_BUFFER_RE.fullmatch(key) else key
    raise UnsupportedArchitectureError(f"no checkpoint name map for model_type {config.model_type!r}")


def hf_norm_offset(name: str, config: ModelConfig) -> float:
    """What to add to the HF tensor of our parameter ``name`` so that every RMSNorm multiplies by its weight: 1 for
    Gemma 3's and Gemma 2's norm weights (transformers' ``Gemma3RMSNorm`` / ``Gemma2RMSNorm`` compute
    ``x * (1 + w)``, in float32; llama.cpp's converter stores ``w + 1`` the same way), else 0."""
    gemma = config.model_type in ("gemma3_text", "gemma2")
    return 1.0 if gemma and name.endswith("norm.weight") else 0.0


def hf_needs_transpose(name: str, config: ModelConfig) -> bool:
    """Whether the HF tensor for our parameter ``name`` is stored ``[in, out]`` (GPT-2 Conv1D)."""
    return config.model_type == "gpt2" and _GPT2_CONV1D_RE.fullmatch(name) is not None
