"""GenerationConfig: model defaults for EOS and pad (as transformers fills them)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model

from kvgen.generation import GenerationConfig, generate


def test_model_defaults_fill_eos_and_pad_from_the_model() -> None:
    cfg = GenerationConfig().with_model_defaults([5, 7], None)
    assert (cfg.eos_token_id, cfg.pad_token_id) == ([5, 7], 5)  # pad falls back to the first EOS, as HF
    cfg = GenerationConfig(pad_token_id=3).with_model_defaults([5], 9)
    assert (cfg.eos_token_id, cfg.pad_token_id) == ([5], 3)


def test_empty_eos_list_disables_eos_and_leaves_pad_unset() -> None:
    cfg = GenerationConfig(eos_token_id=[]).with_model_defaults([5], None)
    assert (cfg.eos_token_id, cfg.pad_token_id) == ([], None)


def test_generate_with_eos_disabled_runs_to_max_new_tokens() -> None:
    tiny = make_tiny_model("llama", std=0.5)
    ids = torch.tensor([[1, 2, 3]])
    greedy = generate(tiny.ours, ids, None, GenerationConfig(max_new_tokens=4))
    first = greedy.new_token_ids[0][0]  # make the first greedy token an EOS: without the [] it would stop there
    tiny.ours.config.eos_token_id = first
    stopped = generate(tiny.ours, ids, None, GenerationConfig(max_new_tokens=4))
    assert stopped.new_token_ids[0] == [first] and stopped.finish_reasons == ["stop"]
    out = generate(tiny.ours, ids, None, GenerationConfig(max_new_tokens=4, eos_token_id=[]))
    assert out.new_token_ids == greedy.new_token_ids and out.finish_reasons == ["length"]


def test_an_explicit_min_new_tokens_of_0_replaces_min_length_as_transformers() -> None:
    """transformers' min_new_tokens defaults to None: any value given, 0 included, makes min_length the prompt's
    length + min_new_tokens, so an EOS may come first; the default leaves min_length in force."""
    tiny = make_tiny_model("llama", std=0.5)
    ids = torch.tensor([[1, 2, 3]])
    first = generate(tiny.ours, ids, None, GenerationConfig(max_new_tokens=1, eos_token_id=[])).new_token_ids[0][0]
    settings = {"max_new_tokens": 4, "eos_token_id": first, "pad_token_id": 0, "min_length": 6}
    with torch.inference_mode():
        want = tiny.ref.generate(ids, attention_mask=torch.ones_like(ids), min_new_tokens=0, **settings)  # [1, T']
        banned = tiny.ref.generate(ids, attention_mask=torch.ones_like(ids), **settings)  # [1, T']
    assert want[0, 3:].tolist() == [first] and banned.shape[1] > 4  # EOS first, unless min_length bans it
    assert generate(tiny.ours, ids, None, min_new_tokens=0, **settings).sequences.tolist() == want.tolist()
    assert generate(tiny.ours, ids, None, GenerationConfig(min_new_tokens=0, **settings)).sequences.tolist() == \
        want.tolist()
    assert generate(tiny.ours, ids, None, **settings).sequences.tolist() == banned.tolist()


def test_every_transformers_setting_is_a_field_or_named_as_unimplemented() -> None:
    """transformers 4.55's GenerationConfig keys are kvgen fields (HF names) or in UNIMPLEMENTED_HF_FIELDS, whose
    names are a NotImplementedError naming the feature, never "unknown setting"."""
    import dataclasses

    import transformers

    from kvgen.generation.config import (
        HF_METADATA_KEYS,
        UNIMPLEMENTED_HF_FIELDS,
        check_setting_names,
    )

    ours = {f.name for f in dataclasses.fields(GenerationConfig)}
    theirs = set(transformers.GenerationConfig().to_dict()) - set(HF_METADATA_KEYS)
    assert theirs - ours == set(UNIMPLEMENTED_HF_FIELDS)
    for name, feature in UNIMPLEMENTED_HF_FIELDS.items():
        with pytest.raises(NotImplementedError, match=f"transformers' {name} \\({feature}\\)"):
            check_setting_names({name: 1})
    assert GenerationConfig(disable_compile=True).disable_compile


def test_defaults_are_transformers_defaults() -> None:
    """Every field transformers 4.55's GenerationConfig has takes its default there, but for the lengths (20 new
    tokens as max_new_tokens, not max_length), output_logits and return_dict_in_generate (bools, one output type)
    and cache_implementation (always a kvgen cache). num_assistant_tokens_schedule was 'heuristic', not 'constant'."""
    import dataclasses

    import transformers

    theirs = transformers.GenerationConfig()
    differ = {f.name for f in dataclasses.fields(GenerationConfig)
              if hasattr(theirs, f.name) and getattr(theirs, f.name) != getattr(GenerationConfig(), f.name)}
    assert differ == {"max_new_tokens", "max_length", "min_new_tokens", "output_logits", "return_dict_in_generate",
                      "cache_implementation"}


def test_constructor_names_unknown_and_unimplemented_settings_as_generate_does() -> None:
    """README: a transformers setting kvgen lacks is a NotImplementedError naming it, a misspelt one a ValueError;
    GenerationConfig(...) said neither (the dataclass's TypeError "unexpected keyword argument")."""
    with pytest.raises(NotImplementedError, match=r"token_healing \(token healing\)"):
        GenerationConfig(token_healing=True)
    with pytest.raises(NotImplementedError, match=r"assistant_early_exit"):
        GenerationConfig(max_new_tokens=4, assistant_early_exit=2)
    with pytest.raises(ValueError, match=r"unknown generation setting\(s\) \['tmperature'\]"):
        GenerationConfig(tmperature=0.5)
    cfg = GenerationConfig(max_new_tokens=4, low_memory=True)  # accepted, as the README says
    assert cfg.replace(top_k=3).top_k == 3 and cfg.low_memory


def test_stop_strings_take_a_string_or_a_list_of_strings_only() -> None:
    """transformers takes one string as one stop string and fails iterating anything else ("'int' object is not
    iterable"); kvgen names the field and the value."""
    assert GenerationConfig(stop_strings="ab").stop_strings == ["ab"]
    assert GenerationConfig(stop_strings=("ab", "c")).stop_strings == ("ab", "c")
    assert GenerationConfig(stop_strings={"ab", "c"}).stop_strings == ["ab", "c"]  # a set, as transformers iterates
    for bad in (5, {"ab": 1}, [5], [""]):
        with pytest.raises(ValueError, match=r"stop_strings must be a non-empty string or a list of them, got "):
            GenerationConfig(stop_strings=bad)


def test_numpy_bools_are_bools_as_transformers_takes_them():
    import numpy as np
    import transformers

    assert transformers.GenerationConfig(do_sample=np.True_).do_sample  # the reference takes it
    config = GenerationConfig(do_sample=np.True_, temperature=0.7, use_cache=np.False_)
    assert config.do_sample is True and config.use_cache is False
