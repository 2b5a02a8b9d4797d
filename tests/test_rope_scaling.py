"""kvgen.rope_scaling: YaRN's frequencies and cos/sin scale against transformers' ``ROPE_INIT_FUNCTIONS["yarn"]``
(config.json rope_scaling, read through ``ModelConfig.from_hf_dict``) and llama.cpp's reading of a GGUF file's
rope.scaling keys; the variants kvgen refuses, by name."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvgen.config import ModelConfig
from kvgen.errors import ModelFormatError, UnsupportedArchitectureError
from kvgen.models.layers import rope_attention_factor, rope_inv_freq
from kvgen.rope_scaling import YARN_KEYS

# (head_dim, rope_theta, max_position_embeddings, rope_scaling) as config.json files write them
YARN_CONFIGS = {
    # gpt-oss: no rounding of the correction range (truncate false)
    "gpt_oss": (64, 150000.0, 131072, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
    "gpt_oss_truncated": (64, 150000.0, 131072, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "original_max_position_embeddings": 4096, "beta_slow": 1.0}),
    # Qwen2.5 / Qwen3 long context (the legacy "type" key), 4x over 32768
    "qwen3_4x": (128, 1e6, 131072, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # the same rope_scaling with max_position_embeddings left at Qwen3's 40960: transformers' factor is 40960 / 32768
    "qwen3_40960": (128, 1e6, 40960, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    # no original length: the factor as given over max_position_embeddings original positions
    "no_original_8x": (64, 10000.0, 4096, {"rope_type": "yarn", "factor": 8.0}),
    # DeepSeek-style mscale / mscale_all_dim (their ratio scales cos and sin), other betas
    "mscale": (64, 10000.0, 163840, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                     "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16.0, "beta_slow": 2.0}),
    "mscale_alone": (64, 10000.0, 16384, {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                          "original_max_position_embeddings": 4096}),
    "attention_factor": (96, 500000.0, 65536, {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.25,
                                               "original_max_position_embeddings": 8192, "truncate": False}),
}


def _hf_config(head_dim: int, theta: float, max_len: int, scaling: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    rope_theta=theta, max_position_embeddings=max_len, rope_scaling=scaling)


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_frequencies_and_scale_equal_transformers(name: str) -> None:
    """The frequencies equal transformers' bit for bit and the cos/sin scale to the last bit; each config puts some
    dimensions inside the ramp (neither the interpolated nor the extrapolated frequency), so a broken ramp shows."""
    head_dim, theta, max_len, scaling = YARN_CONFIGS[name]
    hf = _hf_config(head_dim, theta, max_len, scaling)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    config = ModelConfig.from_hf_dict(hf.to_dict())
    assert config.rope_scaling is not None and set(config.rope_scaling) == set(YARN_KEYS)
    got = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rope_attention_factor(config.rope_scaling) == want_scale
    plain = rope_inv_freq(head_dim, theta, None)
    factor = config.rope_scaling["factor"]
    blended = ~torch.isclose(got, plain, rtol=1e-6) & ~torch.isclose(got, plain / factor, rtol=1e-6)
    assert blended.any() and torch.equal(got[0], plain[0])  # the fastest dimension is never interpolated
    assert replace(config, max_position_embeddings=64).rope_scaling == config.rope_scaling  # kvgen's form as it is


def test_yarn_factor_and_scale_as_transformers_reads_them() -> None:
    """The factor is max_position_embeddings / original length whenever the original length is given (Qwen3's 40960
    positions: 1.25, not the 4 written), the scale 0.1 ln(factor) + 1 unless mscale / mscale_all_dim say otherwise."""
    scalings = {name: ModelConfig.from_hf_dict(_hf_config(*cfg).to_dict()).rope_scaling
                for name, cfg in YARN_CONFIGS.items()}
    assert scalings["qwen3_4x"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                                    "attention_factor": pytest.approx(0.1 * math.log(4) + 1)}
    assert scalings["qwen3_40960"]["factor"] == 1.25 and scalings["gpt_oss"]["truncate"] is False
    assert scalings["no_original_8x"]["original_max_position_embeddings"] == 4096
    assert scalings["mscale"]["attention_factor"] == pytest.approx((0.1 * math.log(40) + 1) / (0.08 * math.log(40) + 1))
    assert scalings["mscale_alone"]["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)  # needs both
    assert scalings["attention_factor"]["attention_factor"] == 1.25


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt_oss"])
def test_config_json_yarn_holding_every_key_of_kvgens_form_is_read_as_transformers_reads_it(model_type: str) -> None:
    """A config.json's yarn rope_scaling with all seven keys of kvgen's form (factor 8, original 32, attention_factor,
    betas, truncate) over 64 positions: transformers' factor is 64 / 32 = 2, not the 8 written; kvgen took the
    dict as already in its form and rotated by factor 8 (logits off by 3.6 on a tiny Qwen3)."""
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
               "beta_slow": 2.0, "attention_factor": 1.2, "truncate": False}
    assert set(scaling) == set(YARN_KEYS)
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "gpt_oss": transformers.GptOssConfig}[model_type]
    hf = cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=20, num_hidden_layers=2,
             rope_theta=100.0, max_position_embeddings=64, rope_scaling=scaling)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    config = ModelConfig.from_hf_dict(hf.to_dict())
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 2.0
    torch.testing.assert_close(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), want,
                               rtol=0, atol=0)
    assert rope_attention_factor(config.rope_scaling) == want_scale


def test_yarn_variants_kvgen_does_not_compute_are_refused_by_name() -> None:
    """A key transformers does not read (a dynamic YaRN's), another rope type, YaRN outside the Llama-family decoder
    (which applies the cos/sin scale) and bad values are refused naming what is wrong."""
    llama = _hf_config(*YARN_CONFIGS["qwen3_4x"]).to_dict()
    yarn = llama["rope_scaling"]
    with pytest.raises(UnsupportedArchitectureError, match="yarn rope_scaling key 'dynamic' is not supported"):
        ModelConfig.from_hf_dict(llama | {"rope_scaling": yarn | {"dynamic": True}})
    with pytest.raises(UnsupportedArchitectureError, match="rope_scaling type 'mrope' is not supported"):  # Qwen2-VL's
        ModelConfig.from_hf_dict(llama | {"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}})
    finetuned = ModelConfig.from_hf_dict(llama | {"rope_scaling": yarn | {"finetuned": True}})  # Yarn-Llama-2's
    assert finetuned.rope_scaling == ModelConfig.from_hf_dict(llama).rope_scaling
    with pytest.raises(ModelFormatError, match="yarn rope_scaling lacks 'factor'"):
        ModelConfig.from_hf_dict(llama | {"rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ModelFormatError, match="yarn rope_scaling original_max_position_embeddings must be a positive"):
        ModelConfig.from_hf_dict(llama | {"rope_scaling": yarn | {"original_max_position_embeddings": 0}})
    with pytest.raises(UnsupportedArchitectureError, match="gemma2 with a yarn rope_scaling is not supported"):
        ModelConfig(model_type="gemma2", vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    rope_scaling={"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("beta_fast", "x", "beta_fast must be a positive number, got 'x'"),
    ("beta_slow", [1], r"beta_slow must be a positive number, got \[1\]"),
    ("attention_factor", "x", "attention_factor must be a positive number, got 'x'"),
    ("mscale", "x", "mscale must be a positive number, got 'x'"),
    ("original_max_position_embeddings", 0.5, "original_max_position_embeddings must be a whole number of tokens"),
])
def test_yarn_values_of_the_wrong_kind_are_refused_by_name(key: str, value: object, message: str) -> None:
    """Each gave a bare ValueError / TypeError from float() (or a ZeroDivisionError: 0.5 original positions became
    0) instead of naming the key."""
    llama = _hf_config(*YARN_CONFIGS["qwen3_4x"]).to_dict()
    scaling = llama["rope_scaling"] | {key: value} | ({"mscale_all_dim": 1.0} if key == "mscale" else {})
    with pytest.raises(ModelFormatError, match=f"yarn rope_scaling {message}"):
        ModelConfig.from_hf_dict(llama | {"rope_scaling": scaling})


# ---------------------------------------------------------------- GGUF metadata

_QWEN3_META = {"general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.embedding_length": 512,
               "qwen3.feed_forward_length": 1024, "qwen3.attention.head_count": 4, "qwen3.attention.key_length": 128,
               "qwen3.rope.freq_base": 1e6, "qwen3.context_length": 131072, "qwen3.vocab_size": 64}
_YARN_KEYS = {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
              "qwen3.rope.scaling.original_context_length": 32768}


def test_gguf_yarn_keys_give_transformers_parameters() -> None:
    """A qwen3 file's rope.scaling keys as llama.cpp's converter writes them for a 4x Qwen3 give transformers'
    frequencies and scale; the optional betas and ``yarn_attn_factor`` (the converter's copy of an
    ``attention_factor``) are honoured, ``rope.scaling.attn_factor`` multiplies the scale as in llama.cpp."""
    config = ModelConfig.from_gguf_metadata(_QWEN3_META | _YARN_KEYS)
    hf = _hf_config(*YARN_CONFIGS["qwen3_4x"])
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert config.rope_scaling is not None and config.max_position_embeddings == 131072
    torch.testing.assert_close(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), want, rtol=0,
                               atol=0)
    assert rope_attention_factor(config.rope_scaling) == pytest.approx(want_scale, rel=1e-15)
    extra = {"qwen3.rope.scaling.yarn_beta_fast": 16.0, "qwen3.rope.scaling.yarn_beta_slow": 2.0,
             "qwen3.rope.scaling.yarn_attn_factor": 1.25}
    tuned = ModelConfig.from_gguf_metadata(_QWEN3_META | _YARN_KEYS | extra)
    hf = _hf_config(128, 1e6, 131072, YARN_CONFIGS["qwen3_4x"][3] | {"beta_fast": 16.0, "beta_slow": 2.0,
                                                                     "attention_factor": 1.25})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(tuned.head_dim, tuned.rope_theta, tuned.rope_scaling), want, rtol=0,
                               atol=0)
    assert rope_attention_factor(tuned.rope_scaling) == want_scale == 1.25
    scaled = ModelConfig.from_gguf_metadata(_QWEN3_META | _YARN_KEYS | {"qwen3.rope.scaling.attn_factor": 2.0})
    assert rope_attention_factor(scaled.rope_scaling) == pytest.approx(2 * (0.1 * math.log(4) + 1))


def test_gguf_rope_scaling_types_and_refusals() -> None:
    """No type (llama.cpp's linear) without a factor and ``none`` add nothing, ``linear`` divides the positions, an
    original length falls back to context_length; another type, an ext_factor other than 1 and a log multiplier are
    refused naming the key."""
    assert ModelConfig.from_gguf_metadata(_QWEN3_META).rope_scaling is None
    assert ModelConfig.from_gguf_metadata(_QWEN3_META | {"qwen3.rope.scaling.type": "none"}).rope_scaling is None
    linear = ModelConfig.from_gguf_metadata(_QWEN3_META | {"qwen3.rope.scaling.type": "linear",
                                                            "qwen3.rope.scaling.factor": 2.0})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    no_original = {k: v for k, v in _YARN_KEYS.items() if "original" not in k}
    scaling = ModelConfig.from_gguf_metadata(_QWEN3_META | no_original).rope_scaling
    assert scaling is not None and scaling["original_max_position_embeddings"] == 131072
    unset = ModelConfig.from_gguf_metadata(_QWEN3_META | _YARN_KEYS | {"qwen3.rope.scaling.yarn_ext_factor": -1.0})
    assert unset.rope_scaling == ModelConfig.from_gguf_metadata(_QWEN3_META | _YARN_KEYS).rope_scaling
    for key, value, match in (("qwen3.rope.scaling.type", "dynamic", "qwen3.rope.scaling.type 'dynamic'"),
                              ("qwen3.rope.scaling.yarn_ext_factor", 0.5, "qwen3.rope.scaling.yarn_ext_factor=0.5"),
                              ("qwen3.rope.scaling.yarn_log_multiplier", 0.1, "yarn_log_multiplier=0.1")):
        with pytest.raises(UnsupportedArchitectureError, match=match):
            ModelConfig.from_gguf_metadata(_QWEN3_META | _YARN_KEYS | {key: value})
