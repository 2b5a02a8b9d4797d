"""Model configuration with Hugging Face field names.

``ModelConfig`` is built either from an HF ``config.json`` dict
(:meth:`ModelConfig.from_hf_dict`) or from GGUF metadata
(:meth:`ModelConfig.from_gguf_metadata`). Field names follow
``transformers.LlamaConfig`` / ``GPT2Config`` so loading and comparison with the
reference are nearly an identity map.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.gemma_config import gemma2_gguf_changes, gemma3_gguf_changes, gemma3_kwargs
from kvgen.gguf_keys import check_gguf_value_types
from kvgen.llama_config import (
    gguf_partial_rotary_factor,
    granite_gguf_fields,
    hf_unread_fields,
    llama_family_changes,
    no_rope_every,
)
from kvgen.moe_config import (
    MOE_FIELDS,
    gguf_gpt_oss_changes,
    gguf_moe_fields,
    hf_gpt_oss_kwargs,
    hf_moe_fields,
)
from kvgen.rope_scaling import gguf_rope_scaling, positive_scaling_value, rope_scaling_type, yarn_scaling

SUPPORTED_MODEL_TYPES = ("llama", "gpt2", "gemma3_text", "gemma2", "gpt_oss")

# GGUF `general.architecture` values we decode with our Llama implementation.
# qwen2/3, phi3: llama.cpp stores their q/k rows unpermuted (NEOX rope); phi3 stacks q/k/v and gate/up
# smollm3: llama's tensors, NoPE every 4th layer; qwen2moe / qwen3moe (and llama with expert_count > 0, Mixtral):
# mixture-of-experts layers (models/moe.py)
# granite: llama's tensors (q/k permuted) and four scalar multipliers; ernie4_5: llama's tensors, q/k rows interleaved
# as Baidu's checkpoints store them (the permuted order of a llama file)
_GGUF_LLAMA_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "smollm3", "qwen2moe", "qwen3moe", "granite", "ernie4_5")
# gemma3: our Gemma 3 decoder (model_type gemma3_text); gpt-oss: model_type gpt_oss (kvgen.moe_config)
_GGUF_ARCHS = (*_GGUF_LLAMA_ARCHS, "gemma3", "gemma2", "gpt-oss", "gpt2")
# Hugging Face model_types decoded by our Llama (see kvgen.llama_config.llama_family_changes)
_HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "qwen3_moe", "qwen2_moe", "mixtral",
                   "granite", "ernie4_5")
# every config.json model_type from_hf_dict reads (named when another one is refused)
_HF_MODEL_TYPES = ("gpt2", *_HF_LLAMA_TYPES, "gemma3_text", "gemma2", "gpt_oss")
# model_types whose transformers 4.55 config copies rope_scaling's legacy "type" over its "rope_type" (LlamaConfig
# and the configs made from it): there "type" wins; elsewhere rope_config_validation reads "rope_type" first
_TYPE_OVER_ROPE_TYPE = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3", "ernie4_5", "gpt_oss")
_ROPE_TYPES = (None, "default", "llama3", "linear", "dynamic", "freq_factors", "longrope", "yarn")
# The transformers 4.55 config classes' defaults where they differ from ModelConfig's: a config.json written by
# save_pretrained omits every value equal to its class default (SmolLM3-3B's tied embeddings, Phi-3's eps).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768},
    "qwen3": {"vocab_size": 151936, "max_position_embeddings": 32768},
    "mistral": {"vocab_size": 32000, "max_position_embeddings": 131072, "sliding_window": 4096},
    "phi3": {"vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "ernie4_5": {"vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
                 "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 131072,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 500000.0, "pad_token_id": 0,
                 "bos_token_id": 1, "eos_token_id": 2},
    "granite": {"vocab_size": 32000, "max_position_embeddings": 2048, "attention_multiplier": 1.0,
                "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0},
    "qwen3_moe": {"vocab_size": 151936, "max_position_embeddings": 32768, "hidden_size": 2048,
                  "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": []},
    "qwen2_moe": {"vocab_size": 151936, "max_position_embeddings": 32768, "hidden_size": 2048,
                  "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
                  "norm_topk_prob": False, "mlp_only_layers": [], "qkv_bias": True},
    "mixtral": {"vocab_size": 32000, "max_position_embeddings": 131072, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2,
                "num_local_experts": 8, "bos_token_id": 1, "eos_token_id": 2},
    "smollm3": {"vocab_size": 128256, "max_position_embeddings": 32768, "rope_theta": 2000000.0,
                "tie_word_embeddings": True},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "pad_token_id": 0,
                    "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_theta": 1000000.0,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_local_base_freq": 10000.0},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "pad_token_id": 0,
               "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_theta": 10000.0,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
}
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types values kvgen decodes


def checked_token_ids(name: str, value: Any, single: bool = False, allow_empty: bool = False) -> list[int]:
    """A list of token ids (ints >= 0) given as a list or tuple, or with ``single`` also one id (then the list must
    not be empty unless ``allow_empty``). Raises ``ValueError`` naming ``name`` and the value."""
    ids = [value] if single and isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or (single and not allow_empty and not ids) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        what = ("a list of ints >= 0" if not single else "a token id or a list of them (ints >= 0)" if allow_empty
                else "a token id or a non-empty list of them (ints >= 0)")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return list(ids)


def check_token_id_range(name: str, ids: Iterable[int], vocab_size: int,
                         error: type[ValueError] = ModelFormatError) -> None:
    """``error`` (default ``ModelFormatError``: a GGUF file's special ids, a config.json's bos / eos / pad) naming
    ``name`` for the first id outside ``[0, vocab_size)``."""
    for i in ids:
        if not 0 <= i < vocab_size:
            raise error(f"{name} must be in [0, {vocab_size}), got {i}")


def token_id_list(value: Any) -> list[int]:
    """One token id, a sequence of ids or an int tensor as a list of ints (``None`` gives ``[]``)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):  # a tensor: any shape
        value = value.reshape(-1).tolist()
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


# ModelConfig's annotations of counts and of float settings, and the values they take (numpy's too, from GGUF files)
_NUMBER_TYPES = {"int": numbers.Integral, "int | None": numbers.Integral, "float": numbers.Real,
                 "float | None": numbers.Real}

@dataclass
class ModelConfig:
    """Decoder hyper-parameters (HF names; sizes in elements, lengths in tokens).

    Raises ``UnsupportedArchitectureError`` for a ``model_type`` kvgen has no
    decoder for or an unsupported ``rope_scaling`` type, and ``ModelFormatError`` for inconsistent sizes.
    A ``longrope`` rope_scaling bounds ``max_position_embeddings`` to its ``original_max_position_embeddings``
    (:meth:`_apply_rope_scaling` says why).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # These three may be left out (None) and are derived in __post_init__; typed ``int``
    # because every reader sees the derived value. The None defaults are the one place
    # the type does not hold, hence the ignores.
    num_key_value_heads: int = None  # type: ignore[assignment]  # None -> num_attention_heads
    intermediate_size: int = None  # type: ignore[assignment]  # None -> 4 * hidden_size
    head_dim: int = None  # type: ignore[assignment]  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6  # llama
    layer_norm_epsilon: float = 1e-5  # gpt2
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # Phi-4-mini: RoPE rotates the first rotary_dim = int(head_dim * partial_rotary_factor) dimensions of each head
    # (rotate-half pairs i, i + rotary_dim / 2) and passes the rest through; 1.0 rotates all of them
    partial_rotary_factor: float = 1.0
    # Granite (IBM Granite 3.x): embeddings times embedding_multiplier, each block's attention and MLP outputs times
    # residual_multiplier before their residual add, attention scores times attention_multiplier (None: head_dim^-0.5),
    # logits divided by logits_scaling (transformers' GraniteForCausalLM)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool | None = None  # None: as attention_bias (Llama); Qwen2 biases q/k/v only
    mlp_bias: bool = False
    use_qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key before RoPE
    no_rope_layers: list[int] | None = None  # SmolLM3: a 0/1 per layer, 0 = no RoPE (NoPE); None: RoPE everywhere
    # Gemma 3 (model_type gemma3_text): per-layer "sliding_attention" / "full_attention"; sliding layers see the last
    # sliding_window tokens and rotate by rope_local_base_freq (unscaled); attention scale query_pre_attn_scalar^-0.5
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    # Gemma 2: attention scores s -> c * tanh(s / c) before the softmax, logits l -> c * tanh(l / c); None: no cap
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral; models/moe.py). num_experts = 0: a dense model. A layer is
    # sparse (is_sparse_layer) where num_experts > 0, it is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    # == 0; its router picks num_experts_per_tok of the num_experts SwiGLU experts (moe_intermediate_size each;
    # None: intermediate_size) from a float32 softmax, their weights renormalized to sum 1 when norm_topk_prob.
    # shared_expert_intermediate_size: Qwen2-MoE's shared expert beside them (None: none).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = None  # type: ignore[assignment]  # None -> intermediate_size
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._check_number_types()
        self._check_positive_floats()
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not supported; kvgen supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.model_type == "llama" and self.hidden_act not in ("silu", "swish"):  # its MLP is SwiGLU
            raise UnsupportedArchitectureError(f"hidden_act {self.hidden_act!r} is not supported by the Llama-family "
                                               "decoder (SwiGLU: silu only)")
        if self.num_attention_heads <= 0:  # divides hidden_size below
            raise ModelFormatError(f"num_attention_heads must be positive, got {self.num_attention_heads}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_token_ids()
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelFormatError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.model_type == "gpt2" and self.hidden_size % self.num_attention_heads:  # heads split hidden_size
            raise ModelFormatError(f"GPT-2's hidden_size ({self.hidden_size}) must be a multiple of "
                                   f"num_attention_heads ({self.num_attention_heads})")
        rotary = self.rotary_dim if 0.0 < self.partial_rotary_factor <= 1.0 else None  # None: NaN or out of range
        if (rotary is None or rotary < 2 or rotary % 2) and self.model_type != "gpt2":  # gpt2: no RoPE
            raise ModelFormatError(f"partial_rotary_factor must give an even rotary dimension in [2, head_dim = "
                                   f"{self.head_dim}], got {self.partial_rotary_factor}"
                                   + (f" ({rotary})" if rotary is not None else ""))
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ModelFormatError(f"{name} must be a positive number, got {value}")
        if self.partial_rotary_factor != 1.0 and self.model_type != "llama":
            raise UnsupportedArchitectureError(f"{self.model_type} with partial_rotary_factor="
                                               f"{self.partial_rotary_factor} is not supported (Llama-family only)")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ModelFormatError(f"rope_scaling must be an object (or null), got {self.rope_scaling!r}")
            self._apply_rope_scaling(self.rope_scaling)
        flags = self.no_rope_layers
        if flags is not None and (not isinstance(flags, list) or len(flags) != self.num_hidden_layers
                                  or any(f not in (0, 1) for f in flags)):
            raise ModelFormatError(f"no_rope_layers must hold a 0 or 1 per layer ({self.num_hidden_layers}), got {flags}")
        kinds = self.layer_types
        if kinds is not None and (not isinstance(kinds, list) or len(kinds) != self.num_hidden_layers
                                  or any(k not in LAYER_TYPES for k in kinds)):
            raise ModelFormatError(f"layer_types must hold one of {LAYER_TYPES} per layer ({self.num_hidden_layers}), "
                                   f"got {kinds}")
        if kinds is not None and "sliding_attention" in kinds and (self.sliding_window or 0) < 1:
            raise ModelFormatError(f"sliding_attention layers need a positive sliding_window, got {self.sliding_window}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and self.model_type != "gemma2":
                raise UnsupportedArchitectureError(f"{self.model_type} with {name}={cap} is not supported (kvgen "
                                                   f"computes logit softcapping for gemma2 only)")
            if cap is not None and not float(cap) > 0:  # NaN included
                raise ModelFormatError(f"{name} must be positive (or absent: no softcapping), got {cap}")
        self._check_experts()

    def _check_experts(self) -> None:
        """ModelFormatError naming the mixture-of-experts field that is out of range (checked where num_experts > 0),
        UnsupportedArchitectureError for experts in a decoder other than Llama's."""
        if self.num_experts < 0:
            raise ModelFormatError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.model_type == "gpt_oss" and (self.num_experts == 0 or self.layer_types is None):
            raise ModelFormatError(f"gpt_oss needs experts and layer_types, got num_experts={self.num_experts}, "
                                   f"layer_types={self.layer_types}")
        if self.num_experts == 0:
            return
        if self.model_type not in ("llama", "gpt_oss"):
            raise UnsupportedArchitectureError(f"{self.model_type} with num_experts={self.num_experts} is not supported "
                                               f"(kvgen's mixture-of-experts layers are Llama-family layers)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelFormatError(f"num_experts_per_tok must be in [1, num_experts = {self.num_experts}], "
                                   f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size <= 0:
            raise ModelFormatError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ModelFormatError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ModelFormatError(f"mlp_only_layers must hold layer indices in [0, {self.num_hidden_layers}), "
                                   f"got {self.mlp_only_layers}")
        shared = self.shared_expert_intermediate_size
        if shared is not None and shared <= 0:
            raise ModelFormatError(f"shared_expert_intermediate_size must be positive (or absent), got {shared}")

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a mixture of experts (else a dense MLP). Source: transformers 4.55
        ``Qwen3MoeDecoderLayer`` / ``Qwen2MoeDecoderLayer`` (Mixtral: every layer)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates, the first ones: int(head_dim * partial_rotary_factor), as
        transformers' ``_compute_default_rope_parameters``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_experts(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    def _apply_rope_scaling(self, scaling: dict[str, Any]) -> None:
        """Refuse rope types we do not compute, and bound a LongRoPE model's ``max_position_embeddings``.

        Dynamic NTK (``"dynamic"``): transformers 4.55 raises the RoPE base only for a sequence longer than
        ``max_position_embeddings``, kvgen's context limit, so within it the frequencies are plain RoPE's.

        LongRoPE (Phi-3 128k, Phi-3.5): kvgen rotates by the short factors (:func:`longrope_scaling`) and serves at
        most ``original_max_position_embeddings`` tokens. transformers 4.55 (``_longrope_frequency_update``) switches
        every frequency to the long factors once a sequence passes that length, while the keys already in its cache
        stay rotated by the short ones, and llama.cpp picks one set for the whole context from its size: past that
        length the references disagree with each other, so the context ends there (as a sliding window does).
        """
        kind = rope_scaling_type(scaling)
        if kind not in _ROPE_TYPES:
            raise UnsupportedArchitectureError(f"rope_scaling type {kind!r} is not supported")
        if kind == "linear":
            positive_scaling_value(scaling, "factor", kind)
        if kind == "dynamic":  # transformers' _validate_dynamic_scaling_rope_parameters
            if positive_scaling_value(scaling, "factor", kind) < 1:
                raise ModelFormatError(f"dynamic rope_scaling factor must be >= 1, got {scaling['factor']!r}")
        if kind == "llama3":  # transformers' _validate_llama3_parameters
            for key in ("factor", "original_max_position_embeddings"):
                positive_scaling_value(scaling, key, kind)
            low, high = (positive_scaling_value(scaling, k, kind) for k in ("low_freq_factor", "high_freq_factor"))
            if low >= high:
                raise ModelFormatError(f"llama3 rope_scaling low_freq_factor must be below high_freq_factor, got "
                                       f"{low} and {high}")
        if kind == "yarn":  # completed to kvgen's form (kvgen.rope_scaling); its cos/sin scale is Llama's to apply
            if self.model_type not in ("llama", "gpt_oss"):
                raise UnsupportedArchitectureError(f"{self.model_type} with a yarn rope_scaling is not supported")
            self.rope_scaling = yarn_scaling(scaling, self.max_position_embeddings)
            return
        if kind != "longrope":
            return
        missing = [k for k in ("short_factor", "long_factor", "original_max_position_embeddings") if k not in scaling]
        if missing:
            raise ModelFormatError(f"longrope rope_scaling lacks {', '.join(missing)}")
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != self.rotary_dim // 2:
                raise ModelFormatError(f"rope_scaling {name} must hold rotary_dim / 2 = {self.rotary_dim // 2} values, "
                                       f"got {len(scaling[name])}")
        self.max_position_embeddings = min(self.max_position_embeddings, int(scaling["original_max_position_embeddings"]))

    def _check_number_types(self) -> None:
        """Raise ``ModelFormatError`` for a count that is no integer, a float field that is no number (a config.json
        value such as ``"hidden_size": "big"``) or a flag that is no boolean (``"tie_word_embeddings": "false"``);
        None stays for the fields whose default is None."""
        for f in fields(self):
            value, wanted = getattr(self, f.name), _NUMBER_TYPES.get(str(f.type))
            if str(f.type) == "bool" and not isinstance(value, bool):
                raise ModelFormatError(f"{f.name} must be true or false, got {value!r}")
            if wanted is None or (value is None and f.default is None):
                continue
            if isinstance(value, bool) or not isinstance(value, wanted):
                raise ModelFormatError(f"{f.name} must be {'an integer' if wanted is numbers.Integral else 'a number'}"
                                       f", got {value!r}")

    def _check_token_ids(self) -> None:
        """ModelFormatError for a bos / pad id that is no int, an eos that is no int or list of ints, a negative id,
        or a pad id outside [0, vocab_size) (padding feeds it to the embedding), as
        :func:`kvgen.tokenizer.gguf_vocab.gguf_special_ids` refuses a GGUF file's. bos / eos ids past vocab_size stay:
        transformers' GPT2Config writes 50256 whatever the vocab_size, and they are only compared with the output."""
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if name != "eos_token_id" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ModelFormatError(f"{name} must be a token id (an int), got {value!r}")
            try:
                ids = checked_token_ids(name, value, single=True, allow_empty=True)
            except ValueError as e:
                raise ModelFormatError(str(e)) from None
            if name == "pad_token_id":
                check_token_id_range(name, ids, self.vocab_size)

    def _check_positive_floats(self) -> None:
        """ModelFormatError for a RoPE base that is not finite and positive, or a norm epsilon that is not finite and
        >= 0: each gave NaN logits."""
        for name in ("rope_theta", "rope_local_base_freq"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ModelFormatError(f"{name} must be a positive number, got {value}")
        for name in ("rms_norm_eps", "layer_norm_epsilon"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ModelFormatError(f"{name} must be a number >= 0, got {getattr(self, name)}")

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (empty when the model declares none)."""
        return token_id_list(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict of a model_type in :data:`_HF_MODEL_TYPES`: ``gpt2``, or
        ``llama`` and the model_types our Llama decodes (``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``smollm3``,
        ``granite``, ``ernie4_5``, and with mixture-of-experts layers ``qwen3_moe``, ``qwen2_moe``, ``mixtral``; see
        ``kvgen.llama_config.llama_family_changes`` and ``kvgen.moe_config``), ``gemma3_text`` / ``gemma2``
        (``kvgen.gemma_config``), ``gpt_oss`` (:func:`kvgen.moe_config.hf_gpt_oss_kwargs`).

        GPT-2's own names (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``,
        ``n_inner``) are mapped to the common ones.
        Raises ``UnsupportedArchitectureError`` / ``ModelFormatError``.
        """
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ModelFormatError("config.json has no 'model_type'")
        scaling = cfg.get("rope_scaling")
        if model_type in _TYPE_OVER_ROPE_TYPE and isinstance(scaling, dict) and scaling.get("type") is not None:
            cfg = cfg | {"rope_scaling": scaling | {"rope_type": scaling["type"]}}
        try:
            if model_type == "gpt2":
                n_embd = cfg["n_embd"]
                if isinstance(n_embd, bool) or not isinstance(n_embd, int):  # 4 * n_embd below
                    raise ModelFormatError(f"n_embd must be an integer, got {n_embd!r}")
                if cfg.get("add_cross_attention"):  # the decoder of an encoder-decoder model: no encoder here
                    raise UnsupportedArchitectureError("GPT-2 with add_cross_attention=true (cross-attention to an "
                                                       "encoder) is not supported")
                return cls(
                    model_type="gpt2",
                    vocab_size=cfg["vocab_size"],
                    hidden_size=n_embd,
                    num_hidden_layers=cfg["n_layer"],
                    num_attention_heads=cfg["n_head"],
                    intermediate_size=cfg.get("n_inner") or 4 * n_embd,
                    max_position_embeddings=cfg.get("n_positions", 1024),
                    layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
                    hidden_act=cfg.get("activation_function", "gelu_new"),
                    tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                    attention_bias=True,
                    mlp_bias=True,
                    bos_token_id=cfg.get("bos_token_id"),
                    eos_token_id=cfg.get("eos_token_id"),
                    pad_token_id=cfg.get("pad_token_id"),
                    extra={"scale_attn_weights": cfg.get("scale_attn_weights", True),
                           "scale_attn_by_inverse_layer_idx": bool(cfg.get("scale_attn_by_inverse_layer_idx"))},
                )
            if model_type in ("gemma3_text", "gemma2"):
                return cls(**gemma3_kwargs(_HF_DEFAULTS[model_type] | cfg, model_type))
            if model_type == "gpt_oss":
                return cls(**hf_gpt_oss_kwargs(cfg))
            if model_type in _HF_LLAMA_TYPES:
                cfg = _HF_DEFAULTS.get(model_type, {}) | cfg  # save_pretrained leaves out values equal to these
                known = ({f.name for f in fields(cls)} - {"extra", "o_proj_bias", *MOE_FIELDS}
                         - hf_unread_fields(model_type))
                kwargs = {k: v for k, v in cfg.items() if k in known}
                missing = [f.name for f in fields(cls) if f.name not in kwargs and f.name != "model_type"
                           and f.default is MISSING and f.default_factory is MISSING]
                if missing:
                    raise ModelFormatError(f"config.json for {model_type!r} lacks required fields "
                                           f"{', '.join(map(repr, missing))}")
                return cls(**kwargs | llama_family_changes(model_type, cfg) | hf_moe_fields(model_type, cfg))
        except KeyError as e:
            raise ModelFormatError(f"config.json for {model_type!r} lacks required field {e.args[0]!r}") from None
        raise UnsupportedArchitectureError(f"model_type {model_type!r} is not supported; kvgen reads config.json "
                                           f"model_types {', '.join(_HF_MODEL_TYPES)}")

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelConfig:
        """Build from GGUF key/value metadata (plain Python values).

        ``meta`` maps GGUF keys (``general.architecture``, ``llama.block_count``,
        ...) to values. Raises ``UnsupportedArchitectureError`` for an
        architecture outside ``llama`` (with ``expert_count`` > 0: Mixtral), ``qwen2``, ``qwen3``, ``phi3``,
        ``smollm3``, ``granite`` (its ``attention.scale``, ``embedding_scale``, ``residual_scale``, ``logit_scale``),
        ``ernie4_5``,
        ``qwen2moe``, ``qwen3moe``, ``gemma3``, ``gemma2``, ``gpt-oss``, ``gpt2`` (llama.cpp's GPT2Model keys) (see :func:`kvgen.gemma_config.gemma3_gguf_changes`,
        :func:`kvgen.gemma_config.gemma2_gguf_changes`, :func:`kvgen.moe_config.gguf_moe_fields`, :func:`~kvgen.moe_config.gguf_gpt_oss_changes`) and ``ModelFormatError`` for missing keys or bad
        values (:func:`kvgen.gguf_keys.check_gguf_value_types`: a value of the wrong type, naming its key).
        A Llama-family file's ``rope.scaling`` keys (linear, YaRN) are read by
        :func:`kvgen.rope_scaling.gguf_rope_scaling`; rope scaling stored as tensors (``rope_freqs``,
        ``rope_factors_*``) is the loader's to add.
        """
        arch = meta.get("general.architecture")
        if arch is None:
            raise ModelFormatError("GGUF metadata has no 'general.architecture'")
        if arch not in _GGUF_ARCHS:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {arch!r} is not supported; kvgen reads GGUF files of: {', '.join(_GGUF_ARCHS)}"
            )

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelFormatError(f"GGUF metadata lacks required key {full!r}")
            return meta[full]

        check_gguf_value_types(meta)
        num_heads = int(need("attention.head_count"))
        if num_heads <= 0:  # divides the hidden size below
            raise ModelFormatError(f"{arch}.attention.head_count must be positive, got {num_heads}")
        hidden = int(need("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelFormatError("GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")
            vocab = len(tokens)
        if arch == "gpt2":  # llama.cpp's GPT2Model keys; GELU with the tanh approximation (ggml_gelu, gelu_new)
            return cls(model_type="gpt2", vocab_size=int(vocab), hidden_size=hidden,
                       num_hidden_layers=int(need("block_count")), num_attention_heads=num_heads,
                       intermediate_size=int(need("feed_forward_length")),
                       max_position_embeddings=int(need("context_length")),
                       layer_norm_epsilon=float(need("attention.layer_norm_epsilon")), hidden_act="gelu_new",
                       tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                       bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                       eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                       pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
                       extra={"scale_attn_weights": True, "gguf_architecture": arch})
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
        rotary = gguf_partial_rotary_factor(meta, arch, head_dim)
        kwargs: dict[str, Any] = {
            "model_type": "llama",
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            # MoE files may leave it out (every layer sparse): the experts' size then (gguf_moe_fields)
            "intermediate_size": int(meta.get(f"{arch}.feed_forward_length") or 0) or None,
            "head_dim": head_dim,
            "partial_rotary_factor": rotary,
            "max_position_embeddings": _gguf_context_length(meta, arch),
            "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": False,  # set by the loader: True when the file has no output.weight
            "use_qk_norm": arch in ("qwen3", "qwen3moe"),
            # llama.cpp's smollm3 graph: no RoPE where (layer + 1) % 4 == 0, a constant of its code (no GGUF key)
            "no_rope_layers": no_rope_every(4, int(need("block_count"))) if arch == "smollm3" else None,
            "rope_scaling": gguf_rope_scaling(meta, arch) if arch in _GGUF_LLAMA_ARCHS else None,  # YaRN, linear
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
            "extra": {"gguf_architecture": arch},
        }
        if (pooling := _GGUF_POOLING_TYPES.get(int(meta.get(f"{arch}.pooling_type") or 0))) is not None:  # embeddings
            kwargs["extra"]["pooling_type"] = pooling
        if arch == "granite":
            kwargs |= granite_gguf_fields(meta, arch)
        if arch == "gemma3":
            kwargs |= gemma3_gguf_changes(meta, kwargs, need("attention.sliding_window"))
        if arch == "gemma2":
            kwargs |= gemma2_gguf_changes(meta, kwargs)
        if arch == "gpt-oss":
            kwargs |= gguf_gpt_oss_changes(meta, kwargs["intermediate_size"])
        elif arch in ("qwen2moe", "qwen3moe") or int(meta.get(f"{arch}.expert_count") or 0) > 0:
            kwargs |= gguf_moe_fields(meta, arch, kwargs["intermediate_size"])
        elif kwargs["intermediate_size"] is None:
            need("feed_forward_length")  # raises: a dense model's MLP size
        return cls(**kwargs)


# llama.cpp's enum llama_pooling_type (0 none, 4 rank: no embedding to serve) -> kvgen.engine.pooling's names
_GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}


def _gguf_context_length(meta: dict[str, Any], arch: str) -> int:
    """``{arch}.context_length`` (2048 when absent), bounded by a ``phi3`` file's ``attention.sliding_window`` as
    for Hugging Face's Mistral and Phi-3 (0, Phi-4's value, means none). Source: llama.cpp ``Phi3MiniModel``."""
    context = int(meta.get(f"{arch}.context_length", 2048))
    window = int(meta.get(f"{arch}.attention.sliding_window", 0)) if arch == "phi3" else 0
    return min(context, window) if window > 0 else context
