"""kvgen.engine.sampling_params: defaults, normalization and validation messages."""

import dataclasses

import pytest

from kvgen.engine.sampling_params import SAMPLING_EPS, RequestOutputKind, SamplingParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids) == ([], [])
    assert p.skip_special_tokens and p.detokenize and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.is_greedy


def test_spaces_between_special_tokens_is_accepted_as_vllm() -> None:
    """vLLM code passes ``spaces_between_special_tokens`` (default True); with a fast tokenizer vLLM ignores it, and
    kvgen decodes as one: accepted, checked as a bool."""
    assert SamplingParams().spaces_between_special_tokens is True
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be a bool, got 0"):
        SamplingParams(spaces_between_special_tokens=0)


def test_normalization() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off" spelling
    assert SamplingParams(top_k=7).top_k == 7


def test_seed_minus_one_means_no_seed_as_vllm() -> None:
    """vLLM's ``SamplingParams.__post_init__``: ``if self.seed == -1: self.seed = None`` (a random seed per request,
    where kvgen took -1 as a fixed seed: the same tokens on every call)."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0
    assert dataclasses.replace(SamplingParams(seed=5), seed=-1).seed is None


@pytest.mark.parametrize(
    ("temperature", "is_greedy"),
    [(0, True), (0.0, True), (SAMPLING_EPS / 2, False), (SAMPLING_EPS, False), (0.7, False)],
)
def test_is_greedy(temperature: float, is_greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


@pytest.mark.parametrize(("temperature", "expected"), [(SAMPLING_EPS / 2, 0.01), (0.005, 0.01), (0.01, 0.01),
                                                       (0.02, 0.02), (0.0, 0.0)])
def test_a_positive_temperature_below_0_01_is_raised_to_it_as_vllm(temperature: float, expected: float) -> None:
    """vLLM's ``SamplingParams.__post_init__``: ``if 0 < temperature < _MAX_TEMP (1e-2): temperature = _MAX_TEMP``
    (with a warning), before ``temperature < _SAMPLING_EPS`` picks greedy: so only 0 is greedy."""
    assert SamplingParams(temperature=temperature).temperature == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be an int in \[1, 2147483647\], got 0"),
        ({"n": 1.0}, r"n must be an int in \[1, 2147483647\], got 1.0"),
        ({"n": 3, "best_of": 2}, r"best_of must be >= n \(3\), got 2"),
        ({"temperature": -0.5}, r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": -2}, r"top_k must be an int in \[0, 2147483647\] \(0 = off\), got -2"),
        ({"top_k": 2.0}, r"top_k must be an int in .*, got 2.0"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\], got 1.1"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[1e-06, 1000000\], got 0.0"),
        ({"repetition_penalty": float("inf")}, r"repetition_penalty must be in \[1e-06, 1000000\], got inf"),
        ({"repetition_penalty": 5e-324}, r"repetition_penalty must be in \[1e-06, 1000000\], got 5e-324"),
        ({"top_k": 2**70}, r"top_k must be an int in \[0, 2147483647\] \(0 = off\), got 1180591620717411303424"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ({"max_tokens": 0}, r"max_tokens must be an int in \[1, 2147483647\], got 0"),
        ({"min_tokens": -1}, r"min_tokens must be an int in \[0, 2147483647\], got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens must be <= max_tokens \(10\), got 20"),
        ({"logprobs": -2}, r"logprobs must be an int in \[0, 2147483647\], got -2"),  # -1: the vocabulary (vLLM)
        ({"prompt_logprobs": -2}, r"prompt_logprobs must be an int in \[0, 2147483647\], got -2"),
        ({"prompt_logprobs": 1.0}, r"prompt_logprobs must be an int"),
        ({"seed": 2**64}, r"seed must be an int in \[-9223372036854775808, 18446744073709551615\], got 18446744073709551616"),
        ({"seed": "1"}, r"seed must be an int in .*, got '1'"),
        ({"stop": ""}, "stop must be a non-empty string or a list of them, got ''"),
        ({"stop": ["ok", ""]}, "stop must be a non-empty string"),
        ({"stop": 3}, "stop must be a non-empty string"),
        ({"stop_token_ids": [1, -2]}, r"stop_token_ids must be a list of ints >= 0, got \[1, -2\]"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'"),
        ({"logit_bias": {5: 101}}, r"logit_bias values must be numbers in \[-100, 100\], got 101 for token 5"),
        ({"logit_bias": {-1: 1}}, r"logit_bias keys must be token ids \(ints >= 0\), got -1"),
        ({"logit_bias": [1]}, "logit_bias must be a dict of token id -> bias"),
        ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be -1 or an int in \[1, 2147483647\], got 0"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1 or an int"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens must be -1 or an int"),
        ({"detokenize": False, "stop": "."}, r"detokenize=False conflicts with stop=\['\.'\]"),
        ({"detokenize": 0}, "detokenize must be a bool, got 0"),
        # None only where the field is optional (it failed inside the engine's step before)
        ({"temperature": None}, "temperature must be a finite number >= 0 .*, got None"),
        ({"repetition_penalty": None}, r"repetition_penalty must be in \[1e-06, 1000000\], got None"),
        ({"min_tokens": None}, r"min_tokens must be an int in \[0, 2147483647\], got None"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be a list of non-empty token id lists"),
        ({"bad_words_token_ids": [[-1]]}, r"bad_words_token_ids must be a list of ints >= 0, got \[-1\]"),
    ],
)
def test_validation_names_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_accepted_edge_values() -> None:
    p = SamplingParams(n=2, best_of=2, temperature=0, top_p=1, min_p=1, max_tokens=None, min_tokens=5, logprobs=0)
    assert p.is_greedy and p.max_tokens is None and p.logprobs == 0
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_replace_revalidates() -> None:
    # The front door derives child params with dataclasses.replace; bad values still raise.
    child = dataclasses.replace(SamplingParams(n=4, seed=7, stop="x"), n=1, seed=8)
    assert (child.n, child.seed, child.stop) == (1, 8, ["x"])
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(child, top_p=2.0)


def test_clone_is_a_deep_copy_as_vllm() -> None:
    """vLLM's ``SamplingParams.clone()``: an equal copy whose lists are not shared."""
    p = SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={1: 2.0}, seed=4)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    assert p.stop == ["x"]


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_true_means_one_as_vllm(field: str) -> None:
    """vLLM's ``SamplingParams.__post_init__``: ``if self.logprobs is True: self.logprobs = 1`` (prompt_logprobs the
    same); False passes its checks and counts as 0. kvgen refused both as non-ints."""
    assert getattr(SamplingParams(**{field: True}), field) == 1
    assert getattr(SamplingParams(**{field: False}), field) == 0
    assert type(getattr(SamplingParams(**{field: True}), field)) is int


def test_stop_token_ids_and_bad_words_drop_repeats_as_vllm() -> None:
    """vLLM's ``__post_init__``: ``stop_token_ids = list(dict.fromkeys(stop_token_ids))``, the same for ``bad_words``
    (None becoming []); ``stop`` keeps its repeats. kvgen kept repeated ids and words, and bad_words None."""
    ids, words, stops = [5, 3, 5, 1, 3], ["b", "a", "b"], ["x", "x"]
    p = SamplingParams(stop_token_ids=ids, bad_words=words, stop=stops)
    assert p.stop_token_ids == list(dict.fromkeys(ids)) == [5, 3, 1]
    assert p.bad_words == list(dict.fromkeys(words)) == ["b", "a"]
    assert p.stop == stops
    assert SamplingParams().bad_words == []


def test_greedy_turns_the_filters_off_as_vllm() -> None:
    """vLLM's ``__post_init__``: after ``_verify_args``, ``temperature < _SAMPLING_EPS`` sets ``top_p = 1.0``,
    ``top_k = 0``, ``min_p = 0.0`` (greedy ignores them); out-of-range values are still refused first. kvgen kept
    the given values on a greedy request."""
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    sampled = SamplingParams(temperature=0.5, top_p=0.5, top_k=7, min_p=0.3)
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 7, 0.3)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(temperature=0.0, top_p=1.5)


def test_extra_args_are_kept_for_the_callers_code_as_vllm() -> None:
    """vLLM's ``SamplingParams.extra_args: dict[str, Any] | None`` (for plugins and custom samplers; no in-tree
    sampler reads it): kvgen raised TypeError (unexpected keyword argument); now kept, deep-copied by clone()."""
    extra = {"plugin": {"alpha": 0.5}}
    p = SamplingParams(extra_args=extra)
    assert p.extra_args == extra and SamplingParams().extra_args is None
    assert p.clone().extra_args == extra and p.clone().extra_args is not p.extra_args
    with pytest.raises(ValueError, match=r"extra_args must be a dict, got \['x'\]"):
        SamplingParams(extra_args=["x"])


def test_from_optional_fills_none_and_clamps_logit_bias_as_vllm() -> None:
    """vLLM's ``SamplingParams.from_optional`` (what its ``LLM.get_default_sampling_params`` and OpenAI server call):
    None means the default for n, the penalties, temperature and top_p; logit_bias keys go through ``int()`` and values
    are clamped with ``min(100.0, max(-100.0, bias))``. kvgen had no from_optional (AttributeError)."""
    bias = {"5": 250.0, 7: -300, "9": 1.5}
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                     frequency_penalty=None, repetition_penalty=None, logit_bias=bias, max_tokens=4)
    assert p == SamplingParams(logit_bias={int(k): min(100.0, max(-100.0, v)) for k, v in bias.items()}, max_tokens=4)
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 1.5}
    assert SamplingParams.from_optional(temperature=0.5, seed=3).seed == 3
    with pytest.raises(ValueError, match=r"logit_bias contains key\(s\) that cannot be converted .*\['x'\]"):
        SamplingParams.from_optional(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_optional(top_p=2.0)
    with pytest.raises(ValueError, match="logit_bias values must be numbers in .*got nan"):  # not clamped to -100
        SamplingParams.from_optional(logit_bias={"5": float("nan")})
    huge = SamplingParams.from_optional(logit_bias={1: float("inf"), 2: -float("inf"), 3: 10**400})
    assert huge.logit_bias == {1: 100.0, 2: -100.0, 3: 100.0}  # clamped as vLLM's min/max


def test_numpy_bools_are_bools_as_vllm_takes_them():
    import numpy as np

    params = SamplingParams(ignore_eos=np.True_, skip_special_tokens=np.False_)
    assert params.ignore_eos is True and params.skip_special_tokens is False
    with pytest.raises(ValueError, match="ignore_eos must be a bool, got 'no'"):
        SamplingParams(ignore_eos="no")
