"""kvgen.sampling.params: one rule table, applied the same way by GenerationConfig, SamplingParams and the CLI."""

import math

import pytest

from kvgen.cli import build_parser
from kvgen.engine.sampling_params import SamplingParams
from kvgen.generation.config import GenerationConfig
from kvgen.sampling.params import PARAM_RULES, check_param

# Fields both APIs have under the same name, with values on both sides of each bound.
SHARED = {
    "temperature": [0.0, 0.5, 1e6, -1e-9, -1.0, math.inf, math.nan],
    "top_k": [0, 1, 2**31 - 1, 2**31, 2**70, -2, 2.0],
    "top_p": [1.0, 1e-9, 0.0, 1.0000001, -0.5, math.nan],
    "min_p": [0.0, 1.0, -1e-9, 1.5],
    "repetition_penalty": [1.0, 1e-6, 1e6, 0.99e-6, 1.01e6, 0.0, 5e-324, -1.0, math.inf],
    "presence_penalty": [-2.0, 2.0, 2.0001, -3, math.nan],
    "frequency_penalty": [0.0, -2, 2.5],
    "best_of": [1, 5, 0, -1, 1.0],
    "seed": [0, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 1.5, "1"],
}


def _accepts(build, **kwargs) -> bool:
    try:
        build(**kwargs)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in SHARED.items() for v in values])
def test_generation_config_and_sampling_params_agree_with_the_table(name, value):
    expected = _accepts(check_param, name=name, value=value)
    extra = {"n": 1} if name == "best_of" else {}
    assert _accepts(SamplingParams, **{name: value}, **extra) is expected
    assert _accepts(GenerationConfig, **{name: value}, **({"do_sample": True} if name == "best_of" else {})) is expected


def test_counts_under_both_names_share_bounds():
    for gen_name, engine_name in [("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"), ("num_return_sequences", "n")]:
        a, b = PARAM_RULES[gen_name], PARAM_RULES[engine_name]
        assert (a.kind, a.low, a.high) == (b.kind, b.low, b.high)


def test_messages_name_the_field_and_value():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        check_param("top_p", 1.5)
    with pytest.raises(ValueError, match=r"^top_k must be an int in \[0, 2147483647\] \(0 = off\), got True$"):
        check_param("top_k", True)
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0 \(0 = greedy\), got nan$"):
        check_param("temperature", math.nan)


def test_vllm_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1.0)


@pytest.mark.parametrize(("flag", "value"), [("--temperature", "-1"), ("--top-p", "1.5"), ("--top-k", str(2**40)),
                                              ("--repetition-penalty", "5e-324"), ("--seed", str(2**64))])
def test_cli_refuses_what_the_table_refuses_while_parsing(flag, value):
    name = flag[2:].replace("-", "_")
    parser = build_parser()
    with pytest.raises(Exception, match=f"argument {flag}(/[-a-z]+)*: {name} must be"):  # with its llama.cpp alias
        parser.parse_args(["generate", "hi", flag, value])
    parser.parse_args(["generate", "hi", flag, "1"])  # an accepted value parses
