"""The model's generation_config.json as sampling defaults (vLLM's ``--generation-config auto``), in ``LLM``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgen.engine import EngineArgs, SamplingParams
from kvgen.engine.generation_defaults import (
    default_sampling_params,
    read_generation_config,
)
from kvgen.engine.llm import LLM
from kvgen.errors import ModelFormatError


def _with_generation_config(src: Path, dst: Path, config: dict) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **config}))
    return dst


def test_reads_the_sampling_keys_that_differ_from_transformers_defaults(tmp_path: Path) -> None:
    """As vLLM's get_diff_sampling_param: the six keys, values equal to GenerationConfig's defaults dropped, other
    keys ignored, max_new_tokens renamed max_tokens; 'vllm' reads nothing, a directory is read, override wins."""
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "min_p": None, "max_new_tokens": 7,
        "do_sample": True, "eos_token_id": [2, 3]}))
    assert read_generation_config(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7}
    assert default_sampling_params(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert default_sampling_params(tmp_path, "vllm") == {}
    assert default_sampling_params(None, str(tmp_path), '{"top_p": 0.5, "min_p": 0.1}') == {
        "temperature": 0.6, "top_p": 0.5, "max_tokens": 7, "min_p": 0.1}
    assert default_sampling_params(tmp_path / "model.gguf") == {}  # a file: no generation config
    assert default_sampling_params(tmp_path.parent) == {}  # a directory without one


def test_a_null_override_removes_the_files_value(tmp_path: Path) -> None:
    """vLLM's get_diff_sampling_param updates the file's config with the override and keeps the values that are not
    None: a null removes the file's default (SamplingParams' own applies), in 'auto' and 'vllm' alike."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                                 "max_new_tokens": 7}))
    override = '{"temperature": null, "max_new_tokens": null}'
    assert default_sampling_params(tmp_path, "auto", override) == {"top_p": 0.9}
    assert default_sampling_params(tmp_path, "vllm", {"top_p": None, "top_k": 5}) == {"top_k": 5}
    assert EngineArgs(override_generation_config=override).override_generation_config == {
        "temperature": None, "max_new_tokens": None}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"generation_config": "/no/such/dir"}, "generation_config must be 'auto', 'vllm' or a directory"),
    ({"override_generation_config": '{"temp": 1}'}, "override_generation_config keys must be among"),
    ({"override_generation_config": "[1]"}, "override_generation_config must be a JSON object"),
    ({"override_generation_config": "{bad"}, "override_generation_config must be JSON"),
    ({"override_generation_config": {"top_p": 1.5}}, "override_generation_config must hold values SamplingParams accepts: top_p must be"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_a_corrupt_generation_config_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*generation_config.json"):
        default_sampling_params(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature must be"):
        default_sampling_params(tmp_path)


@pytest.mark.parametrize(("config", "message"), [
    ('{"temperature": NaN}', "temperature must be a finite number >= 0 .*, got nan"),
    ('{"top_p": "0.9"}', "top_p must be in \\(0, 1\\], got '0.9'"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be an int in \\[1, 2147483647\\], got 0"),
])
def test_a_value_sampling_params_refuses_is_refused_naming_the_file_and_field(tmp_path: Path, config: str,
                                                                               message: str) -> None:
    (tmp_path / "generation_config.json").write_text(config)
    with pytest.raises(ModelFormatError, match=rf"generation_config\.json: {message}"):
        default_sampling_params(tmp_path)


def test_a_bad_file_value_an_override_replaces_or_removes_is_not_refused(tmp_path: Path) -> None:
    """vLLM merges override_generation_config over the file before anything reads the values, so a file value the
    override replaces (or removes with a null) never counts; kvgen refused the file first."""
    (tmp_path / "generation_config.json").write_text('{"temperature": NaN, "max_new_tokens": 0, "top_p": 0.9}')
    assert default_sampling_params(tmp_path, override={"temperature": 0.5, "max_new_tokens": None}) == {
        "temperature": 0.5, "top_p": 0.9}
    with pytest.raises(ModelFormatError, match=r"generation_config\.json: max_new_tokens must be"):
        default_sampling_params(tmp_path, override={"temperature": 0.5})


def test_llm_runs_without_sampling_params_on_the_models_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    """LLM.generate without sampling_params takes the directory's generation config (greedy with a repetition
    penalty, 6 new tokens): the tokens of the same settings passed explicitly, not those of SamplingParams()'s
    penalty-free greedy run; generation_config='vllm' ignores the file."""
    model_dir = _with_generation_config(tiny_model_dir, tmp_path / "m", {
        "temperature": 0.0, "repetition_penalty": 1.8, "max_new_tokens": 6})
    llm = LLM(str(model_dir), num_blocks=64)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=6)
    got = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=6)
    assert got == llm.generate(prompt, explicit, use_tqdm=False)[0].outputs[0].token_ids and len(got) == 6
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    assert got != plain
    assert LLM(str(model_dir), num_blocks=64, generation_config="vllm").get_default_sampling_params() == SamplingParams()
