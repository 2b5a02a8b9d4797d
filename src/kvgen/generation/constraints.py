"""Constraints of constrained beam search: token sequences the output must contain.

A :class:`PhrasalConstraint` is fulfilled by one sequence of ids, a :class:`DisjunctiveConstraint` by any one of
several (a trie of them). A constraint takes the generated tokens one by one (``update``); a
:class:`ConstraintListState` follows one hypothesis through a list of constraints and gives its *bank*, the
number of constraint tokens fulfilled so far, by which constrained beam search keeps hypotheses at every stage
of progress.

Source: Hokamp & Liu 2017, "Lexically Constrained Decoding for Sequence Generation Using Grid Beam Search";
the behaviour, corner cases included, of transformers 4.55 ``generation/beam_constraints.py``, which
constrained beam search must agree with token for token:

- a token that breaks an in-progress constraint resets it (back to the end of the pending list) and is not
  offered to the other constraints;
- a stateful copy of a disjunctive constraint shares its list of matched tokens with the original, so the
  banks of hypotheses advanced from one beam in one step see each other's tokens.

Any object with the :class:`Constraint` methods and a ``seqlen`` works, transformers' constraint objects too.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

_METHODS = ("advance", "does_advance", "update", "reset", "remaining", "copy")


class Constraint(abc.ABC):
    """A token sequence (or a choice of them) the output must contain; ``seqlen``: its length in tokens (the
    longest choice)."""

    seqlen: int

    @abc.abstractmethod
    def advance(self) -> int | list[int] | None:
        """The token id(s) that would make progress, None when fulfilled."""

    @abc.abstractmethod
    def does_advance(self, token_id: int) -> bool:
        """Whether ``token_id`` makes progress (state unchanged)."""

    @abc.abstractmethod
    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        """Take a generated token; returns (stepped, completed, reset)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the progress made."""

    @abc.abstractmethod
    def remaining(self) -> int:
        """Tokens still needed (0 when fulfilled)."""

    @abc.abstractmethod
    def copy(self, stateful: bool = False) -> Constraint:
        """A fresh copy, with this one's progress when ``stateful``."""


def _check_ids(token_ids: object, what: str) -> list[int]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in token_ids):
        raise ValueError(f"{what} must be a non-empty list of token ids >= 0, got {token_ids!r}")
    return list(token_ids)


class PhrasalConstraint(Constraint):
    """The ids ``token_ids`` must appear in this order, contiguously. Raises ``ValueError`` for an empty list or
    ids < 0. Reference: transformers 4.55 ``PhrasalConstraint``."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = _check_ids(token_ids, "PhrasalConstraint token_ids")
        self.seqlen = len(self.token_ids)
        self.fulfilled_idx = -1  # index of the last matched token
        self.completed = False

    def advance(self) -> int | None:
        return None if self.completed else self.token_ids[self.fulfilled_idx + 1]

    def does_advance(self, token_id: int) -> bool:
        return not self.completed and token_id == self.token_ids[self.fulfilled_idx + 1]

    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        if not self.does_advance(token_id):
            self.reset()
            return False, False, True
        self.fulfilled_idx += 1
        self.completed = self.fulfilled_idx == self.seqlen - 1
        return True, self.completed, False

    def reset(self) -> None:
        self.completed, self.fulfilled_idx = False, -1

    def remaining(self) -> int:
        return self.seqlen - (self.fulfilled_idx + 1)

    def copy(self, stateful: bool = False) -> PhrasalConstraint:
        new = PhrasalConstraint(self.token_ids)
        if stateful:
            new.fulfilled_idx, new.completed = self.fulfilled_idx, self.completed
        return new


class DisjunctiveConstraint(Constraint):
    """One of the id lists ``nested_token_ids`` must appear. Raises ``ValueError`` for an empty or malformed list,
    or when one list is a prefix of another (or a duplicate). Reference: transformers 4.55 ``DisjunctiveConstraint``
    and ``DisjunctiveTrie``."""

    def __init__(self, nested_token_ids: list[list[int]]) -> None:
        if not isinstance(nested_token_ids, (list, tuple)) or not nested_token_ids:
            raise ValueError(f"DisjunctiveConstraint needs a non-empty list of id lists, got {nested_token_ids!r}")
        words = [_check_ids(ids, "each list of a DisjunctiveConstraint") for ids in nested_token_ids]
        self.trie: dict[int, Any] = {}
        for ids in words:
            node = self.trie
            for t in ids:
                node = node.setdefault(t, {})
        if _count_leaves(self.trie) != len(words):
            raise ValueError(f"no list of a DisjunctiveConstraint may be a prefix of another, got {words}")
        self.token_ids = words
        self.seqlen = max(len(ids) for ids in words)
        self.current_seq: list[int] = []  # the ids matched so far (a path from the trie's root)
        self.completed = False

    def _next_ids(self) -> list[int]:
        node = self.trie
        for t in self.current_seq:
            node = node[t]
        return list(node)

    def advance(self) -> list[int] | None:
        return self._next_ids() or None

    def does_advance(self, token_id: int) -> bool:
        return token_id in self._next_ids()

    def update(self, token_id: int) -> tuple[bool, bool, bool]:
        stepped = self.does_advance(token_id)
        if stepped:
            self.current_seq.append(token_id)  # in place: shared with stateful copies (see the module docstring)
        else:
            self.reset()
        self.completed = not self._next_ids()
        return stepped, self.completed, not stepped

    def reset(self) -> None:
        self.completed, self.current_seq = False, []

    def remaining(self) -> int:
        return 0 if self.completed else self.seqlen - len(self.current_seq)

    def copy(self, stateful: bool = False) -> DisjunctiveConstraint:
        new = DisjunctiveConstraint(self.token_ids)
        if stateful:
            new.current_seq, new.completed = self.current_seq, self.completed  # the same list, as transformers
        return new


def _count_leaves(node: dict[int, Any]) -> int:
    return sum(_count_leaves(child) for child in node.values()) if node else 1


class ConstraintListState:
    """One hypothesis' progress through ``constraints`` (never modified: each state works on copies).

    ``completed``: every constraint fulfilled. Reference: transformers 4.55 ``ConstraintListState``.
    """

    def __init__(self, constraints: Sequence[Any]) -> None:
        self.constraints = constraints
        self.max_seqlen = max(c.seqlen for c in constraints)
        self.completed = False
        self.complete_constraints: list[Any] = []
        self.inprogress_constraint: Any = None
        self.pending_constraints = [c.copy(stateful=False) for c in constraints]

    @classmethod
    def after(cls, constraints: Sequence[Any], token_ids: list[int]) -> ConstraintListState:
        """The state after ``token_ids`` (prompt included), read from the start."""
        state = cls(constraints)
        for t in token_ids:
            if state.completed:
                break
            state.add(t)
        return state

    def get_bank(self) -> int:
        """Constraint tokens fulfilled: max_seqlen per complete constraint, plus the in-progress one's."""
        partial = self.max_seqlen - self.inprogress_constraint.remaining() if self.inprogress_constraint else 0
        return len(self.complete_constraints) * self.max_seqlen + partial

    def advance(self) -> list[int] | None:
        """The ids that make progress: the in-progress constraint's next, else every pending one's first."""
        sources = [self.inprogress_constraint] if self.inprogress_constraint is not None else self.pending_constraints
        ids: list[int] = []
        for c in sources:
            step = c.advance()
            ids += [step] if isinstance(step, int) else list(step or [])
        return ids or None

    def add(self, token_id: int) -> None:
        """Take one generated token."""
        if self.completed:
            return
        c = self.inprogress_constraint
        if c is not None:
            _, complete, reset = c.update(token_id)
            if reset:
                self.pending_constraints.append(c.copy(stateful=False))
                self.inprogress_constraint = None
            if complete:
                self.complete_constraints.append(c)
                self.inprogress_constraint = None
                self.completed = not self.pending_constraints
            return
        for i, c in enumerate(self.pending_constraints):
            if c.does_advance(token_id):
                stepped, complete, _ = c.update(token_id)
                if not stepped:
                    raise ValueError(f"constraint {c!r} did not step on token {token_id}, which it said advances it")
                if complete:
                    self.complete_constraints.append(c)
                else:
                    self.inprogress_constraint = c
                self.pending_constraints = self.pending_constraints[:i] + self.pending_constraints[i + 1:]
                self.completed = not self.pending_constraints and self.inprogress_constraint is None
                return

    def copy(self, stateful: bool = True) -> ConstraintListState:
        new = ConstraintListState(self.constraints)
        if stateful:
            new.complete_constraints = [c.copy(stateful=True) for c in self.complete_constraints]
            if self.inprogress_constraint is not None:
                new.inprogress_constraint = self.inprogress_constraint.copy(stateful=True)
            new.pending_constraints = [c.copy() for c in self.pending_constraints]
        return new


def build_constraints(force_words_ids: Any, constraints: Sequence[Any] | None) -> list[Any]:
    """``constraints`` then one constraint per entry of ``force_words_ids``: a list of ids is a
    :class:`PhrasalConstraint`, a list of id lists a :class:`DisjunctiveConstraint` (transformers 4.55
    ``generate``). Raises ``ValueError`` for a malformed entry or an object without the :class:`Constraint`
    methods."""
    built = list(constraints or [])
    for c in built:
        if any(not callable(getattr(c, m, None)) for m in _METHODS) or not isinstance(getattr(c, "seqlen", None), int):
            raise ValueError(f"constraints must be Constraint objects (PhrasalConstraint, DisjunctiveConstraint), "
                             f"got {c!r}")
    if force_words_ids is None:
        return built
    if not isinstance(force_words_ids, (list, tuple)) or not force_words_ids:
        raise ValueError(f"force_words_ids must be a non-empty list of id lists (or of lists of id lists), got "
                         f"{force_words_ids!r}")
    for word in force_words_ids:
        if isinstance(word, (list, tuple)) and word and isinstance(word[0], (list, tuple)):
            built.append(DisjunctiveConstraint(list(word)))
        else:
            built.append(PhrasalConstraint(word))
    return built


def fulfils_all(constraints: Sequence[Any], token_ids: list[int]) -> bool:
    """Whether ``token_ids`` (prompt included) fulfils every constraint, in transformers' reading."""
    return ConstraintListState.after(constraints, token_ids).completed
