"""``LLM.beam_search`` (vLLM's beam search over the engine) on tiny random models: without EOS its beams are
transformers' beam search's; with EOS it follows vLLM's rules, checked against the same rules run on uncached
full forwards; bad settings are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TinyModel, make_tiny_model, model_logits

from kvgen.engine import LLM
from kvgen.engine.beam_search import BeamSearchParams, beam_search_score

PROMPTS = [[5, 17, 42, 8, 61, 3, 29], [11, 70], [88, 4, 19, 33]]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return make_tiny_model(request.param, std=0.5)


def _llm(model: Any, **engine_args: Any) -> LLM:
    return LLM(model, None, num_blocks=256, block_size=4, **engine_args)


@pytest.mark.parametrize(("beam_width", "length_penalty"), [(3, 1.0), (4, 0.0), (2, 2.0), (1, 1.0)])
def test_without_eos_the_beams_are_transformers_beam_search(tiny: TinyModel, beam_width: int,
                                                            length_penalty: float) -> None:
    params = BeamSearchParams(beam_width=beam_width, max_tokens=NEW_TOKENS, ignore_eos=True,
                              length_penalty=length_penalty)
    outputs = _llm(tiny.ours).beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = tiny.ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    num_beams=beam_width, num_return_sequences=beam_width, eos_token_id=None,
                                    pad_token_id=1, length_penalty=length_penalty, return_dict_in_generate=True,
                                    output_scores=True)
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        assert all(s.finish_reason == "length" and s.text is None for s in out.sequences)
        if beam_width > 1:  # transformers' score: the same sum of logprobs over NEW_TOKENS ** length_penalty
            cum = torch.tensor([s.cum_logprob for s in out.sequences])
            torch.testing.assert_close(cum, ref.sequences_scores * NEW_TOKENS**length_penalty, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("beam_width", [4, 6])
def test_a_vocabulary_under_2_beam_width_makes_every_token_a_candidate(beam_width: int) -> None:
    """7 tokens, beam_width 4 or 6: each step asks for at most the 7 logprobs there are (it asked for 8 or 12 and the
    step failed); the beams are transformers' beam search's."""
    tiny = make_tiny_model("llama", std=0.5, vocab_size=7)
    prompt = [1, 5, 2]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=4, ignore_eos=True)
    out = _llm(tiny.ours).beam_search(prompt, params)[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = tiny.ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, num_beams=beam_width,
                                num_return_sequences=beam_width, eos_token_id=None, pad_token_id=1)
    assert [s.tokens for s in out.sequences] == ref.tolist()


def _reference(model: Any, prompt: list[int], params: BeamSearchParams, eos: int) -> list[tuple[list[int], float]]:
    """vLLM's beam search rules on uncached full forwards: (tokens, cumulative logprob) of the best beams."""
    live, done = [(prompt, 0.0)], []

    def score(beam: tuple[list[int], float]) -> float:
        return beam[1] / ((len(beam[0]) - (beam[0][-1] == eos)) ** params.length_penalty)

    for _ in range(params.max_tokens):
        grown = []
        for tokens, cum in live:
            logprobs = torch.log_softmax(model_logits(model, torch.tensor([tokens]))[0, -1], dim=-1)  # [V]
            top = torch.topk(logprobs, 2 * params.beam_width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token == eos else grown).append((tokens + [token], cum + logprob))
        live = sorted(grown, key=score, reverse=True)[: params.beam_width]
    return sorted(done + live, key=score, reverse=True)[: params.beam_width]


def test_with_eos_beams_complete_as_vllm_ranks_them(tiny: TinyModel) -> None:
    """EOS is a token the unconstrained search emits, so some returned beams end on it and some run to the end."""
    params = BeamSearchParams(beam_width=3, max_tokens=NEW_TOKENS, length_penalty=0.7)
    free = _llm(tiny.ours).beam_search([PROMPTS[0]], params.__class__(**{**params.__dict__, "ignore_eos": True}))
    eos = free[0].sequences[0].tokens[len(PROMPTS[0]) + 2]
    kind = "gpt2" if tiny.ref.config.model_type == "gpt2" else "llama"
    with_eos = make_tiny_model(kind, std=0.5, eos_token_id=eos)
    reasons = []
    for prompt, out in zip(PROMPTS, _llm(with_eos.ours).beam_search(PROMPTS, params), strict=True):
        want = _reference(with_eos.ours, prompt, params, eos)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in want]
        torch.testing.assert_close(torch.tensor([s.cum_logprob for s in out.sequences]),
                                   torch.tensor([cum for _, cum in want]), rtol=1e-4, atol=1e-4)
        scores = [beam_search_score(s.tokens, s.cum_logprob, [eos], 0.7) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        reasons += [s.finish_reason for s in out.sequences]
        assert all((s.finish_reason == "stop") == (s.tokens[-1] == eos) for s in out.sequences)
    assert "stop" in reasons and "length" in reasons


def test_beams_stop_at_max_model_len_and_text_is_decoded(tiny_model_dir) -> None:
    from kvgen.loader import load_model

    model, tok = load_model(str(tiny_model_dir))
    prompt = tok.encode("hello world")
    llm = LLM(model, tok, num_blocks=64, block_size=4, max_model_len=len(prompt) + 3)
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert [len(s.tokens) for s in out.sequences] == [len(prompt) + 3] * 2
    assert [s.text for s in out.sequences] == [tok.decode(s.tokens) for s in out.sequences]
    assert out.sequences[0].tokens[: len(prompt)] == prompt


def test_numpy_bools_are_bools() -> None:
    import numpy as np

    params = BeamSearchParams(ignore_eos=np.True_, include_stop_str_in_output=np.False_)
    assert params.ignore_eos is True and params.include_stop_str_in_output is False


@pytest.mark.parametrize(("make", "message"), [
    (lambda: BeamSearchParams(beam_width=0), "beam_width"),
    (lambda: BeamSearchParams(max_tokens=0), "max_tokens"),
    (lambda: BeamSearchParams(temperature=-1.0), "temperature"),
    (lambda: BeamSearchParams(length_penalty=float("nan")), "length_penalty"),
    # a truthy "no" ignored EOS; SamplingParams refused it already
    (lambda: BeamSearchParams(ignore_eos="no"), "ignore_eos must be a bool, got 'no'"),
    (lambda: BeamSearchParams(include_stop_str_in_output=1), "include_stop_str_in_output must be a bool, got 1"),
])
def test_bad_params_are_refused(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_requests_are_refused(tiny: TinyModel) -> None:
    llm = _llm(tiny.ours, max_model_len=16)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=11))
    with pytest.raises(ValueError, match=r"1 to 15 tokens"):
        llm.beam_search([list(range(2, 18))], BeamSearchParams(beam_width=2))
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.beam_search("hello", BeamSearchParams(beam_width=2))
    assert llm.beam_search(PROMPTS[1], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences  # still serves
