"""The types of the GGUF metadata values kvgen reads, checked once before any of them is read.

A GGUF value carries its own type, so a corrupt or hand-edited file can hold a string where a count belongs, an
array where a token id belongs or ints where tokens belong. :func:`check_gguf_value_types` refuses each such value
with a ``ModelFormatError`` naming the key, so the readers (``ModelConfig.from_gguf_metadata`` and the functions it
calls, ``kvgen.tokenizer.gguf_vocab``) can take the values as typed. Keys are llama.cpp's (``gguf-py``
``constants.Keys``).
"""

from __future__ import annotations

from typing import Any

from kvgen.errors import ModelFormatError

# What each kind accepts, as exact Python types (``gguf_metadata`` gives plain ints, floats, strs, bools and lists of
# them; an exact type also keeps bools out of the ints): "[str]" a list of strings...
_KINDS: dict[str, tuple[str, frozenset[type]]] = {
    "int": ("an integer", frozenset({int})), "float": ("a number", frozenset({int, float})),
    "str": ("a string", frozenset({str})), "bool": ("a boolean", frozenset({bool})),
    "[str]": ("an array of strings", frozenset({str})), "[int]": ("an array of integers", frozenset({int})),
    "[float]": ("an array of numbers", frozenset({int, float})),
}
_GENERAL_KEYS = {"general.architecture": "str", "general.name": "str", "general.alignment": "int",
                 "tokenizer.chat_template": "str"}
_TOKENIZER_KEYS = {
    "model": "str", "pre": "str", "tokens": "[str]", "merges": "[str]", "token_type": "[int]", "scores": "[float]",
    "bos_token_id": "int", "eos_token_id": "int", "eot_token_id": "int", "eom_token_id": "int",
    "padding_token_id": "int", "unknown_token_id": "int", "add_bos_token": "bool", "add_eos_token": "bool",
    "add_space_prefix": "bool",
}
# {arch}.<suffix>
_ARCH_KEYS = {
    **dict.fromkeys(("block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
                     "attention.head_count", "attention.head_count_kv", "attention.key_length",
                     "attention.value_length", "attention.sliding_window", "rope.dimension_count",
                     "rope.scaling.original_context_length", "expert_count", "expert_used_count",
                     "expert_feed_forward_length", "expert_shared_feed_forward_length", "expert_gating_func",
                     "pooling_type"), "int"),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "attention.scale",
                     "embedding_scale", "residual_scale", "logit_scale", "rope.freq_base", "rope.freq_base_swa",
                     "rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor",
                     "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier",
                     "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                     "expert_weights_scale", "attn_logit_softcapping", "final_logit_softcapping"), "float"),
    "rope.scaling.type": "str",
}


def gguf_key_kind(key: str, arch: str | None) -> str | None:
    """The kind (a key of ``_KINDS``) of metadata ``key`` in a file of architecture ``arch``; None for a key kvgen
    does not read."""
    if key in _GENERAL_KEYS:
        return _GENERAL_KEYS[key]
    if key.startswith("tokenizer.ggml."):
        return _TOKENIZER_KEYS.get(key.removeprefix("tokenizer.ggml."))
    if arch is not None and key.startswith(arch + "."):
        return _ARCH_KEYS.get(key.removeprefix(arch + "."))
    return None


def check_gguf_value_types(meta: dict[str, Any]) -> None:
    """Raise ``ModelFormatError`` naming the first metadata key kvgen reads whose value has another type than the
    one llama.cpp writes there (``llama.block_count`` a string or an array, ``tokenizer.ggml.eos_token_id`` a
    string, ``tokenizer.ggml.tokens`` integers...). Keys kvgen does not read are not checked."""
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    for key, value in meta.items():
        kind = gguf_key_kind(key, arch)
        if kind is None:
            continue
        what, types = _KINDS[kind]
        if kind.startswith("["):  # set(map(type, ...)): 2 ms a load for the default model's lists, not 6 as isinstance
            is_ok = isinstance(value, list) and set(map(type, value)) <= types
        else:
            is_ok = type(value) in types
        if not is_ok:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ModelFormatError(f"GGUF metadata {key} must be {what}, got {shown}")
