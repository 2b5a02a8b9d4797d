"""A Hugging Face directory's ``generation_config.json`` gives generate() its defaults, as transformers'
``model.generation_config`` does: the same tokens as transformers' generate() on the directory with no settings,
settings passed as keyword arguments (or CLI flags) winning over it, a bad file refused naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from kvgen.cli import main
from kvgen.errors import ModelFormatError
from kvgen.generation import GenerationConfig, generate
from kvgen.loader import load_model

PROMPT = [[5, 17, 42, 8, 61, 3, 29, 11]]
GREEDY_FILE = {"bos_token_id": 1, "eos_token_id": 2, "repetition_penalty": 1.8, "no_repeat_ngram_size": 2,
               "max_new_tokens": 9, "max_length": 4096, "cache_implementation": "hybrid"}  # the last: not ours
SAMPLING_FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_k": 5,
                 "max_new_tokens": 8}


def _dir(tiny_model_dir, tmp_path, settings: dict):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "generation_config.json").write_text(json.dumps(settings))
    return path


def _hf(path, seed: int | None = None, **kwargs) -> list[int]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor(PROMPT)
    with torch.random.fork_rng():
        torch.manual_seed(seed or 0)
        with torch.inference_mode():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_no_settings_means_the_directorys_generation_config(tiny_model_dir, tmp_path):
    plain = generate(load_model(tiny_model_dir)[0], torch.tensor(PROMPT), max_new_tokens=9).new_token_ids[0]
    path = _dir(tiny_model_dir, tmp_path, GREEDY_FILE | {"suppress_tokens": [plain[0]]})
    model, _ = load_model(path)
    assert model.generation_defaults == {k: (GREEDY_FILE | {"suppress_tokens": [plain[0]]})[k] for k in (
        "repetition_penalty", "no_repeat_ngram_size", "max_new_tokens", "max_length", "suppress_tokens",
        "eos_token_id")}
    ours = generate(model, torch.tensor(PROMPT)).new_token_ids[0]
    assert ours == _hf(path) and ours != plain  # the file's processors and max_new_tokens, as transformers reads them
    overridden = generate(model, torch.tensor(PROMPT), repetition_penalty=1.0, suppress_tokens=None).new_token_ids[0]
    assert overridden == _hf(path, repetition_penalty=1.0, suppress_tokens=None)


@pytest.mark.parametrize("max_length", [12, 20])
def test_the_files_max_length_is_the_total_length_unless_it_is_transformers_default(tiny_model_dir, tmp_path,
                                                                                   max_length):
    """transformers takes the file's max_length as prompt + new tokens when the caller sets no length, except its
    own default 20, which stays 20 new tokens."""
    path = _dir(tiny_model_dir, tmp_path, {"bos_token_id": 1, "eos_token_id": None, "max_length": max_length})
    ours = generate(load_model(path)[0], torch.tensor(PROMPT)).new_token_ids[0]
    assert ours == _hf(path, eos_token_id=None)
    assert len(ours) == (max_length - len(PROMPT[0]) if max_length != 20 else 20)
    for explicit in (6, 20):  # 20, kvgen's default value, given explicitly still wins (transformers' default: None)
        assert len(generate(load_model(path)[0], torch.tensor(PROMPT), max_new_tokens=explicit).new_token_ids[0]) \
            == explicit
        cfg = GenerationConfig(max_new_tokens=explicit)
        assert len(generate(load_model(path)[0], torch.tensor(PROMPT), None, cfg).new_token_ids[0]) == explicit


def test_sampling_defaults_and_flags_that_override_them(tiny_model_dir, tmp_path, capsys):
    path = _dir(tiny_model_dir, tmp_path, SAMPLING_FILE)
    model, _ = load_model(path)
    sampled = generate(model, torch.tensor(PROMPT), seed=3).new_token_ids[0]
    assert sampled == _hf(path, seed=3)[:len(sampled)]
    greedy = generate(model, torch.tensor(PROMPT), do_sample=False).new_token_ids[0]
    assert greedy == _hf(path, do_sample=False)[:len(greedy)] and greedy != sampled
    # kvgen generate: --temperature 0 is greedy although the file samples (a flag equal to a default still wins)
    code = main(["generate", "--model", str(path), "--temperature", "0", "--max-new-tokens", "8", "--json",
                 "--eos-token-id", "2"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["token_ids"] == generate(model, torch.tensor([report["prompt_token_ids"]]),
                                           do_sample=False).new_token_ids[0]


def test_a_bad_generation_config_is_refused_naming_the_file(tiny_model_dir, tmp_path):
    path = _dir(tiny_model_dir, tmp_path, {"top_p": 7})
    with pytest.raises(ModelFormatError, match=r"generation_config\.json: top_p must be in \(0, 1\], got 7"):
        load_model(path)


def test_a_config_with_temperature_zero_is_greedy_though_the_file_samples(tiny_model_dir, tmp_path):
    """transformers' edge case: a generation_config with temperature 0.0 keeps do_sample=False over the model's
    do_sample=True (keyword arguments get no such help: temperature=0.0 with the file's sampling is refused there)."""
    path = _dir(tiny_model_dir, tmp_path, SAMPLING_FILE)
    model, _ = load_model(path)
    ours = generate(model, torch.tensor(PROMPT), None, GenerationConfig(temperature=0.0)).new_token_ids[0]
    assert ours == _hf(path, generation_config=transformers.GenerationConfig(temperature=0.0))
    assert ours == _hf(path, do_sample=False)
    with pytest.raises(ValueError, match="temperature=0.0 conflicts with do_sample=True"):
        generate(model, torch.tensor(PROMPT), temperature=0.0)


def test_an_explicit_min_new_tokens_of_0_wins_over_the_files_min_new_tokens(tiny_model_dir, tmp_path):
    """transformers' min_new_tokens defaults to None: a generation_config's 0, as a keyword's, is the caller's and
    lets EOS come first although the file says min_new_tokens=3."""
    first = generate(load_model(tiny_model_dir)[0], torch.tensor(PROMPT), max_new_tokens=1).new_token_ids[0][0]
    path = _dir(tiny_model_dir, tmp_path, {"bos_token_id": 1, "eos_token_id": first, "min_new_tokens": 3})
    model, _ = load_model(path)
    cfg = GenerationConfig(min_new_tokens=0, max_new_tokens=6)
    ours = generate(model, torch.tensor(PROMPT), None, cfg).new_token_ids[0]
    assert ours == _hf(path, generation_config=transformers.GenerationConfig(min_new_tokens=0, max_new_tokens=6))
    assert ours == [first]
    assert generate(model, torch.tensor(PROMPT), min_new_tokens=0, max_new_tokens=6).new_token_ids[0] == [first]
    kept = generate(model, torch.tensor(PROMPT), None, GenerationConfig(max_new_tokens=6)).new_token_ids[0]
    assert kept == _hf(path, generation_config=transformers.GenerationConfig(max_new_tokens=6)) and len(kept) > 1


def test_the_files_min_new_tokens_may_exceed_the_runs_max_new_tokens(tiny_model_dir, tmp_path):
    """transformers takes a model's min_new_tokens above the run's max_new_tokens (the file's, the default 20, the
    caller's, or what max_length leaves): EOS is suppressed to the end, no error (a caller's own pair is refused)."""
    first = generate(load_model(tiny_model_dir)[0], torch.tensor(PROMPT), max_new_tokens=1).new_token_ids[0][0]
    path = _dir(tiny_model_dir, tmp_path, {"bos_token_id": 1, "eos_token_id": first, "min_new_tokens": 25})
    model, _ = load_model(path)
    for kwargs, length in (({}, 20), ({"max_new_tokens": 3}, 3), ({"max_new_tokens": None, "max_length": 10}, 2)):
        ours = generate(model, torch.tensor(PROMPT), **kwargs).new_token_ids[0]
        assert ours == _hf(path, **kwargs) and len(ours) == length and first not in ours
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": first, "min_new_tokens": 4,
                                                             "max_new_tokens": 2}))
    ours = generate(load_model(path)[0], torch.tensor(PROMPT)).new_token_ids[0]
    assert ours == _hf(path) and len(ours) == 2 and first not in ours


@pytest.mark.parametrize("version", ["4.40.0", "4.49.0.dev0", "4.50.0.dev0", "4.55.4"])
def test_a_given_config_takes_only_the_special_tokens_of_a_file_older_than_4_50(tiny_model_dir, tmp_path, version):
    """transformers 4.55: a GenerationConfig passed to generate() takes the file's decoding defaults only when its
    transformers_version is 4.50 or later, else only its special tokens; keyword arguments take the whole file."""
    path = _dir(tiny_model_dir, tmp_path, GREEDY_FILE | {"transformers_version": version})
    model, _ = load_model(path)
    given = generate(model, torch.tensor(PROMPT), None, GenerationConfig(max_new_tokens=12)).new_token_ids[0]
    assert given == _hf(path, generation_config=transformers.GenerationConfig(max_new_tokens=12))
    keywords = generate(model, torch.tensor(PROMPT), max_new_tokens=12).new_token_ids[0]
    assert keywords == _hf(path, max_new_tokens=12)
    assert (given == keywords) == (version >= "4.50")


def test_a_given_configs_max_length_of_20_is_transformers_default_and_takes_the_files(tiny_model_dir, tmp_path):
    """transformers' GenerationConfig.max_length defaults to 20, so a passed config's max_length=20 counts as unset
    and the file's max_length fills it; a keyword max_length=20 still wins."""
    path = _dir(tiny_model_dir, tmp_path, {"bos_token_id": 1, "max_length": len(PROMPT[0]) + 3})
    model, _ = load_model(path)
    given = generate(model, torch.tensor(PROMPT), None, GenerationConfig(max_length=20)).new_token_ids[0]
    assert given == _hf(path, generation_config=transformers.GenerationConfig(max_length=20)) and len(given) == 3
    keyword = generate(model, torch.tensor(PROMPT), max_length=20).new_token_ids[0]
    assert keyword == _hf(path, max_length=20) and len(keyword) == 20 - len(PROMPT[0])
    # a file without max_length (or one older than 4.50, whose max_length a passed config does not take): transformers'
    # has_default_max_length makes the passed 20 mean 20 new tokens (kvgen gave 20 minus the prompt)
    for file in ({"bos_token_id": 1}, {"max_length": len(PROMPT[0]) + 3, "transformers_version": "4.40.0"}):
        path = _dir(tiny_model_dir, tmp_path / str(len(file)), file)
        model, _ = load_model(path)
        given = generate(model, torch.tensor(PROMPT), None, GenerationConfig(max_length=20)).new_token_ids[0]
        assert given == _hf(path, generation_config=transformers.GenerationConfig(max_length=20)) and len(given) == 20
