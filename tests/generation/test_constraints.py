"""Constraint states of constrained beam search against transformers 4.55 ``beam_constraints`` on random
constraints and token streams: progress, banks and advance tokens equal, corner cases included."""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers.generation import beam_constraints as hf

from kvgen.generation.constraints import (
    ConstraintListState,
    DisjunctiveConstraint,
    PhrasalConstraint,
    build_constraints,
    fulfils_all,
)


def _random_force_words(rng: random.Random) -> list[Any]:
    """1-3 constraints over ids 0..5 (so token streams hit them often): phrases, or disjunctions whose words
    may share a prefix (a branching trie) but are never a prefix of one another."""
    force: list[Any] = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.5:
            force.append([rng.randrange(6) for _ in range(rng.randint(1, 3))])
            continue
        words: list[list[int]] = []
        for _ in range(rng.randint(1, 4)):
            stem = words[0][: rng.randint(0, len(words[0]))] if words and rng.random() < 0.6 else []
            word = stem + [rng.randrange(6) for _ in range(rng.randint(1, 2))]
            if all(word[: len(w)] != w and w[: len(word)] != word for w in words):
                words.append(word)
        force.append(words)
    return force


def _hf_constraints(force: list[Any]) -> list[Any]:
    return [hf.DisjunctiveConstraint(w) if isinstance(w[0], list) else hf.PhrasalConstraint(w) for w in force]


def _view(state: Any) -> tuple[bool, int, list[int] | None]:
    return state.completed, state.get_bank(), state.advance()


@pytest.mark.parametrize("seed", range(4))
def test_states_after_random_token_streams_equal_transformers(seed: int) -> None:
    rng = random.Random(seed)
    checked = {"completed": 0, "in progress": 0}
    for _ in range(150):
        force = _random_force_words(rng)
        ours, theirs = build_constraints(force, None), _hf_constraints(force)
        tokens = [rng.randrange(7) for _ in range(rng.randint(0, 16))]
        state = ConstraintListState.after(ours, tokens)
        ref = hf.ConstraintListState(theirs)
        ref.reset(tokens)
        assert _view(state) == _view(ref), (force, tokens)
        assert fulfils_all(ours, tokens) == ref.completed
        checked["completed" if ref.completed else "in progress"] += 1
        if state.completed:
            continue
        for token in state.advance() or []:  # the scorer's advance step: stateful copies, one per token
            mine, their = state.copy(stateful=True), ref.copy(stateful=True)
            mine.add(token)
            their.add(token)
            assert (mine.completed, mine.get_bank()) == (their.completed, their.get_bank()), (force, tokens, token)
    assert min(checked.values()) > 20  # both outcomes are exercised


def test_stateful_copies_of_a_disjunctive_constraint_share_their_progress_as_in_transformers() -> None:
    """Advancing one beam by each of two branches of a trie: the second copy sees the first one's token and goes on
    from it, and the first copy's bank counts both tokens (3, not 2). Banks are read after every advance, as the
    scorer reads them."""
    words = [[1, 2, 3, 4], [1, 3]]
    state, ref = ConstraintListState.after([DisjunctiveConstraint(words)], [1]), hf.ConstraintListState(
        [hf.DisjunctiveConstraint(words)])
    ref.reset([1])
    assert state.advance() == ref.advance() == [2, 3]
    ours = [state.copy(stateful=True) for _ in range(2)]
    theirs = [ref.copy(stateful=True) for _ in range(2)]
    for o, t, token in zip(ours, theirs, [2, 3], strict=True):
        o.add(token)
        t.add(token)
    assert [s.get_bank() for s in ours] == [s.get_bank() for s in theirs] == [3, 3]


def test_a_token_that_breaks_a_phrase_is_not_offered_to_the_others() -> None:
    """[7, 8] in progress, then 7: the phrase resets and 7 does not restart it (transformers' reading)."""
    constraints = [PhrasalConstraint([7, 8])]
    assert not fulfils_all(constraints, [7, 7, 8])
    assert fulfils_all(constraints, [7, 9, 7, 8])
    ref = hf.ConstraintListState([hf.PhrasalConstraint([7, 8])])
    ref.reset([7, 7, 8])
    assert not ref.completed


@pytest.mark.parametrize(("force", "message"), [
    ([], "non-empty list"),
    ([[]], "non-empty list of token ids"),
    ([[1, -2]], "token ids >= 0"),
    ([[[1, 2], [1]]], "prefix of another"),
    ([[[1, 2], [1, 2]]], "prefix of another"),
    ([[[1], "x"]], "non-empty list of token ids"),
])
def test_malformed_force_words_ids_are_refused(force: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_constraints(force, None)


def test_constraint_objects_are_taken_as_they_are() -> None:
    phrase, theirs = PhrasalConstraint([3, 4]), hf.PhrasalConstraint([5])
    assert build_constraints([[6]], [phrase, theirs])[:2] == [phrase, theirs]
    with pytest.raises(ValueError, match="Constraint objects"):
        build_constraints(None, [[3, 4]])
