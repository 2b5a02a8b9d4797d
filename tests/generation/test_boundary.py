"""generate() and GenerationConfig at the library boundary: what is not a valid value is a ValueError (or a
TypeError for an argument of another kind) naming it, before any work; None in a field means unset, as in
transformers; a caller's logits processor is held to its contract."""

from __future__ import annotations

import pytest
import torch

from kvgen import load_model
from kvgen.generation import GenerationConfig, generate


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def _ids(tok) -> torch.Tensor:
    return torch.tensor([tok.encode("hello world")])  # [1, T]


def test_none_means_the_default_and_bool_fields_take_bools():
    assert GenerationConfig(temperature=None, num_beams=None, max_new_tokens=None, do_sample=None) == GenerationConfig()
    for name in ("do_sample", "use_cache", "output_scores", "low_memory"):
        with pytest.raises(ValueError, match=f"{name} must be a bool, got 'yes'"):
            GenerationConfig(**{name: "yes"})
    assert GenerationConfig(stop_strings="Pq").stop_strings == ["Pq"]  # one stop string, not "P" and "q"


@pytest.mark.parametrize("kwargs,match", [
    ({"sequence_bias": {(5,): float("nan")}}, r"sequence_bias values must be finite numbers \(or -inf\), got nan"),
    ({"sequence_bias": {(5,): float("inf")}}, "sequence_bias values must be finite numbers"),
    ({"sequence_bias": {5: 1.0}}, "sequence_bias keys must be non-empty sequences of ids >= 0, got 5"),
    ({"suppress_tokens": [[1]]}, r"suppress_tokens must be a token id or a list of them \(ints >= 0\), got \[\[1\]\]"),
    ({"suppress_tokens": [1.5]}, "suppress_tokens must be a token id or a list of them"),
    ({"bad_words_ids": [1, 2, 3]}, r"bad_words_ids must be a list of token id lists, got \[1, 2, 3\]"),
])
def test_malformed_processor_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)


def test_batches_of_other_dtypes_or_mask_values_and_bad_negative_prompts_are_refused(tiny):
    model, tok = tiny
    ids = _ids(tok)
    cfg = GenerationConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids must hold integer token ids, got torch.float32"):
        generate(model, ids.float() + 0.5, None, cfg)
    with pytest.raises(ValueError, match="input_ids must hold integer token ids, got torch.bool"):
        generate(model, ids > 0, None, cfg)
    half = torch.ones_like(ids, dtype=torch.float)
    half[0, 0] = 0.5
    with pytest.raises(ValueError, match=r"attention_mask must hold 0 \(padding\) and 1 \(token\) only"):
        generate(model, ids, half, cfg)
    guided = GenerationConfig(max_new_tokens=2, guidance_scale=1.5)
    with pytest.raises(ValueError, match=r"negative_prompt_ids must be in \[0, "):
        generate(model, ids, None, guided, negative_prompt_ids=torch.tensor([[-1]]))
    with pytest.raises(ValueError, match="negative_prompt_ids must hold at least one token per row"):
        generate(model, ids, None, guided, negative_prompt_ids=torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(ValueError, match="negative_prompt_attention_mask must be left-padded"):
        generate(model, ids, None, guided, negative_prompt_ids=torch.tensor([[1, 2]]),
                 negative_prompt_attention_mask=torch.tensor([[1, 0]]))
    with pytest.raises(TypeError, match="generation_config must be a kvgen.GenerationConfig .*got dict"):
        generate(model, ids, None, {"max_new_tokens": 2})
    with pytest.raises(TypeError, match="model must be a kvgen model .*got str"):
        generate("default", ids, None, cfg)


def test_a_callers_processor_may_write_its_scores_and_must_return_scores_of_their_shape(tiny):
    model, tok = tiny
    ids, cfg = _ids(tok), GenerationConfig(max_new_tokens=3)
    plain = generate(model, ids, None, cfg).new_token_ids[0]

    def ban_first(token_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # transformers' in-place style
        scores[:, plain[0]] = -float("inf")
        return scores

    assert generate(model, ids, None, cfg, logits_processor=[ban_first]).new_token_ids[0][0] != plain[0]
    assert generate(model, ids, None, cfg).new_token_ids[0] == plain  # the model's own scores were not touched
    for bad, got in [(lambda t, s: s[:, :10], r"torch.float32 \[1, 10\]"), (lambda t, s: None, "NoneType"),
                     (lambda t, s: s[0], r"torch.float32 \[\d+\]"), (lambda t, s: s.long(), "torch.int64")]:
        with pytest.raises(ValueError, match=rf"logits_processor .* must return float scores \[1, \d+\] \[B, V\], got {got}"):
            generate(model, ids, None, cfg, logits_processor=[bad])
    with pytest.raises(ValueError, match="logits_processor must be a list of callables"):
        generate(model, ids, None, cfg, logits_processor=ban_first)


def test_make_cache_and_crop_take_counts_only_and_a_pool_too_large_to_map_is_a_value_error(tiny):
    from kvgen.generation import make_cache

    model, _ = tiny
    for kwargs, match in [({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
                          ({"batch_size": 1.5}, "batch_size must be an int >= 1, got 1.5"),
                          ({"max_len": 0}, "max_len must be an int >= 1, got 0"),  # was the whole context
                          ({"kind": "static", "max_len": 10**15}, "cannot map .* bytes for")]:  # was an OSError
        with pytest.raises(ValueError, match=match):
            make_cache(model, **kwargs)
    cache = make_cache(model, "static", 1, 16)
    for length in (-1, 2.5, "3", None):  # -1 broke the next generate(), 2.5 became the length
        with pytest.raises(ValueError, match=f"length must be an int >= 0, got {length!r}"):
            cache.crop(length)


def test_eos_and_pad_ids_are_token_ids_and_a_pad_past_the_vocabulary_is_refused_once_a_row_needs_it(tiny):
    for kwargs, match in [({"eos_token_id": 1.5}, r"eos_token_id must be a token id or a list of them \(ints >= 0\), got 1.5"),
                          ({"eos_token_id": "a"}, r"eos_token_id must be a token id or a list of them \(ints >= 0\), got 'a'"),
                          ({"eos_token_id": -1}, "eos_token_id must be a token id or a list of them"),
                          ({"pad_token_id": "x"}, "pad_token_id must be an int >= 0, got 'x'"),
                          ({"pad_token_id": 2.5}, "pad_token_id must be an int >= 0, got 2.5")]:
        with pytest.raises(ValueError, match=match):
            GenerationConfig(**kwargs)
    model, tok = tiny
    ids = torch.tensor([tok.encode("hello world"), tok.encode("one two")])  # [2, T]: same length here
    first = generate(model, ids, None, GenerationConfig(max_new_tokens=1, eos_token_id=[])).new_token_ids
    assert first[0] != first[1]  # row 0 stops on its first token below, row 1 goes on
    cfg = GenerationConfig(max_new_tokens=3, eos_token_id=first[0][0])
    assert generate(model, ids, None, cfg.replace(pad_token_id=0)).finish_reasons[0] == "stop"
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"pad_token_id must be a token id in \[0, {vocab}\) to pad the rows"):
        generate(model, ids, None, cfg.replace(pad_token_id=10**9))  # read by the next forward: it crashed there
