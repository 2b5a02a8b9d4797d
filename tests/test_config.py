"""ModelConfig from Hugging Face config.json dicts and GGUF metadata: Phi-3's context bounds and refusals, SmolLM3's
NoPE layers."""

from __future__ import annotations

import math
import re

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
    with pytest.raises(ModelFormatError, match="short_factor must hold rotary_dim / 2 = 48 values, got 47"):
        ModelConfig.from_hf_dict(PHI3_128K | {"rope_scaling": bad})
    with pytest.raises(ModelFormatError, match="'long_factor'"):
        ModelConfig.from_hf_dict(PHI3_128K | {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}})


# Phi-4-mini-instruct's config.json: 24 heads of 128 (8 KV heads), 3/4 of each head rotated, LongRoPE factors of 48
PHI4_MINI = {"model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192,
             "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
             "partial_rotary_factor": 0.75, "rope_scaling": LONGROPE, "rope_theta": 10000.0, "tie_word_embeddings": True}


def test_phi4_mini_rotates_three_quarters_of_each_head():
    """Phi-4-mini (model_type phi3, partial_rotary_factor 0.75): 96 of 128 dimensions rotated, its 48 LongRoPE
    factors taken; a partial factor outside phi3 (whose transformers attention rotates whole heads) and one giving an
    odd or empty rotary dimension are refused by name."""
    config = ModelConfig.from_hf_dict(PHI4_MINI)
    assert (config.head_dim, config.rotary_dim, config.partial_rotary_factor) == (128, 96, 0.75)
    assert ModelConfig.from_hf_dict(PHI3_MINI | {"partial_rotary_factor": 1.0}).rotary_dim == 96
    with pytest.raises(UnsupportedArchitectureError, match=r"partial_rotary_factor must be 1\.0 for qwen2.*got 0\.5"):
        ModelConfig.from_hf_dict(PHI3_MINI | {"model_type": "qwen2", "partial_rotary_factor": 0.5})
    for bad in (0.0, 1.5, 0.01, 0.7):  # rotary dims 0, 144, 1 and 67 of 96
        with pytest.raises(ModelFormatError, match="partial_rotary_factor must give an even rotary dimension"):
            ModelConfig.from_hf_dict(PHI3_MINI | {"partial_rotary_factor": bad})


@pytest.mark.parametrize("model_type", ["phi3small", "phimoe"])
def test_phi3_small_and_phimoe_are_refused_by_name(model_type):
    with pytest.raises(UnsupportedArchitectureError, match=f"model_type '{model_type}' is not supported") as e:
        ModelConfig.from_hf_dict(PHI3_MINI | {"model_type": model_type})
    # the message names every config.json model_type kvgen reads (README, Notes), not only its decoders' own types
    # (it said "kvgen supports llama, gpt2, gemma3_text, gemma2, gpt_oss", leaving out mistral, qwen2, phi3, ...)
    for accepted in ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "ernie4_5",
                     "gemma3_text", "gemma2", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        assert f" {accepted}," in str(e.value) + ","
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
    dimensions: the window bounds the context; fewer rotary dimensions than the head (Phi-4-mini: 96 of 128) give the
    partial factor, an odd count is refused, and so is a partial count in a llama file (interleaved pairs)."""
    config = ModelConfig.from_gguf_metadata(_phi3_meta())
    assert (config.model_type, config.extra["gguf_architecture"]) == ("llama", "phi3")
    assert (config.hidden_size, config.head_dim, config.vocab_size, config.max_position_embeddings) == (3072, 96, 32064,
                                                                                                     2047)
    assert ModelConfig.from_gguf_metadata(_phi3_meta(**{"attention.sliding_window": 0})).max_position_embeddings == 4096
    partial = ModelConfig.from_gguf_metadata(_phi3_meta(**{"rope.dimension_count": 72}))
    assert (partial.head_dim, partial.rotary_dim, partial.partial_rotary_factor) == (96, 72, 0.75)
    with pytest.raises(ModelFormatError, match="rope.dimension_count must be an even number in .2, head_dim = 96., got 71"):
        ModelConfig.from_gguf_metadata(_phi3_meta(**{"rope.dimension_count": 71}))
    llama = {k.replace("phi3.", "llama."): v for k, v in _phi3_meta(**{"rope.dimension_count": 72}).items()}
    with pytest.raises(UnsupportedArchitectureError, match=r"rope.dimension_count=72, head_dim=96.*not llama"):
        ModelConfig.from_gguf_metadata(llama | {"general.architecture": "llama"})


SMOLLM3_3B = {"model_type": "smollm3", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
              "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 65536, "rope_theta": 5000000.0, "no_rope_layer_interval": 4,
              "use_sliding_window": False, "tie_word_embeddings": True}


def test_smollm3_no_rope_layers_from_config_json_and_gguf_agree():
    """SmolLM3-3B: every 4th layer without RoPE, whether config.json lists the flags, only the interval, or a GGUF
    file (llama.cpp's fixed step of 4) says nothing; flags of another length are refused."""
    import transformers

    want = transformers.SmolLM3Config(num_hidden_layers=36).no_rope_layers  # transformers' own default
    assert ModelConfig.from_hf_dict(SMOLLM3_3B).no_rope_layers == want
    assert want.count(0) == 9 and want[3] == 0 and want[2] == 1
    listed = [1, 0] * 18
    assert ModelConfig.from_hf_dict(SMOLLM3_3B | {"no_rope_layers": listed}).no_rope_layers == listed
    meta = {"general.architecture": "smollm3", "smollm3.block_count": 36, "smollm3.embedding_length": 2048,
            "smollm3.feed_forward_length": 11008, "smollm3.attention.head_count": 16, "smollm3.vocab_size": 128256}
    assert ModelConfig.from_gguf_metadata(meta).no_rope_layers == want
    assert ModelConfig.from_gguf_metadata(meta | {"general.architecture": "llama"} | {
        k.replace("smollm3", "llama"): v for k, v in meta.items() if k.startswith("smollm3")}).no_rope_layers is None
    with pytest.raises(ModelFormatError, match="no_rope_layers must hold a 0 or 1 per layer"):
        ModelConfig.from_hf_dict(SMOLLM3_3B | {"no_rope_layers": [1, 0]})
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window"):
        ModelConfig.from_hf_dict(SMOLLM3_3B | {"use_sliding_window": True, "sliding_window": 4096,
                                               "layer_types": ["sliding_attention"] * 36})


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral", "phi3", "smollm3"])
def test_values_left_out_of_config_json_are_transformers_defaults(tmp_path, model_type):
    """save_pretrained leaves out every value equal to its config class's default (SmolLM3's tied embeddings, Phi-3's
    eps, Mistral's window): kvgen reads the directory's config.json as transformers does."""
    import json

    import transformers

    cls = transformers.AutoConfig.for_model(model_type).__class__
    cls(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    reference = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf_dict(saved)
    for name in ("vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(reference, name), name
    window = getattr(reference, "sliding_window", None)
    expected = min(reference.max_position_embeddings, window or reference.max_position_embeddings)
    if getattr(reference, "rope_scaling", None) is None:
        assert ours.max_position_embeddings == expected


def test_gemma3_config_json_reads_as_transformers_does(tmp_path):
    """A Gemma3TextConfig's config.json with the class defaults left out (the vocabulary, the window, the scale, both
    RoPE bases, head_dim, tied embeddings) reads as transformers reads it; a Hub-style config.json with
    ``sliding_window_pattern`` and no ``layer_types`` gets transformers' layer kinds (every 6th full)."""
    import json

    import transformers

    transformers.Gemma3TextConfig(num_hidden_layers=7, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                  intermediate_size=128).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    defaults = ("vocab_size", "sliding_window", "query_pre_attn_scalar", "rope_local_base_freq", "rope_theta",
                "head_dim", "tie_word_embeddings", "max_position_embeddings", "hidden_activation", "rms_norm_eps")
    minimal = {k: v for k, v in saved.items() if k not in defaults}  # as a config.json may leave them out
    reference = transformers.Gemma3TextConfig(**minimal)
    assert reference.sliding_window == 4096 and reference.vocab_size == 262208
    ours = ModelConfig.from_hf_dict(minimal)
    for name in ("vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "head_dim", "sliding_window",
                 "query_pre_attn_scalar", "rope_local_base_freq", "max_position_embeddings", "layer_types"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert (ours.model_type, ours.use_qk_norm, ours.hidden_act) == ("gemma3_text", True, "gelu_pytorch_tanh")
    hub = {k: v for k, v in saved.items() if k != "layer_types"} | {"sliding_window_pattern": 3}
    want = transformers.Gemma3TextConfig(**hub).layer_types
    assert ModelConfig.from_hf_dict(hub).layer_types == want and want[2] == "full_attention" and want[3] != want[2]
    with pytest.raises(ModelFormatError, match="layer_types must hold one of"):
        ModelConfig.from_hf_dict(saved | {"layer_types": ["sliding_attention"] * 6})
    with pytest.raises(UnsupportedArchitectureError, match="'gemma3' is not supported"):
        ModelConfig.from_hf_dict(saved | {"model_type": "gemma3"})  # Gemma3ForConditionalGeneration (multimodal)


TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 256, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_size": None}, "hidden_size must be an integer, got None"),
    ({"num_attention_heads": None}, "num_attention_heads must be an integer, got None"),
    ({"max_position_embeddings": None}, "max_position_embeddings must be an integer, got None"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 1}, "attention_bias must be true or false, got 1"),
    ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    ({"rope_theta": -10000.0}, "rope_theta must be a positive number, got -10000.0"),
    ({"rope_theta": math.nan}, "rope_theta must be a positive number, got nan"),
    ({"rope_theta": math.inf}, "rope_theta must be a positive number, got inf"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a number >= 0, got -1"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a number >= 0, got nan"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear rope_scaling lacks 'factor'"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "linear rope_scaling factor must be a positive number, got 0"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, "linear rope_scaling factor must be a positive number, got '2'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8}}, "llama3 rope_scaling lacks 'original_max_position_emb"),
    ({"rope_scaling": LLAMA3_SCALING | {"low_freq_factor": 0}}, "llama3 rope_scaling low_freq_factor must be a positive"),
    ({"rope_scaling": LLAMA3_SCALING | {"high_freq_factor": 1.0}},
     "llama3 rope_scaling low_freq_factor must be below high_freq_factor, got 1.0 and 1.0"),
    ({"rope_scaling": dict.fromkeys(LLAMA3_SCALING, 0) | {"rope_type": "llama3"}},
     "llama3 rope_scaling factor must be a positive number, got 0"),
    ({"model_type": "mistral", "sliding_window": "x"}, "sliding_window must be a positive integer, got 'x'"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ({"model_type": "smollm3", "no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive integer, got 0"),
    ({"model_type": "smollm3", "no_rope_layer_interval": "4"}, "no_rope_layer_interval must be a positive integer, got"),
])
def test_config_json_values_of_the_wrong_type_or_range_are_named(changes: dict, message: str) -> None:
    """Each of these escaped as TypeError, KeyError or ZeroDivisionError, or loaded and gave NaN logits."""
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        ModelConfig.from_hf_dict(TINY_LLAMA | changes)


@pytest.mark.parametrize(("config", "message"), [
    (TINY_LLAMA | {"rope_scaling": []}, "rope_scaling must be an object (or null), got []"),
    (TINY_LLAMA | {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": "linear"},
     "rope_scaling must be an object (or null), got 'linear'"),
    (PHI4_MINI | {"partial_rotary_factor": "0.75"}, "partial_rotary_factor must be a number, got '0.75'"),
    (PHI4_MINI | {"partial_rotary_factor": math.nan}, "partial_rotary_factor must give an even rotary dimension in "
                                                      "[2, head_dim = 128], got nan"),
    (PHI3_128K | {"rope_scaling": LONGROPE | {"short_factor": "x"}},
     "longrope rope_scaling short_factor must be a list of positive numbers, got 'x'"),
    (PHI3_128K | {"rope_scaling": LONGROPE | {"long_factor": [1.0] * 47 + ["x"]}},
     "longrope rope_scaling long_factor must be a list of positive numbers"),
    (PHI3_128K | {"rope_scaling": LONGROPE | {"attention_factor": "x"}},
     "longrope rope_scaling attention_factor must be a positive number, got 'x'"),
    (PHI3_128K | {"original_max_position_embeddings": "4096"},
     "original_max_position_embeddings must be a positive integer, got '4096'"),
])
def test_rope_settings_of_the_wrong_kind_are_named(config: dict, message: str) -> None:
    """Each escaped as AttributeError ('list' object has no attribute 'get'), TypeError or ValueError from float() or
    int(), without naming the setting."""
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        ModelConfig.from_hf_dict(config)


@pytest.mark.parametrize(("config", "message"), [
    (TINY_LLAMA | {"model_type": "smollm3", "no_rope_layers": 0}, "no_rope_layers must hold a 0 or 1 per layer (2), got 0"),
    (TINY_LLAMA | {"layer_types": 1}, "layer_types must hold one of"),
    (TINY_LLAMA | {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "layer_types": 5},
     "layer_types must hold one of"),
    (TINY_LLAMA | {"model_type": "smollm3", "layer_types": 5}, "layer_types must hold one of"),
    (TINY_LLAMA | {"model_type": "mistral", "num_attention_heads": 0}, "num_attention_heads must be positive, got 0"),
    (TINY_LLAMA | {"model_type": "qwen3_moe", "num_experts": 4, "mlp_only_layers": "x"},
     "mlp_only_layers must be a list of layer indices, got 'x'"),
    (TINY_LLAMA | {"model_type": "qwen3_moe", "num_experts": 4, "mlp_only_layers": [1, "x"]},
     "mlp_only_layers must be a list of layer indices, got [1, 'x']"),
    ({"model_type": "gpt2", "vocab_size": 128, "n_embd": None, "n_layer": 2, "n_head": 4},
     "n_embd must be an integer, got None"),
])
def test_per_layer_lists_and_sizes_of_the_wrong_kind_are_named(config: dict, message: str) -> None:
    """Each escaped as TypeError (object of type 'int' has no len(), 'int' and 'NoneType'), ValueError from int()
    or ZeroDivisionError (0 heads dividing hidden_size)."""
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        ModelConfig.from_hf_dict(config)


@pytest.mark.parametrize("changes", [{}, {"rope_scaling": LLAMA3_SCALING}, {"rms_norm_eps": 0.0},
                                     {"rope_scaling": {"type": "linear", "factor": 2}},
                                     {"model_type": "mistral", "sliding_window": None},
                                     {"model_type": "mistral", "sliding_window": 128}])
def test_valid_config_json_values_still_load(changes: dict) -> None:
    config = ModelConfig.from_hf_dict(TINY_LLAMA | changes)
    assert config.max_position_embeddings == (128 if changes.get("sliding_window") else 256)


@pytest.mark.parametrize(("changes", "message"), [
    ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of them (ints >= 0), got '2'"),
    ({"eos_token_id": -1}, "eos_token_id must be a token id or a list of them (ints >= 0), got -1"),
    ({"eos_token_id": [2, "3"]}, "eos_token_id must be a token id or a list of them (ints >= 0), got [2, '3']"),
    ({"bos_token_id": -1}, "bos_token_id must be a token id or a list of them (ints >= 0), got -1"),
    ({"pad_token_id": 10**6}, "pad_token_id must be in [0, 128), got 1000000"),
    ({"pad_token_id": -1}, "pad_token_id must be a token id or a list of them (ints >= 0), got -1"),
    ({"model_type": "mixtral", "num_local_experts": 0}, "mixtral num_local_experts must be a positive integer, got 0"),
    ({"model_type": "qwen3_moe", "num_experts": 0}, "qwen3_moe num_experts must be a positive integer, got 0"),
])
def test_config_json_token_ids_and_expert_counts_are_checked(changes: dict, message: str) -> None:
    """eos "2" was read as the ids of its characters; num_local_experts 0 loaded a Mixtral as a dense model."""
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        ModelConfig.from_hf_dict(TINY_LLAMA | changes)


def test_gpt2_configs_keep_their_default_ids_beyond_a_small_vocabulary() -> None:
    config = ModelConfig.from_hf_dict({"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2,
                                       "n_head": 4, "bos_token_id": 50256, "eos_token_id": 50256})
    assert config.eos_token_ids == [50256]


def test_a_gpt2_whose_heads_do_not_split_its_hidden_size_is_refused() -> None:
    """n_embd 64 over n_head 5 (transformers' GPT2Attention: ValueError 'embed_dim must be divisible by num_heads'):
    ModelFormatError naming both, from config.json and from a gpt2 GGUF file's metadata (kvgen loaded it and its
    first forward failed with a RuntimeError from view)."""
    with pytest.raises(ModelFormatError, match=re.escape("hidden_size (64) must be a multiple of num_attention_heads (5)")):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 5})
    meta = {"general.architecture": "gpt2", "gpt2.vocab_size": 128, "gpt2.embedding_length": 64,
            "gpt2.block_count": 2, "gpt2.attention.head_count": 5, "gpt2.feed_forward_length": 256,
            "gpt2.context_length": 32, "gpt2.attention.layer_norm_epsilon": 1e-5}
    with pytest.raises(ModelFormatError, match=re.escape("hidden_size (64) must be a multiple of num_attention_heads (5)")):
        ModelConfig.from_gguf_metadata(meta)
    assert ModelConfig.from_gguf_metadata(meta | {"gpt2.attention.head_count": 4}).head_dim == 16


def test_a_gpt2_with_cross_attention_is_refused_by_name() -> None:
    """add_cross_attention (an encoder-decoder's GPT-2 decoder): refused naming the setting (kvgen loaded such a
    config without its crossattention weights, and with them listed them as unexpected keys)."""
    cfg = {"model_type": "gpt2", "vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4}
    with pytest.raises(UnsupportedArchitectureError, match="add_cross_attention"):
        ModelConfig.from_hf_dict(cfg | {"add_cross_attention": True})
    assert ModelConfig.from_hf_dict(cfg | {"add_cross_attention": False}).num_attention_heads == 4


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_a_rope_scaling_naming_no_type_is_refused_as_transformers_refuses_it(model_type: str) -> None:
    """It loaded as plain RoPE, silently wrong for a model trained with scaling; transformers' config classes raise
    (``rope_config_validation``: a KeyError), as vLLM's ``patch_rope_scaling_dict`` does."""
    import transformers

    config = TINY_LLAMA | {"model_type": model_type, "rope_scaling": {"factor": 4.0}}
    if model_type == "gemma3_text":
        config |= {"hidden_activation": "gelu_pytorch_tanh", "head_dim": 16}
    reference = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "rope_scaling"})
    with pytest.raises(KeyError):
        type(reference)(**{k: v for k, v in config.items() if k != "model_type"})
    with pytest.raises(ModelFormatError, match=re.escape("rope_scaling has no rope_type (nor type)")):
        ModelConfig.from_hf_dict(config)
    assert not ModelConfig.from_hf_dict(config | {"rope_scaling": {}}).rope_scaling  # an empty one is none


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "type": "dynamic", "factor": 2.0},
                                     {"rope_type": None, "type": "linear", "factor": 2.0}])
def test_rope_scaling_type_and_rope_type_are_read_as_transformers_reads_them(model_type: str, scaling: dict) -> None:
    """LlamaConfig (and the configs made from it: Qwen2, Qwen3, SmolLM3, ...) copies the legacy ``type`` over
    ``rope_type``, so ``type`` wins there; MistralConfig does not. kvgen read ``rope_type`` first everywhere (a
    ``rope_type: null`` beside a ``type`` was even refused as naming no type)."""
    import transformers

    from kvgen.rope_scaling import rope_scaling_type

    config = TINY_LLAMA | {"model_type": model_type, "rope_scaling": dict(scaling)}
    reference = type(transformers.AutoConfig.for_model(model_type))(
        **{k: v for k, v in config.items() if k != "model_type"} | {"rope_scaling": dict(scaling)})
    expected = reference.rope_scaling.get("rope_type", reference.rope_scaling.get("type"))
    if expected is None:  # transformers cannot build a model from it either
        with pytest.raises(ModelFormatError, match="no rope_type"):
            ModelConfig.from_hf_dict(config)
        return
    assert rope_scaling_type(ModelConfig.from_hf_dict(config).rope_scaling or {}) == expected
