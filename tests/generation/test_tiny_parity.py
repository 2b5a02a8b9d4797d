"""Every decoding strategy of generate() against transformers 4.55 on tiny random models (fast subset).

The tests of the sibling files compare with transformers on the real default model, which
makes them ``slow``; these run the same comparisons on a tiny Llama and a tiny GPT-2
(``make_tiny_model(std=0.5)``: logits spread widely enough that an argmax or a beam ranking
is not decided by float noise) over one left-padded batch of prompts of different lengths.
Expected tokens and scores always come from transformers at run time; the EOS ids, bad words
and so on are picked from transformers' own unconstrained output, and each test also checks
that the reference run really exercises the feature (rows stop at different steps, a
processor changes the output, samples differ).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import TinyModel, left_pad, make_tiny_model
from transformers import LogitsProcessorList

from kvgen.generation import GenerateOutput, GenerationConfig, generate

NEW_TOKENS = 10
PAD = 1  # not 0: transformers' beam search fills finished rows with eos[0] when pad_token_id is 0 (falsy)
PROMPTS = [[5, 17, 42, 8, 61, 3, 29], [11, 70], [88, 4, 19, 33]]  # 7, 2 and 4 tokens
IDS, MASK = left_pad(PROMPTS, PAD)  # [3, 7]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request: pytest.FixtureRequest) -> TinyModel:
    return make_tiny_model(request.param, std=0.5)


def _hf(tiny: TinyModel, eos: list[int] | None = None, **kwargs: Any) -> Any:
    """transformers' generate() on the padded batch: a GenerateOutput dict with scores."""
    with torch.inference_mode():
        return tiny.ref.generate(
            IDS, attention_mask=MASK, max_new_tokens=kwargs.pop("max_new_tokens", NEW_TOKENS), eos_token_id=eos,
            pad_token_id=PAD, return_dict_in_generate=True, output_scores=True, **kwargs,
        )


def _hf_seeded(tiny: TinyModel, seed: int, eos: list[int], **kwargs: Any) -> Any:
    """``_hf`` with the global generator seeded (transformers samples from it, one multinomial over all
    rows per step, as kvgen does from a ``torch.Generator`` seeded alike); the caller's RNG state is kept."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _hf(tiny, eos, **kwargs)


def _ours(tiny: TinyModel, eos: list[int] | None = None, **kwargs: Any) -> GenerateOutput:
    new_tokens = kwargs.pop("max_new_tokens", NEW_TOKENS)  # None: max_length decides, as in transformers
    cfg = GenerationConfig(**({} if new_tokens is None else {"max_new_tokens": new_tokens}), eos_token_id=eos or [],
                           pad_token_id=PAD, **kwargs)
    return generate(tiny.ours, IDS, MASK, cfg)


def _new(sequences: torch.Tensor) -> list[list[int]]:
    return sequences[:, IDS.shape[1] :].tolist()


@functools.cache  # one reference run per model; callers only read it
def _greedy_new(tiny: TinyModel) -> list[list[int]]:
    """transformers' greedy continuations without EOS: the pool the EOS ids and bad words are taken from."""
    return _new(_hf(tiny).sequences)


def _two_eos(tiny: TinyModel) -> list[int]:
    """Two EOS ids that transformers' greedy run emits in the middle of rows 0 and 1."""
    greedy = _greedy_new(tiny)
    return sorted({greedy[0][3], greedy[1][6]})


def _expected_stops(new_rows: list[list[int]], eos: list[int]) -> tuple[list[str], list[int]]:
    """Finish reasons and new-token counts implied by transformers' padded output rows."""
    reasons, counts = [], []
    for row in new_rows:
        hit = next((t for t, token in enumerate(row) if token in eos), None)
        reasons.append("length" if hit is None else "stop")
        counts.append(len(row) if hit is None else hit + 1)
    return reasons, counts


def _assert_scores_close(ours: GenerateOutput, ref: Any) -> None:
    """Processed scores of every step equal transformers' (-inf where a processor removed a token)."""
    assert ours.scores is not None and len(ours.scores) == len(ref.scores)
    for got, want in zip(ours.scores, ref.scores, strict=True):  # [N, V] per step
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _assert_beams_equal(ours: GenerateOutput, ref: Any) -> None:
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert ours.sequences_scores is not None
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- greedy and EOS


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_matches_transformers(tiny: TinyModel, cache: str) -> None:
    ref = _hf(tiny, output_logits=True)
    ours = _ours(tiny, cache_implementation=cache, output_scores=True, output_logits=True)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert ours.scores is not None and ours.logits is not None
    for got, want in zip(ours.scores + ours.logits, ref.scores + ref.logits, strict=True):  # [B, V] per step
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len({tuple(r) for r in ours.new_token_ids}) == 3 and len(set(ours.new_token_ids[0])) > 2


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_several_eos_ids_stop_rows_at_different_steps(tiny: TinyModel, cache: str) -> None:
    eos = _two_eos(tiny)
    ref = _hf(tiny, eos)
    reasons, counts = _expected_stops(_new(ref.sequences), eos)
    assert len(set(counts)) > 1 and "stop" in reasons  # rows really finish at different steps
    ours = _ours(tiny, eos, cache_implementation=cache)
    assert ours.sequences.tolist() == ref.sequences.tolist()  # finished rows padded as transformers pads them
    assert ours.finish_reasons == reasons and ours.num_new_tokens == counts


# ---------------------------------------------------------------- logits processors on greedy


def _processor_cases(tiny: TinyModel) -> dict[str, dict[str, Any]]:
    greedy = _greedy_new(tiny)
    return {
        "no_repeat_ngram_size=2": {"no_repeat_ngram_size": 2},
        "no_repeat_ngram_size=1": {"no_repeat_ngram_size": 1},
        "repetition_penalty=1.8": {"repetition_penalty": 1.8},
        "bad_words_ids": {"bad_words_ids": [[greedy[0][1]], [greedy[1][2], greedy[1][3]], [greedy[2][4]]]},
        "min_new_tokens=6": {"min_new_tokens": 6, "eos": [greedy[0][1], greedy[1][0], greedy[2][2]]},
        "forced_eos_token_id": {"forced_eos_token_id": greedy[0][2]},
        "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (2, 4.0),
                                             "eos": [greedy[0][7], greedy[1][8], greedy[2][9]]},
        "min_length=12": {"min_length": 12, "eos": [greedy[0][1], greedy[1][0], greedy[2][2]]},
        # transformers: min_new_tokens takes precedence (min_length becomes min_new_tokens + the prompt's length)
        "min_new_tokens=2, min_length=14": {"min_new_tokens": 2, "min_length": 14,
                                            "eos": [greedy[0][1], greedy[1][0], greedy[2][2]]},
        "max_length=11": {"max_length": 11, "max_new_tokens": None},
        "begin_suppress_tokens, renormalize_logits, remove_invalid_values": {
            "begin_suppress_tokens": [greedy[0][0], greedy[1][0]], "renormalize_logits": True,
            "remove_invalid_values": True},
        "encoder_repetition_penalty=3": {"encoder_repetition_penalty": 3.0},
        # the boost makes the random models copy the prompt, so the prompt's bigrams get banned
        "encoder_repetition_penalty=3, encoder_no_repeat_ngram_size=2": {"encoder_repetition_penalty": 3.0,
                                                                          "encoder_no_repeat_ngram_size": 2},
    }


@pytest.mark.parametrize(
    "case", ["no_repeat_ngram_size=2", "no_repeat_ngram_size=1", "repetition_penalty=1.8", "bad_words_ids",
             "min_new_tokens=6", "min_length=12", "min_new_tokens=2, min_length=14", "max_length=11", "forced_eos_token_id", "exponential_decay_length_penalty",
             "begin_suppress_tokens, renormalize_logits, remove_invalid_values", "encoder_repetition_penalty=3",
             "encoder_repetition_penalty=3, encoder_no_repeat_ngram_size=2"]
)
def test_greedy_with_processor_matches_transformers(tiny: TinyModel, case: str) -> None:
    kwargs = _processor_cases(tiny)[case]
    eos = kwargs.pop("eos", None)
    ref = _hf(tiny, eos, **kwargs)
    assert ref.sequences.tolist() != _hf(tiny, eos).sequences.tolist()  # the processor changes the output
    ours = _ours(tiny, eos, output_scores=True, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)
    if eos:
        assert (ours.finish_reasons, ours.num_new_tokens) == _expected_stops(_new(ref.sequences), eos)


def test_an_explicit_max_new_tokens_of_20_wins_over_max_length_as_transformers(tiny: TinyModel) -> None:
    """transformers' max_new_tokens defaults to None, so an explicit 20 (kvgen's default value) still wins."""
    ref = _hf(tiny, max_new_tokens=20, max_length=IDS.shape[1] + 3)
    assert ref.sequences.shape[1] == IDS.shape[1] + 20
    assert _ours(tiny, max_new_tokens=20, max_length=IDS.shape[1] + 3).sequences.tolist() == ref.sequences.tolist()
    assert _ours(tiny, max_new_tokens=None, max_length=IDS.shape[1] + 3).sequences.shape[1] == IDS.shape[1] + 3


def test_max_length_within_the_prompt_is_refused_as_transformers(tiny: TinyModel) -> None:
    with pytest.raises(ValueError, match="max_length"):
        _hf(tiny, max_new_tokens=None, max_length=IDS.shape[1])
    with pytest.raises(ValueError, match="max_length=7 leaves no room after the prompt's 7 tokens"):
        _ours(tiny, max_new_tokens=None, max_length=IDS.shape[1])
    assert _ours(tiny, max_new_tokens=None, max_length=IDS.shape[1] + 1).sequences.shape[1] == IDS.shape[1] + 1
    with pytest.raises(ValueError, match="min_new_tokens=3 conflicts with max_length=9: the prompt's 7 tokens leave 2"):
        _ours(tiny, max_new_tokens=None, max_length=IDS.shape[1] + 2, min_new_tokens=3)


# ---------------------------------------------------------------- multinomial sampling

SAMPLING: dict[str, dict[str, Any]] = {
    "temperature=0.7, top_k=10": {"temperature": 0.7, "top_k": 10},
    "top_p=0.8, repetition_penalty=1.3": {"top_p": 0.8, "top_k": 0, "repetition_penalty": 1.3},
    "min_p=0.1, temperature=1.5": {"min_p": 0.1, "temperature": 1.5, "top_k": 0},
    "typical_p=0.9, no_repeat_ngram_size=2": {"typical_p": 0.9, "no_repeat_ngram_size": 2},
    "epsilon_cutoff=0.02": {"epsilon_cutoff": 0.02, "top_k": 0},
    "eta_cutoff=0.01, top_k=20": {"eta_cutoff": 0.01, "top_k": 20},
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_seeded_sampling_matches_transformers(tiny: TinyModel, name: str) -> None:
    kwargs = {"do_sample": True, "num_return_sequences": 2, **SAMPLING[name]}
    eos = _two_eos(tiny)
    ref = _hf_seeded(tiny, 3, eos, **kwargs)
    ours = _ours(tiny, eos, seed=3, output_scores=True, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)
    assert (ours.finish_reasons, ours.num_new_tokens) == _expected_stops(_new(ref.sequences), eos)
    rows = _new(ref.sequences)
    assert any(rows[2 * i] != rows[2 * i + 1] for i in range(3))  # the two samples of a prompt differ: draws are random


# ---------------------------------------------------------------- beam search and its variants

BEAMS: dict[str, dict[str, Any]] = {
    "4 beams, all returned": {"num_beams": 4, "num_return_sequences": 4},
    "early_stopping=True, length_penalty=0.8, no_repeat_ngram": {
        "num_beams": 3, "early_stopping": True, "length_penalty": 0.8, "no_repeat_ngram_size": 2,
        "num_return_sequences": 2,
    },
    "early_stopping=never, length_penalty=1.5": {
        "num_beams": 4, "early_stopping": "never", "length_penalty": 1.5, "num_return_sequences": 2
    },
    # where "never" bounds a live beam: with max_new_tokens when length_penalty > 0, with the current length when < 0
    "early_stopping=never, length_penalty=2, 2 beams": {
        "num_beams": 2, "early_stopping": "never", "length_penalty": 2.0, "num_return_sequences": 2, "max_new_tokens": 6
    },
    "early_stopping=never, length_penalty=-0.5": {
        "num_beams": 3, "early_stopping": "never", "length_penalty": -0.5, "num_return_sequences": 3,
        "max_new_tokens": 12,
    },
    # every candidate stops at the first step (time): transformers ends the loop there, although with this penalty
    # a live beam's bound (its score / max_new_tokens**10) could still beat the finished ones
    "max_time at the first step, early_stopping=never, length_penalty=10": {
        "num_beams": 2, "early_stopping": "never", "length_penalty": 10.0, "num_return_sequences": 2, "max_time": 1e-6
    },
    "early_stopping=False, length_penalty=0": {"num_beams": 2, "length_penalty": 0.0},
    "forced_eos_token_id, renormalize_logits": {"num_beams": 3, "num_return_sequences": 2, "forced_eos_token_id": 7,
                                                "renormalize_logits": True},
    # transformers gives these the unexpanded prompt: the penalty reaches the first B of the B x num_beams rows
    "encoder_repetition_penalty, encoder_no_repeat_ngram_size": {
        "num_beams": 3, "num_return_sequences": 2, "encoder_repetition_penalty": 2.5, "encoder_no_repeat_ngram_size": 2},
}


@pytest.mark.parametrize("name", list(BEAMS))
def test_beam_search_matches_transformers(tiny: TinyModel, name: str) -> None:
    kwargs = BEAMS[name]
    eos = _two_eos(tiny)
    ref = _hf(tiny, eos, output_logits=True, **kwargs)
    ours = _ours(tiny, eos, output_scores=True, output_logits=True, **kwargs)
    _assert_beams_equal(ours, ref)
    assert ours.scores is not None and ours.logits is not None and len(ours.scores) == len(ref.scores)
    for got, want in zip(ours.scores + ours.logits, ref.scores + ref.logits, strict=True):  # every live beam row
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert ours.sequences.shape[0] == 3 * kwargs.get("num_return_sequences", 1)


def test_beam_search_ranks_eos_and_length_hypotheses(tiny: TinyModel) -> None:
    eos = _two_eos(tiny)
    kwargs = BEAMS["4 beams, all returned"]
    ref = _hf(tiny, eos, **kwargs)
    ours = _ours(tiny, eos, **kwargs)
    _assert_beams_equal(ours, ref)
    assert ours.sequences_scores is not None
    reasons, counts = _expected_stops(_new(ref.sequences), eos)
    assert "stop" in reasons and "length" in reasons  # EOS hypotheses and max-length ones both ranked
    assert ours.finish_reasons == reasons and ours.num_new_tokens == counts
    for p in range(3):
        scores = ours.sequences_scores[4 * p : 4 * p + 4].tolist()
        assert scores == sorted(scores, reverse=True)


def test_beam_search_static_cache_matches_transformers(tiny: TinyModel) -> None:
    kwargs = BEAMS["early_stopping=never, length_penalty=1.5"]
    eos = _two_eos(tiny)
    _assert_beams_equal(_ours(tiny, eos, cache_implementation="static", **kwargs), _hf(tiny, eos, **kwargs))


def test_beam_sample_matches_transformers_for_the_same_seed(tiny: TinyModel) -> None:
    kwargs = {"num_beams": 3, "num_return_sequences": 2, "do_sample": True, "temperature": 1.2, "top_k": 0}
    eos = _two_eos(tiny)
    ref = _hf_seeded(tiny, 5, eos, **kwargs)
    _assert_beams_equal(_ours(tiny, eos, seed=5, **kwargs), ref)
    assert _hf_seeded(tiny, 6, eos, **kwargs).sequences.tolist() != ref.sequences.tolist()  # the draws decide the beams


def test_beam_slots_no_hypothesis_reaches_return_the_prompt_as_transformers(tiny: TinyModel) -> None:
    # forced EOS at the only step leaves one finite candidate: two of the three returned slots stay empty
    kwargs = {"num_beams": 3, "num_return_sequences": 3, "forced_eos_token_id": 7, "max_new_tokens": 1}
    eos = _two_eos(tiny)  # transformers fills with -1 when no EOS id is set
    ref = _hf(tiny, eos, **kwargs)
    ours = _ours(tiny, eos, **kwargs)
    _assert_beams_equal(ours, ref)
    assert ref.sequences[1, : IDS.shape[1]].tolist() == IDS[0].tolist()  # an empty slot: the prompt, then padding
    assert ours.finish_reasons == _expected_stops(_new(ref.sequences), eos)[0]  # no EOS in a row: "length"


GROUPS: dict[str, dict[str, Any]] = {
    "2 groups of 2": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "num_return_sequences": 2},
    "3 groups of 2, early_stopping=True": {
        "num_beams": 6, "num_beam_groups": 3, "diversity_penalty": 0.5, "num_return_sequences": 3,
        "early_stopping": True,
    },
    "2 groups of 2, early_stopping=never, length_penalty=0.6": {
        "num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.7, "early_stopping": "never",
        "length_penalty": 0.6, "num_return_sequences": 4,
    },
    "2 groups of 2, early_stopping=never, length_penalty=0.6, 12 tokens": {  # reaches the max_new_tokens bound
        "num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.7, "early_stopping": "never",
        "length_penalty": 0.6, "num_return_sequences": 4, "max_new_tokens": 12,
    },
}


@pytest.mark.parametrize("name", list(GROUPS))
def test_group_beam_search_matches_transformers(tiny: TinyModel, name: str) -> None:
    kwargs = GROUPS[name]
    eos = _two_eos(tiny)[:1]  # one EOS id: see the next test for several
    ref = _hf(tiny, eos, **kwargs)
    _assert_beams_equal(_ours(tiny, eos, **kwargs), ref)
    assert "stop" in _expected_stops(_new(ref.sequences), eos)[0]  # some returned hypotheses end on EOS
    barely = _hf(tiny, eos, **{**kwargs, "diversity_penalty": 1e-6})  # transformers refuses 0.0 with groups
    assert barely.sequences.tolist() != ref.sequences.tolist()  # the diversity penalty changes the beams


def test_group_beam_search_with_several_eos_ids_keeps_the_emitted_eos(tiny: TinyModel) -> None:
    """transformers' group beam search (``BeamSearchScorer.finalize``) writes ``eos[0]`` where a
    hypothesis ended, whichever EOS id was emitted; kvgen keeps the emitted id (as transformers'
    own beam search does). Everything else, scores included, is identical."""
    kwargs = GROUPS["2 groups of 2"]
    eos = _two_eos(tiny)
    ref = _hf(tiny, eos, **kwargs)
    ours = _ours(tiny, eos, **kwargs)
    assert ours.sequences_scores is not None
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)
    emitted_other_eos = 0
    for got, want, reason, n in zip(_new(ours.sequences), _new(ref.sequences), ours.finish_reasons,
                                    ours.num_new_tokens, strict=True):
        if reason == "stop":
            assert got[n - 1] in eos and want[n - 1] == eos[0]
            emitted_other_eos += got[n - 1] != eos[0]
            got[n - 1] = want[n - 1]
        assert got == want
    assert emitted_other_eos > 0  # the case where the two differ really happens


def test_group_beam_search_ranks_eos_candidates_within_each_group_as_transformers(tiny: TinyModel) -> None:
    """The EOS ids are prompt 0's 1st and 3rd most likely first tokens. In its first group of 2 beams the 1st is a
    hypothesis, the 2nd a beam, and the 3rd, ranked at the group's size, is dropped, as HF ``BeamSearchScorer.process``
    drops ``beam_token_rank >= group_size``; the 4th is the other beam: transformers keeps ``(1 + len(eos)) x
    group_size`` candidates per group, not 2 x group_size. transformers writes ``eos[0]`` for the emitted EOS (see
    test_group_beam_search_with_several_eos_ids_keeps_the_emitted_eos)."""
    first = _hf(tiny, None, max_new_tokens=1).scores[0][0]  # [V]: prompt 0's first-step scores, no processor
    top = first.topk(3).indices.tolist()
    eos = [top[0], top[2]]
    kwargs = {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "num_return_sequences": 4,
              "max_new_tokens": 4, "early_stopping": True}
    ref = _hf(tiny, eos, **kwargs)
    ours = _ours(tiny, eos, **kwargs)
    assert ours.sequences_scores is not None
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)
    got_rows, want_rows = _new(ours.sequences), _new(ref.sequences)
    for got, want, reason, n in zip(got_rows, want_rows, ours.finish_reasons, ours.num_new_tokens, strict=True):
        if reason == "stop":
            assert got[n - 1] in eos and want[n - 1] == eos[0]
            got[n - 1] = want[n - 1]
        assert got == want
    assert [top[0]] in [row[:1] for row in got_rows[:4]]  # prompt 0's one-token EOS hypothesis is returned


def test_group_beam_search_idles_finished_groups_on_the_first_prompts_beam_as_transformers(tiny: TinyModel) -> None:
    """A group that is done idles on padding from the group's first row (prompt 0's first beam in it), as
    transformers' ``BeamSearchScorer.process``: the later steps' scores of its rows are that beam's. Unpadded
    prompts, where transformers' attention mask does not tell the rows apart."""
    ids = torch.tensor([[5, 17, 42, 8], [11, 70, 88, 4]])  # [2, 4]
    with torch.inference_mode():  # EOS: the first greedy token of prompt 1, whose groups are done at once
        eos = tiny.ref.generate(ids[1:], max_new_tokens=1, do_sample=False, pad_token_id=PAD)[0, -1].item()
        kwargs = {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "num_return_sequences": 2,
                  "early_stopping": True, "max_new_tokens": NEW_TOKENS, "eos_token_id": eos, "pad_token_id": PAD}
        ref = tiny.ref.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                output_scores=True, **kwargs)
    ours = generate(tiny.ours, ids, None, GenerationConfig(output_scores=True, **kwargs))
    _assert_beams_equal(ours, ref)
    assert ours.scores is not None and len(ours.scores) == len(ref.scores) > 1
    for got, want in zip(ours.scores, ref.scores, strict=True):  # [2 * 4, V] per step, the idle rows included
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- constrained beam search

def _unforced_absent(tiny: TinyModel) -> list[int]:
    """Five ids transformers' unconstrained beam search (4 beams, all returned) emits in no row, lowest first."""
    ref = _hf(tiny, _two_eos(tiny), num_beams=4, num_return_sequences=4)
    seen = {t for row in _new(ref.sequences) for t in row}
    return [t for t in range(2, tiny.ref.config.vocab_size) if t not in seen][:5]


CONSTRAINED_NEW_TOKENS = 12  # transformers' search tends to place forced ids last: leave room for them
CONSTRAINED: dict[str, Callable[[list[int]], dict[str, Any]]] = {
    "a phrase": lambda a: {"num_beams": 4, "num_return_sequences": 2, "force_words_ids": [[a[0], a[1]]]},
    "two phrases, length_penalty=0.5": lambda a: {
        "num_beams": 4, "num_return_sequences": 3, "length_penalty": 0.5,
        "force_words_ids": [[a[0]], [a[1], a[2]]]},
    "words sharing a prefix, early_stopping=True, no_repeat_ngram_size": lambda a: {
        "num_beams": 4, "num_return_sequences": 2, "early_stopping": True, "no_repeat_ngram_size": 2,
        "force_words_ids": [[[a[0], a[1]], [a[0], a[2]], [a[3]]]]},
    "a disjunction and a phrase, early_stopping=never": lambda a: {
        "num_beams": 3, "early_stopping": "never", "force_words_ids": [[[a[0]], [a[1], a[2]]], [a[3], a[4]]]},
}


@pytest.mark.parametrize("name", list(CONSTRAINED))
def test_constrained_beam_search_matches_transformers(tiny: TinyModel, name: str) -> None:
    kwargs = CONSTRAINED[name](_unforced_absent(tiny))
    eos = _two_eos(tiny)
    ref = _hf(tiny, eos, output_logits=True, max_new_tokens=CONSTRAINED_NEW_TOKENS, **kwargs)
    ours = _ours(tiny, eos, output_scores=True, output_logits=True, max_new_tokens=CONSTRAINED_NEW_TOKENS, **kwargs)
    _assert_beams_equal(ours, ref)
    assert ours.scores is not None and ours.logits is not None and len(ours.scores) == len(ref.scores)
    for got, want in zip(ours.scores + ours.logits, ref.scores + ref.logits, strict=True):  # every live beam row
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    words = [w if isinstance(w[0], list) else [w] for w in kwargs["force_words_ids"]]
    fulfilled = [all(any(_contains(row, word) for word in choice) for choice in words) for row in _new(ref.sequences)]
    assert any(fulfilled)  # the forced ids really appear (transformers returns the best open beams when it fails)


def _contains(row: list[int], word: list[int]) -> bool:
    return any(row[i : i + len(word)] == word for i in range(len(row)))


def test_constraint_objects_give_what_force_words_ids_gives(tiny: TinyModel) -> None:
    """kvgen's constraint objects and transformers' own: the same output as the equivalent force_words_ids."""
    from transformers.generation import DisjunctiveConstraint as HFDisjunctive

    from kvgen.generation.constraints import DisjunctiveConstraint, PhrasalConstraint

    a = _unforced_absent(tiny)
    kwargs = CONSTRAINED["a disjunction and a phrase, early_stopping=never"](a)
    eos = _two_eos(tiny)
    want = _ours(tiny, eos, **kwargs)
    del kwargs["force_words_ids"]
    mine = [DisjunctiveConstraint([[a[0]], [a[1], a[2]]]), PhrasalConstraint([a[3], a[4]])]
    assert _ours(tiny, eos, constraints=mine, **kwargs).sequences.tolist() == want.sequences.tolist()
    theirs = _ours(tiny, eos, constraints=[HFDisjunctive([[a[0]], [a[1], a[2]]])], force_words_ids=[[a[3], a[4]]],
                   **kwargs)
    assert theirs.sequences.tolist() == want.sequences.tolist()
    assert want.sequences.tolist() != _ours(tiny, eos, num_beams=3, early_stopping="never").sequences.tolist()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_beams": 1, "force_words_ids": [[3]]}, "needs num_beams > 1"),
    ({"num_beams": 2, "do_sample": True, "force_words_ids": [[3]]}, "do_sample=True conflicts"),
    ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "force_words_ids": [[3]]}, "one group"),
    ({"num_beams": 2, "force_words_ids": [[3, -1]]}, "token ids >= 0"),
    ({"num_beams": 2, "force_words_ids": [[[3, 4], [3]]]}, "prefix of another"),
    ({"num_beams": 2, "constraints": []}, "at least one constraint"),
    ({"num_beams": 2, "force_words_ids": [[5000]]}, "must be < vocab_size"),
])
def test_constrained_beam_search_refusals(tiny: TinyModel, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(tiny.ours, IDS, MASK, **kwargs)


# ---------------------------------------------------------------- contrastive search


@pytest.mark.parametrize(
    "kwargs,cache",
    [({"penalty_alpha": 0.6, "top_k": 4}, "dynamic"), ({"penalty_alpha": 0.45, "top_k": 3}, "dynamic"),
     ({"penalty_alpha": 0.6, "top_k": 4}, "static")],
    ids=["alpha=0.6,k=4-dynamic", "alpha=0.45,k=3-dynamic", "alpha=0.6,k=4-static"],
)
def test_contrastive_search_matches_transformers(tiny: TinyModel, kwargs: dict[str, Any], cache: str) -> None:
    eos = _two_eos(tiny)
    ref = _hf(tiny, eos, **kwargs)
    assert ref.sequences.tolist() != _hf(tiny, eos).sequences.tolist()  # the degeneration penalty decides tokens
    ours = _ours(tiny, eos, cache_implementation=cache, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert (ours.finish_reasons, ours.num_new_tokens) == _expected_stops(_new(ref.sequences), eos)


def test_low_memory_contrastive_search_gives_the_same_tokens(tiny: TinyModel) -> None:
    """transformers' low_memory=True scores the top_k candidates one by one; kvgen accepts it and scores them in one
    batch, with transformers' sequential tokens (one unpadded prompt: transformers' low_memory path fails on a
    padded batch)."""
    kwargs = {"penalty_alpha": 0.6, "top_k": 4, "max_new_tokens": 12, "pad_token_id": PAD}
    with torch.inference_mode():
        ref = tiny.ref.generate(IDS[:1], attention_mask=MASK[:1], low_memory=True, **kwargs)
    ours = generate(tiny.ours, IDS[:1], MASK[:1], GenerationConfig(low_memory=True, eos_token_id=[], **kwargs))
    assert ours.sequences.tolist() == ref.tolist()
    assert ours.sequences.tolist() != generate(tiny.ours, IDS[:1], MASK[:1], max_new_tokens=12).sequences.tolist()


# ---------------------------------------------------------------- sample-and-rank


def _ref_logprob(tiny: TinyModel, prompt: list[int], new_ids: list[int]) -> float:
    """Sum of transformers' log softmax(raw logits) of ``new_ids`` after ``prompt`` (one uncached forward)."""
    with torch.inference_mode():
        logits = tiny.ref(torch.tensor([prompt + new_ids])).logits  # [1, T, V]
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)  # [T_new, V]
    return float(logprobs.gather(1, torch.tensor(new_ids)[:, None]).sum())


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_sample_and_rank_scores_are_transformers_log_likelihoods(tiny: TinyModel, length_penalty: float) -> None:
    eos = _two_eos(tiny)
    kwargs = {"do_sample": True, "best_of": 4, "top_k": 0, "seed": 11,
              "length_penalty": length_penalty}
    everything = _ours(tiny, eos, num_return_sequences=4, **kwargs)
    assert everything.sequences_scores is not None
    for i, new_ids in enumerate(everything.new_token_ids):
        expected = _ref_logprob(tiny, PROMPTS[i // 4], new_ids) / len(new_ids) ** length_penalty
        assert everything.sequences_scores[i].item() == pytest.approx(expected, abs=1e-4)
    assert "stop" in everything.finish_reasons and "length" in everything.finish_reasons
    best = _ours(tiny, eos, num_return_sequences=2, **kwargs)
    for p in range(3):
        scores = everything.sequences_scores[4 * p : 4 * p + 4].tolist()
        assert scores == sorted(scores, reverse=True) and len(set(scores)) > 1
        assert best.new_token_ids[2 * p : 2 * p + 2] == everything.new_token_ids[4 * p : 4 * p + 2]


# ---------------------------------------------------------------- the caller's own logits processors


class _Boost:
    """Adds ``bias`` to one token's logit: a caller's processor, usable by transformers and kvgen alike."""

    def __init__(self, token_id: int, bias: float) -> None:
        self.token_id, self.bias = token_id, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.token_id] += self.bias
        return scores


def test_custom_logits_processors_run_where_transformers_runs_them(tiny: TinyModel) -> None:
    """After the built processors and before the warpers: with temperature 0.5 a +2 boost counts double, so the
    processed scores (and the seeded draws) pin the position; greedy output changes and matches too."""
    token = _greedy_new(tiny)[0][2]
    greedy_ref = _hf(tiny, logits_processor=LogitsProcessorList([_Boost(token, -1e4)]))
    assert _new(greedy_ref.sequences)[0][2] != token  # the processor changed the output
    ours = generate(tiny.ours, IDS, MASK, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=PAD,
                                                           output_scores=True), logits_processor=[_Boost(token, -1e4)])
    assert ours.sequences.tolist() == greedy_ref.sequences.tolist()
    kwargs = {"do_sample": True, "temperature": 0.5, "top_k": 0, "repetition_penalty": 1.2}
    ref = _hf_seeded(tiny, 5, [], logits_processor=LogitsProcessorList([_Boost(token, 2.0)]), **kwargs)
    ours = generate(tiny.ours, IDS, MASK, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=PAD,
                                                           seed=5, output_scores=True, **kwargs),
                    logits_processor=[_Boost(token, 2.0)])
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)



def test_unknown_and_unimplemented_settings_are_named(tiny: TinyModel) -> None:
    """A typo is a ValueError listing it (transformers: "model_kwargs are not used"); a transformers setting kvgen
    does not implement is a NotImplementedError naming it and its feature, never a TypeError."""
    with pytest.raises(ValueError, match=r"unknown generation setting\(s\) \['max_new_token'\]"):
        generate(tiny.ours, IDS, MASK, max_new_token=3)
    with pytest.raises(NotImplementedError, match=r"assistant_early_exit \(self-speculative decoding\)"):
        generate(tiny.ours, IDS, MASK, assistant_early_exit=2)
    with pytest.raises(NotImplementedError, match=r"token_healing \(token healing\)"):
        generate(tiny.ours, IDS, MASK, token_healing=True)


# ---------------------------------------------------------------- watermarking

WATERMARKS = {
    "lefthash, greedy": ({"bias": 3.0}, {}),
    "selfhash, width 2, seeded sampling": ({"bias": 2.0, "seeding_scheme": "selfhash", "context_width": 2},
                                          {"do_sample": True, "seed": 3}),
    "lefthash, beam search": ({"greenlist_ratio": 0.5, "bias": 1.5}, {"num_beams": 3}),
}


@pytest.mark.parametrize("name", list(WATERMARKS))
def test_watermarked_generation_matches_transformers(tiny: TinyModel, name: str) -> None:
    """watermarking_config as a dict (transformers' WatermarkingConfig fields), after every other processor."""
    fields, kwargs = WATERMARKS[name][0], dict(WATERMARKS[name][1])
    eos = _two_eos(tiny)
    seed = kwargs.pop("seed", None)
    ref = _hf(tiny, eos, watermarking_config=fields, **kwargs) if seed is None else _hf_seeded(
        tiny, seed, eos, watermarking_config=fields, **kwargs)
    ours = _ours(tiny, eos, watermarking_config=fields, output_scores=True, seed=seed, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)
    plain = _ours(tiny, eos, seed=seed, **kwargs)
    assert plain.sequences.tolist() != ours.sequences.tolist()  # the watermark changed the tokens


@pytest.mark.parametrize("settings", [{"do_sample": True, "seed": 3, "top_k": 0},
                                      {"do_sample": True, "seed": 8, "num_return_sequences": 2, "temperature": 0.7},
                                      {"num_beams": 3}])
def test_synthid_watermarked_generation_matches_transformers(tiny: TinyModel, settings: dict[str, Any]) -> None:
    """SynthID (tournament layers over the sampling distribution) on a padded batch: transformers' tokens and
    per-step distributions, and other tokens than without it. The scores are compared as probabilities: ten
    layers of p * (1 + g - E[g]) leave the least likely tokens' log-probabilities carrying the float noise of the
    logits many times over (0.2 apart at p ~ 1e-9), the bit-equal processor notwithstanding (tests/sampling)."""
    from transformers.generation import SynthIDTextWatermarkingConfig as HFSynthIDConfig

    fields = {"ngram_len": 3, "keys": [654, 400, 836, 123, 340, 443, 597, 160, 57, 29]}
    kwargs, eos, seed = dict(settings), _two_eos(tiny), settings.get("seed")
    kwargs.pop("seed", None)
    ref = _hf(tiny, eos, watermarking_config=HFSynthIDConfig(**fields), **kwargs) if seed is None else _hf_seeded(
        tiny, seed, eos, watermarking_config=HFSynthIDConfig(**fields), **kwargs)
    ours = _ours(tiny, eos, watermarking_config=fields, output_scores=True, seed=seed, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert ours.scores is not None and len(ours.scores) == len(ref.scores)
    for got, want in zip(ours.scores, ref.scores, strict=True):  # [N, V] log-probabilities per step
        torch.testing.assert_close(got.exp(), want.exp(), rtol=1e-4, atol=1e-4)
    assert _ours(tiny, eos, seed=seed, **kwargs).sequences.tolist() != ours.sequences.tolist()


# ---------------------------------------------------------------- DoLa decoding

@pytest.mark.parametrize("dola_layers", ["low", "high", [0, 1]])
def test_dola_greedy_matches_transformers(tiny: TinyModel, dola_layers: Any) -> None:
    """Tokens, DoLa scores and the final layer's logits equal transformers' ``_dola_decoding`` (with [0, 1] two
    candidate layers: the Jensen-Shannon choice between them)."""
    eos = _two_eos(tiny)
    ref = _hf(tiny, eos, dola_layers=dola_layers, repetition_penalty=1.2, output_logits=True)
    assert ref.sequences.tolist() != _hf(tiny, eos, repetition_penalty=1.2).sequences.tolist()  # DoLa changes it
    ours = _ours(tiny, eos, dola_layers=dola_layers, repetition_penalty=1.2, output_scores=True, output_logits=True)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)
    assert ours.logits is not None
    for got, want in zip(ours.logits, ref.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dola_sampling_matches_transformers(tiny: TinyModel) -> None:
    kwargs = {"do_sample": True, "num_return_sequences": 2, "dola_layers": [0, 1], "top_k": 0, "temperature": 0.8}
    ref = _hf_seeded(tiny, 4, _two_eos(tiny), **kwargs)
    ours = _ours(tiny, _two_eos(tiny), seed=4, output_scores=True, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)


@pytest.mark.parametrize("dola_layers", ["low", "high"])
def test_dola_picks_transformers_layers_on_a_deeper_tied_model(dola_layers: str) -> None:
    """8 tied layers: 'low' contrasts layer 2 (the embeddings skipped), 'high' layers 4 and 6, as transformers."""
    deep = make_tiny_model("llama", std=0.5, tie=True, num_hidden_layers=8)
    with torch.inference_mode():
        ref = deep.ref.generate(IDS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, eos_token_id=None,
                                dola_layers=dola_layers, return_dict_in_generate=True, output_scores=True)
    ours = generate(deep.ours, IDS, MASK, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=PAD,
                                                           dola_layers=dola_layers, output_scores=True))
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)


@pytest.mark.parametrize("model_type", ["gemma2", "granite"])
def test_dola_early_exits_skip_the_final_softcap_and_logits_scaling(model_type: str) -> None:
    """transformers contrasts with the bare ``lm_head(hidden_states[i])``: Gemma 2's final softcap and Granite's
    logits_scaling apply to the final layer's logits only."""
    model = make_tiny_model(model_type, std=0.5)
    with torch.inference_mode():
        ref = model.ref.generate(IDS, attention_mask=MASK, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                                 eos_token_id=None, dola_layers=[0, 1], return_dict_in_generate=True,
                                 output_scores=True)
    ours = generate(model.ours, IDS, MASK, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                                            pad_token_id=PAD, dola_layers=[0, 1], output_scores=True))
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)


def test_dola_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="dola_layers must be 'low', 'high' or a non-empty list"):
        GenerationConfig(dola_layers="middle")
    with pytest.raises(ValueError, match="dola_layers works with greedy search or sampling only"):
        GenerationConfig(dola_layers="low", num_beams=2)
    with pytest.raises(ValueError, match="conflicts"):
        GenerationConfig(dola_layers="low", num_return_sequences=2)


# ---------------------------------------------------------------- classifier-free guidance

NEGATIVE_IDS, NEGATIVE_MASK = left_pad([[9, 14, 2], [30], [21, 7]], PAD)  # [3, 3]: one unconditional prompt per row

GUIDED: dict[str, dict[str, Any]] = {
    "greedy, scale 1.5": {"guidance_scale": 1.5},
    "greedy, scale 3, negative prompt": {"guidance_scale": 3.0, "negative_prompt_ids": NEGATIVE_IDS,
                                         "negative_prompt_attention_mask": NEGATIVE_MASK},
    "beams, scale 2": {"guidance_scale": 2.0, "num_beams": 3, "num_return_sequences": 2},  # rows never reordered
    "contrastive, scale 1.5": {"guidance_scale": 1.5, "penalty_alpha": 0.6, "top_k": 4},
    "group beams, scale 3": {"guidance_scale": 3.0, "num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.5,
                             "num_return_sequences": 2},  # guidance before the diversity penalty, as HF
}


@pytest.mark.parametrize("name", list(GUIDED))
def test_classifier_free_guidance_matches_transformers(tiny: TinyModel, name: str) -> None:
    kwargs = dict(GUIDED[name])
    # one EOS id for groups: transformers' BeamSearchScorer ends a group's hypotheses with eos[0], not the EOS drawn
    eos = _two_eos(tiny)[: 1 if "num_beam_groups" in kwargs else 2]
    ref = _hf(tiny, eos, **kwargs)
    unguided = {k: v for k, v in kwargs.items() if not k.startswith(("guidance", "negative"))}
    assert ref.sequences.tolist() != _hf(tiny, eos, **unguided).sequences.tolist()  # guidance changes the output
    negative = {k: kwargs.pop(k) for k in ("negative_prompt_ids", "negative_prompt_attention_mask") if k in kwargs}
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD, output_scores=True, **kwargs)
    ours = generate(tiny.ours, IDS, MASK, cfg, **negative)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    if "num_beams" not in kwargs:
        _assert_scores_close(ours, ref)


def test_guided_sampling_matches_transformers(tiny: TinyModel) -> None:
    kwargs = {"do_sample": True, "guidance_scale": 2.0, "num_return_sequences": 2, "top_k": 0}
    ref = _hf_seeded(tiny, 6, _two_eos(tiny), **kwargs)
    ours = _ours(tiny, _two_eos(tiny), seed=6, output_scores=True, **kwargs)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    _assert_scores_close(ours, ref)


def test_guidance_refusals(tiny: TinyModel) -> None:
    with pytest.raises(ValueError, match="negative_prompt_ids must be"):
        generate(tiny.ours, IDS, MASK, guidance_scale=2.0, negative_prompt_ids=NEGATIVE_IDS[:2])
    with pytest.raises(ValueError, match="guidance_scale must be"):
        GenerationConfig(guidance_scale=-1.0)
    with pytest.raises(ValueError, match="guidance_scale cannot be used with prompt_lookup"):
        generate(tiny.ours, IDS[:1], MASK[:1], guidance_scale=2.0, prompt_lookup_num_tokens=3)
