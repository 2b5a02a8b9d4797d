"""ModelConfig from Hugging Face config.json dicts and GGUF metadata: Phi-3's context bounds and refusals."""

from __future__ import annotations

import math

import pytest

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError

# Phi-3-mini's sizes (config.json of microsoft/Phi-3-mini-4k-instruct), factors shortened to their count
PHI3_MINI = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "sliding_window": 2047,
             "rope_scaling": None, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 32000}
LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 100 for i in range(48)],
            "long_factor": [1.0 + i for i in range(48)]}
PHI3_128K = PHI3_MINI | {"max_position_embeddings": 131072, "sliding_window": 262144, "rope_scaling": LONGROPE}


def test_phi3_mini_4k_sliding_window_bounds_the_context():
    config = ModelConfig.from_hf_dict(PHI3_MINI)
    assert (config.model_type, config.extra["hf_model_type"]) == ("llama", "phi3")
    assert config.max_position_embeddings == 2047 and config.rope_scaling is None
    assert ModelConfig.from_hf_dict(PHI3_MINI | {"sliding_window": None}).max_position_embeddings == 4096


@pytest.mark.parametrize("kind", ["longrope", "su"])  # "su": older Phi-3 configs, renamed by transformers' Phi3Config
def test_phi3_longrope_is_completed_and_bounds_the_context_to_the_original_length(kind):
    """Phi-3-mini-128k / Phi-3.5-mini: 131072 positions, 4096 original ones: kvgen serves 4096, with the scale
    transformers computes from 131072 / 4096."""
    config = ModelConfig.from_hf_dict(PHI3_128K | {"rope_scaling": LONGROPE | {"type": kind}})
    assert config.max_position_embeddings == 4096
    scaling = config.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096
    assert scaling["short_factor"] == LONGROPE["short_factor"] and scaling["long_factor"] == LONGROPE["long_factor"]
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    explicit = ModelConfig.from_hf_dict(PHI3_128K | {"rope_scaling": LONGROPE | {"attention_factor": 1.5}})
    assert explicit.rope_scaling is not None and explicit.rope_scaling["attention_factor"] == 1.5


def test_longrope_with_the_wrong_number_of_factors_is_refused():
    bad = LONGROPE | {"short_factor": [1.0] * 47}
    with pytest.raises(ModelFormatError, match="short_factor must hold head_dim / 2 = 48 values, got 47"):
        ModelConfig.from_hf_dict(PHI3_128K | {"rope_scaling": bad})
    with pytest.raises(ModelFormatError, match="'long_factor'"):
        ModelConfig.from_hf_dict(PHI3_128K | {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}})


def test_partial_rotary_factor_below_one_is_refused_naming_it():
    """Phi-4-mini (model_type phi3) rotates 3/4 of each head; kvgen rotates all of it, so it refuses."""
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be 1\.0 .*got 0\.75") as info:
        ModelConfig.from_hf_dict(PHI3_MINI | {"partial_rotary_factor": 0.75})
    assert isinstance(info.value, UnsupportedArchitectureError)
    assert ModelConfig.from_hf_dict(PHI3_MINI | {"partial_rotary_factor": 1.0}).head_dim == 96


@pytest.mark.parametrize("model_type", ["phi3small", "phimoe"])
def test_phi3_small_and_phimoe_are_refused_by_name(model_type):
    with pytest.raises(UnsupportedArchitectureError, match=f"model_type '{model_type}' is not supported"):
        ModelConfig.from_hf_dict(PHI3_MINI | {"model_type": model_type})
    with pytest.raises(UnsupportedArchitectureError, match=f"GGUF architecture '{model_type}' is not supported"):
        ModelConfig.from_gguf_metadata({"general.architecture": model_type})


def _phi3_meta(**changes: object) -> dict[str, object]:
    meta = {"general.architecture": "phi3", "phi3.context_length": 4096, "phi3.embedding_length": 3072,
            "phi3.feed_forward_length": 8192, "phi3.block_count": 32, "phi3.attention.head_count": 32,
            "phi3.attention.head_count_kv": 32, "phi3.attention.layer_norm_rms_epsilon": 1e-5,
            "phi3.rope.dimension_count": 96, "phi3.rope.freq_base": 10000.0, "phi3.attention.sliding_window": 2047,
            "phi3.rope.scaling.original_context_length": 4096, "tokenizer.ggml.tokens": ["t"] * 32064}
    return meta | {f"phi3.{k}": v for k, v in changes.items()}


def test_phi3_gguf_metadata():
    """llama.cpp's converter writes Phi-3-mini-4k's window (2047), 0 for none (Phi-4) and the head's rotary
    dimensions: the window bounds the context; fewer rotary dimensions than the head are refused."""
    config = ModelConfig.from_gguf_metadata(_phi3_meta())
    assert (config.model_type, config.extra["gguf_architecture"]) == ("llama", "phi3")
    assert (config.hidden_size, config.head_dim, config.vocab_size, config.max_position_embeddings) == (3072, 96, 32064,
                                                                                                     2047)
    assert ModelConfig.from_gguf_metadata(_phi3_meta(**{"attention.sliding_window": 0})).max_position_embeddings == 4096
    with pytest.raises(UnsupportedArchitectureError, match=r"rope.dimension_count=72, head_dim=96"):
        ModelConfig.from_gguf_metadata(_phi3_meta(**{"rope.dimension_count": 72}))
