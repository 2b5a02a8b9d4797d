"""Model configuration with Hugging Face field names.

``ModelConfig`` is built either from an HF ``config.json`` dict
(:meth:`ModelConfig.from_hf_dict`) or from GGUF metadata
(:meth:`ModelConfig.from_gguf_metadata`). Field names follow
``transformers.LlamaConfig`` / ``GPT2Config`` so loading and comparison with the
reference are nearly an identity map.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvgen.errors import ModelFormatError, UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "gpt2")

# GGUF `general.architecture` values we decode with our Llama implementation.
_GGUF_LLAMA_ARCHS = ("llama", "qwen2", "qwen3")  # qwen2/3: llama.cpp stores their q/k rows unpermuted (NEOX rope)


def token_id_list(value: Any) -> list[int]:
    """One token id, a sequence of ids or an int tensor as a list of ints (``None`` gives ``[]``)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):  # a tensor: any shape
        value = value.reshape(-1).tolist()
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


@dataclass
class ModelConfig:
    """Decoder hyper-parameters (HF names; sizes in elements, lengths in tokens).

    Raises ``UnsupportedArchitectureError`` for a ``model_type`` kvgen has no
    decoder for and ``ModelFormatError`` for inconsistent sizes.
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
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool | None = None  # None: as attention_bias (Llama); Qwen2 biases q/k/v only
    mlp_bias: bool = False
    use_qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {self.model_type!r} is not supported; kvgen supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelFormatError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in (None, "default", "llama3", "linear", "freq_factors"):
                raise UnsupportedArchitectureError(f"rope_scaling type {kind!r} is not supported")

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (empty when the model declares none)."""
        return token_id_list(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (``gpt2`` or ``llama``).

        GPT-2's own names (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``,
        ``n_inner``) are mapped to the common ones.
        Raises ``UnsupportedArchitectureError`` / ``ModelFormatError``.
        """
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ModelFormatError("config.json has no 'model_type'")
        try:
            if model_type == "gpt2":
                n_embd = cfg["n_embd"]
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
                    extra={"scale_attn_weights": cfg.get("scale_attn_weights", True)},
                )
            if model_type in ("llama", "mistral", "qwen2", "qwen3"):
                known = {f.name for f in fields(cls)}
                kwargs = {k: v for k, v in cfg.items() if k in known and k not in ("extra", "o_proj_bias")}
                return cls(**kwargs | _llama_family_changes(model_type, cfg))
        except KeyError as e:
            raise ModelFormatError(f"config.json for {model_type!r} lacks required field {e.args[0]!r}") from None
        return cls(model_type=model_type, vocab_size=1, hidden_size=1, num_hidden_layers=1, num_attention_heads=1)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelConfig:
        """Build from GGUF key/value metadata (plain Python values).

        ``meta`` maps GGUF keys (``general.architecture``, ``llama.block_count``,
        ...) to values. Raises ``UnsupportedArchitectureError`` for an
        architecture other than ``llama`` and ``ModelFormatError`` for missing keys.
        """
        arch = meta.get("general.architecture")
        if arch is None:
            raise ModelFormatError("GGUF metadata has no 'general.architecture'")
        if arch not in _GGUF_LLAMA_ARCHS:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {arch!r} is not supported; kvgen reads GGUF files of: {', '.join(_GGUF_LLAMA_ARCHS)}"
            )

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelFormatError(f"GGUF metadata lacks required key {full!r}")
            return meta[full]

        num_heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelFormatError("GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")
            vocab = len(tokens)
        rope_dim = meta.get(f"{arch}.rope.dimension_count")
        head_dim = meta.get(f"{arch}.attention.key_length", hidden // num_heads)
        if rope_dim is not None and int(rope_dim) != int(head_dim):
            raise UnsupportedArchitectureError(
                f"partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) are not supported"
            )
        return cls(
            model_type="llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            intermediate_size=int(need("feed_forward_length")),
            head_dim=int(head_dim),
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            tie_word_embeddings=False,  # set by the loader: True when the file has no output.weight
            use_qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            extra={"gguf_architecture": arch},
        )


def _llama_family_changes(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """What Mistral, Qwen2 and Qwen3 change of a Llama: Qwen2 biases q/k/v (not o_proj); Qwen3 normalizes each
    head's q and k (``use_qk_norm``; its ``head_dim`` may differ from hidden_size / heads); Mistral's sliding window
    bounds the context (attention within the window is exact; longer contexts are refused, not approximated).
    Raises ``UnsupportedArchitectureError`` for Qwen2/Qwen3 sliding-window layers. Source: transformers 4.55
    ``MistralConfig`` / ``Qwen2Config`` / ``Qwen3Config`` and their attention modules."""
    changes: dict[str, Any] = {"model_type": "llama", "extra": {"hf_model_type": model_type}}
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise UnsupportedArchitectureError(f"{model_type} with use_sliding_window=true is not supported")
    if model_type == "qwen2":
        changes |= {"attention_bias": True, "o_proj_bias": False}
    if model_type == "qwen3":
        changes["use_qk_norm"] = True
    window = cfg.get("sliding_window") if model_type == "mistral" else None
    if window is not None and window < cfg.get("max_position_embeddings", 2048):
        changes["max_position_embeddings"] = int(window)
    return changes
