"""Assisted decoding (``generate(..., assistant_model=)``) against transformers 4.55 on tiny random models: greedy
tokens and scores equal transformers' assisted generation and plain greedy search; sampled tokens follow the
model's distribution (speculative sampling), checked against the exact joint probabilities; refused settings."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import TinyModel, hf_params_in_kvgen_layout, make_tiny_model

from kvgen.errors import ContextLengthError
from kvgen.generation import GenerationConfig, generate
from kvgen.models import build_model

NEW_TOKENS = 24
PROMPT = torch.tensor([[5, 17, 42, 8, 61, 3, 29]])


def _assistant(tiny: TinyModel, noise: float, seed: int = 7) -> TinyModel:
    """The model with N(0, noise²) added to every weight (in both libraries): an assistant that mostly agrees."""
    ref = copy.deepcopy(tiny.ref)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return TinyModel(ref, build_model(tiny.ours.config, hf_params_in_kvgen_layout(ref)))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return make_tiny_model(request.param, std=0.5)


def _hf(tiny: TinyModel, assistant: TinyModel | None, **kwargs: Any) -> Any:
    with torch.inference_mode():
        return tiny.ref.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                                 pad_token_id=1, do_sample=False, return_dict_in_generate=True, output_scores=True,
                                 assistant_model=assistant.ref if assistant else None, **kwargs)


def _ours(tiny: TinyModel, assistant: TinyModel | None, **kwargs: Any):
    cfg = GenerationConfig(**{"max_new_tokens": NEW_TOKENS, "pad_token_id": 1, **kwargs})
    return generate(tiny.ours, PROMPT, None, cfg, assistant_model=assistant.ours if assistant else None)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.3}], ids=["plain", "repetition_penalty"])
def test_greedy_tokens_and_scores_equal_transformers(tiny, cache, extra):
    assistant = _assistant(tiny, 0.05)
    greedy = _hf(tiny, None, eos_token_id=None, **extra)
    assisted = _hf(tiny, assistant, eos_token_id=None, **extra)
    ours = _ours(tiny, assistant, eos_token_id=[], cache_implementation=cache, output_scores=True, **extra)
    assert ours.sequences.tolist() == assisted.sequences.tolist() == greedy.sequences.tolist()
    assert len(ours.scores) == NEW_TOKENS
    for got, want in zip(ours.scores, greedy.scores, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert 1 < ours.timings.num_decode_steps < NEW_TOKENS - 1  # drafts were accepted, not all of them


def test_a_perfect_assistant_needs_few_forwards_and_stops_on_eos_inside_a_draft(tiny):
    plain = _ours(tiny, None, eos_token_id=[])
    same = _ours(tiny, tiny, eos_token_id=[], num_assistant_tokens=5, assistant_confidence_threshold=0.0)
    assert same.sequences.tolist() == plain.sequences.tolist()
    assert same.timings.num_decode_steps <= NEW_TOKENS // 5  # every draft accepted: 6 tokens per forward
    new = plain.sequences[0, PROMPT.shape[1]:].tolist()
    eos = new[9]  # the 10th new token, inside the second draft of 5
    stopped = _ours(tiny, tiny, eos_token_id=[eos], num_assistant_tokens=5, assistant_confidence_threshold=0.0)
    cut = new.index(eos) + 1
    assert stopped.sequences[0, PROMPT.shape[1]:].tolist() == new[:cut] and stopped.finish_reasons == ["stop"]


@pytest.mark.slow  # 1,500 generations: ~10 s
def test_sampled_tokens_follow_the_models_distribution():
    """The joint distribution of the first two sampled tokens (drafted two at a time by a different assistant,
    so both the acceptance test and the residual draw are exercised) is the model's, not the assistant's."""
    target = make_tiny_model("llama", vocab_size=6, std=0.2, seed=1)
    assistant = make_tiny_model("llama", vocab_size=6, std=0.2, seed=2)
    prompt = torch.tensor([[1, 4, 2]])

    def next_probs(model, ids):
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))[0, -1].softmax(-1)

    def joint(model):  # [6, 6]: P(first, second) by the chain rule, exactly
        first = next_probs(model, prompt)
        return torch.stack([first[a] * next_probs(model, torch.cat([prompt, torch.tensor([[a]])], 1))
                            for a in range(6)])

    want, theirs = joint(target.ours), joint(assistant.ours)
    counts = torch.zeros(6, 6)
    g = torch.Generator().manual_seed(0)
    cfg = GenerationConfig(max_new_tokens=3, do_sample=True, top_k=0, eos_token_id=[], pad_token_id=0,
                           num_assistant_tokens=2, assistant_confidence_threshold=0.0)
    num_runs = 1500
    for _ in range(num_runs):
        out = generate(target.ours, prompt, None, cfg, generator=g, assistant_model=assistant.ours)
        a, b = out.sequences[0, 3:5].tolist()
        counts[a, b] += 1
    tv = 0.5 * float((counts / num_runs - want).abs().sum())
    assert 0.5 * float((theirs - want).abs().sum()) > 0.3  # the assistant alone would be far off
    assert tv < 0.1, tv  # sampling noise at 1,500 draws over 36 cells is ~0.06


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_beams": 2}, "greedy search or sampling of one sequence"),
    ({"do_sample": True, "num_return_sequences": 2}, "greedy search or sampling of one sequence"),
    ({"prompt_lookup_num_tokens": 3}, "greedy search or sampling of one sequence"),
    ({"num_assistant_tokens": 0}, "num_assistant_tokens must be"),
    ({"assistant_confidence_threshold": 1.0}, "assistant_confidence_threshold must be"),
    ({"num_assistant_tokens_schedule": "fast"}, "num_assistant_tokens_schedule must be"),
])
def test_bad_settings_are_refused(kwargs, message):
    tiny = make_tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        generate(tiny.ours, PROMPT, None, GenerationConfig(max_new_tokens=4, **kwargs), assistant_model=tiny.ours)


def test_bad_assistants_are_refused():
    tiny = make_tiny_model("llama")
    other_vocab = make_tiny_model("llama", vocab_size=tiny.ours.config.vocab_size + 1)
    short = make_tiny_model("llama", max_position_embeddings=8)
    cfg = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(tiny.ours, PROMPT, None, cfg, assistant_model=other_vocab.ours)
    with pytest.raises(ValueError, match="assistant_model must be a kvgen model"):
        generate(tiny.ours, PROMPT, None, cfg, assistant_model=tiny.ref)
    with pytest.raises(ValueError, match="batch of one prompt"):
        generate(tiny.ours, PROMPT.repeat(2, 1), None, cfg, assistant_model=tiny.ours)
    with pytest.raises(ContextLengthError, match="assistant model's context window of 8"):
        generate(tiny.ours, PROMPT, None, cfg, assistant_model=short.ours)
