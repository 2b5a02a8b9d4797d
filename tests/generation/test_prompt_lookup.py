"""Prompt lookup decoding against transformers 4.55 (``prompt_lookup_num_tokens``) on tiny random models: the
tokens and scores of greedy search (and of transformers' own prompt lookup), seeded draws, stops inside a
block of accepted drafts, refused settings."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TinyModel, make_tiny_model

from kvgen.generation import GenerationConfig, generate

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return make_tiny_model(request.param, std=0.5)


@pytest.fixture(scope="module")
def prompt(tiny: TinyModel) -> torch.Tensor:
    """[1, T]: a prompt, the model's own greedy continuation of it, then the prompt again, so that the greedy
    continuation tends to repeat text the lookup can draft from."""
    head = torch.tensor([[5, 17, 42, 8, 61, 3, 29]])
    with torch.inference_mode():
        cont = tiny.ref.generate(head, attention_mask=torch.ones_like(head), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=1)[:, head.shape[1]:]
    return torch.cat([head, cont, head], 1)


def _hf(tiny: TinyModel, ids: torch.Tensor, seed: int | None = None, **kwargs: Any) -> Any:
    with torch.inference_mode(), torch.random.fork_rng():
        if seed is not None:
            torch.manual_seed(seed)
        return tiny.ref.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=1,
                                 return_dict_in_generate=True, output_scores=True,
                                 **{"max_new_tokens": NEW_TOKENS, **kwargs})


def _unused_id(tiny: TinyModel, prompt: torch.Tensor) -> int:
    """An id in neither the prompt nor its greedy continuation: the EOS transformers' prompt lookup needs (it cuts
    drafts at EOS and fails without one) that never ends a row."""
    seen = set(prompt[0].tolist()) | set(_hf(tiny, prompt, eos_token_id=None).sequences[0].tolist())
    return next(i for i in range(2, tiny.ref.config.vocab_size) if i not in seen)


def _ours(tiny: TinyModel, ids: torch.Tensor, **kwargs: Any):
    return generate(tiny.ours, ids, None, GenerationConfig(**{"max_new_tokens": NEW_TOKENS, "pad_token_id": 1, **kwargs}))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 3}],
                         ids=["plain", "repetition_penalty", "no_repeat_ngram"])
def test_greedy_tokens_and_scores_equal_transformers(tiny, prompt, cache, extra):
    eos = _unused_id(tiny, prompt)
    greedy = _hf(tiny, prompt, eos_token_id=eos, **extra)
    looked_up = _hf(tiny, prompt, eos_token_id=eos, prompt_lookup_num_tokens=4, **extra)
    ours = _ours(tiny, prompt, eos_token_id=eos, prompt_lookup_num_tokens=4, cache_implementation=cache,
                 output_scores=True, **extra)
    assert ours.sequences.tolist() == greedy.sequences.tolist() == looked_up.sequences.tolist()
    assert ours.scores is not None and len(ours.scores) == len(looked_up.scores) == NEW_TOKENS
    for got, want in zip(ours.scores, looked_up.scores, strict=True):  # [1, V] per token
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # (random tiny models rarely repeat themselves, so drafts are mostly rejected here: acceptance is tested on the
    # default model below)


def test_seeded_sampling_equals_transformers(tiny, prompt):
    kwargs = {"do_sample": True, "temperature": 0.7, "top_k": 20}
    eos = _unused_id(tiny, prompt)
    ref = _hf(tiny, prompt, seed=11, eos_token_id=eos, prompt_lookup_num_tokens=3, **kwargs)
    ours = _ours(tiny, prompt, eos_token_id=eos, prompt_lookup_num_tokens=3, seed=11, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    other = _ours(tiny, prompt, eos_token_id=[], prompt_lookup_num_tokens=3, seed=12, **kwargs)
    assert other.sequences.tolist() != ours.sequences.tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("max_new_tokens", [5, 7])
def test_seeded_sampling_near_the_length_limit_equals_transformers(tiny, prompt, max_new_tokens, cache):
    """transformers drafts k tokens even when fewer fit: its one draw over k + 1 rows sets how many random numbers
    each step takes, so a draft cut to the room left changed every later token. A static cache (transformers'
    prompt lookup refuses one) holds those drafts too: sized for max_new_tokens alone, it overflowed."""
    kwargs = {"do_sample": True, "temperature": 0.3, "top_k": 0, "prompt_lookup_num_tokens": 5,
              "max_new_tokens": max_new_tokens}
    eos = _unused_id(tiny, prompt)
    for seed in range(12):
        ref = _hf(tiny, prompt, seed=seed, eos_token_id=eos, **kwargs)
        ours = _ours(tiny, prompt, eos_token_id=eos, seed=seed, cache_implementation=cache, **kwargs)
        assert ours.sequences.tolist() == ref.sequences.tolist()


def test_eos_and_max_new_tokens_stop_where_greedy_search_stops(tiny, prompt):
    greedy = _hf(tiny, prompt, eos_token_id=None).sequences[0, prompt.shape[1]:].tolist()
    eos = greedy[NEW_TOKENS // 2]  # emitted mid-way
    first = greedy.index(eos)
    ours = _ours(tiny, prompt, eos_token_id=[eos], prompt_lookup_num_tokens=6)
    assert ours.new_token_ids[0] == greedy[: first + 1]
    assert (ours.finish_reasons, ours.num_new_tokens) == (["stop"], [first + 1])
    short = _ours(tiny, prompt, eos_token_id=[], prompt_lookup_num_tokens=10, max_new_tokens=3)
    assert short.new_token_ids[0] == greedy[:3] and short.finish_reasons == ["length"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens must be"),
    ({"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 0}, "max_matching_ngram_size must be"),
    ({"prompt_lookup_num_tokens": 3, "num_beams": 2}, "greedy search or sampling only"),
    ({"prompt_lookup_num_tokens": 3, "penalty_alpha": 0.6, "top_k": 4}, "greedy search or sampling only"),
    ({"prompt_lookup_num_tokens": 3, "do_sample": True, "num_return_sequences": 2}, "num_return_sequences"),
])
def test_contradictory_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_a_batch_of_two_is_refused(tiny):
    with pytest.raises(ValueError, match="batch of one prompt"):
        _ours(tiny, torch.tensor([[5, 6, 7], [8, 9, 10]]), prompt_lookup_num_tokens=3)


CODE = '''class StaticCache:
    """A preallocated KV cache written in place."""

    def __init__(self, num_layers: int, batch_size: int, max_cache_len: int) -> None:
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.max_cache_len = max_cache_len
        self.seq_length = 0
'''


@pytest.mark.slow
@pytest.mark.parametrize("eos_at", [None, 40])
def test_the_default_model_copies_code_in_fewer_forwards(ours_default_auto, eos_at):
    """Rewriting code from the prompt: greedy search's tokens in a fraction of its forwards; an EOS id that greedy
    search emits inside a block of accepted drafts ends the output right there."""
    model, tok = ours_default_auto
    messages = [{"role": "user", "content": "Rewrite this code, renaming the class StaticCache to FixedCache:\n\n" + CODE}]
    ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)])
    config = GenerationConfig(max_new_tokens=64, cache_implementation="static")
    if eos_at is not None:
        plain = generate(model, ids, None, config).new_token_ids[0]
        config = config.replace(eos_token_id=[plain[eos_at]])
    greedy = generate(model, ids, None, config)
    looked_up = generate(model, ids, None, config.replace(prompt_lookup_num_tokens=8))
    assert looked_up.new_token_ids == greedy.new_token_ids and "class FixedCache" in tok.decode(greedy.new_token_ids[0])
    assert looked_up.finish_reasons == greedy.finish_reasons == ["length" if eos_at is None else "stop"]
    assert looked_up.timings.num_decode_steps < greedy.timings.num_decode_steps / 3
