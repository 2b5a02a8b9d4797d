"""Beam search over the engine (vLLM ``LLM.beam_search`` and the server's ``use_beam_search``).

Each step sends every live beam to the engine as its own request (the beam's tokens as the prompt,
``max_tokens=1``, ``logprobs=2 * beam_width``, at most the vocabulary); the prefix cache keeps that from recomputing the shared
prefixes. Each beam's candidates are the returned top ``2 * beam_width`` tokens plus the sampled one; a
candidate ending in EOS is completed, the best ``beam_width`` of the rest (by score) are the next beams. After
``max_tokens`` steps the completed and live beams are ranked together and the best ``beam_width`` returned.
Score = cumulative logprob / len(tokens) ** length_penalty, the tokens counting the prompt but not a final EOS.
Source: vLLM ``vllm/entrypoints/llm.py::LLM.beam_search`` and ``vllm/beam_search.py``; without EOS (or with
``ignore_eos``) the beams are those of transformers' beam search, which tests check.

The loop is a generator (:func:`beam_search_steps`), so the offline ``LLM`` and the async server drive the same code.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from kvgen.engine.outputs import RequestOutput
from kvgen.engine.types import Logprob, PositionLogprobs, SampleLogprobs
from kvgen.fields import as_bool, check_int, config_field

_f = config_field

Candidates = PositionLogprobs | None  # one beam's next-token ids -> Logprob; None: the beam cannot go on


@dataclass
class BeamSearchParams:
    """vLLM ``BeamSearchParams``. ``temperature`` only changes which extra (sampled) token joins each beam's
    candidates (0 = the most likely, already among them). Raises ``ValueError`` naming a bad field."""

    beam_width: int = _f(4, "beams kept per prompt (and sequences returned)")
    max_tokens: int = _f(16, "tokens generated per beam")
    ignore_eos: bool = _f(False, "treat EOS as an ordinary token")
    temperature: float = _f(0.0, "temperature of the extra sampled candidate")
    length_penalty: float = _f(1.0, "score = cumulative logprob / len(tokens) ** length_penalty")
    include_stop_str_in_output: bool = _f(False, "accepted as vLLM does; beam search has no stop strings")

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1)
        check_int("max_tokens", self.max_tokens, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) or not (
                abs(self.length_penalty) < float("inf")):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):  # "no" would be truthy: EOS silently ignored
            setattr(self, name, as_bool(name, getattr(self, name)))


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (prompt + generated ids), per generated token its candidates (id -> ``Logprob``, as
    vLLM's), the sum of the chosen tokens' logprobs, and, once returned, ``text`` and ``finish_reason`` ("stop" on
    EOS, else "length")."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: Sequence[int],
                      length_penalty: float) -> float:
    """cum_logprob / len(tokens) ** length_penalty, a final EOS not counted (vLLM ``get_beam_search_score``)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length**length_penalty)


def num_candidates(beam_width: int, vocab_size: int) -> int:
    """The top logprobs each beam's step asks for: ``2 * beam_width`` (vLLM, after transformers), at most the whole
    vocabulary, whose every token is then a candidate (as in transformers' beam search)."""
    return min(2 * beam_width, vocab_size)


def candidates_of(output: RequestOutput) -> Candidates:
    """A finished one-token request's sampled id and top alternatives: its logprobs dict (the sampled id first);
    None when it produced no token."""
    completion = output.outputs[0]
    if not completion.logprobs or not completion.token_ids:
        return None
    return completion.logprobs[0]


def token_logprobs(beam: BeamSearchSequence, num_prompt_tokens: int, num_top: int) -> SampleLogprobs:
    """Per generated token of ``beam``: its entry, then the ``num_top`` best of its step's candidates."""
    return [{token: candidates[token], **dict(sorted(candidates.items(), key=lambda kv: -kv[1].logprob)[:num_top])}
            for token, candidates in zip(beam.tokens[num_prompt_tokens:], beam.logprobs, strict=True)]


def beam_search_steps(
    prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: Sequence[int], max_model_len: int
) -> Generator[list[list[int]], list[Candidates], list[list[BeamSearchSequence]]]:
    """The beam search of every prompt at once. Yields the token lists to run for one step (every live beam) and
    takes back one :data:`Candidates` per list; returns each prompt's best ``beam_width`` beams, best first.
    A beam that reaches ``max_model_len`` tokens stops there ("length")."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    live = [[BeamSearchSequence(list(p))] for p in prompts]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        for beams, done in zip(live, completed):
            done += [b for b in beams if len(b.tokens) >= max_model_len]
            beams[:] = [b for b in beams if len(b.tokens) < max_model_len]
        flat = [b for beams in live for b in beams]
        if not flat:
            break
        results = yield [b.tokens for b in flat]
        by_beam = dict(zip(map(id, flat), results, strict=True))
        for i, beams in enumerate(live):
            grown: list[BeamSearchSequence] = []
            for beam in beams:
                candidates = by_beam[id(beam)] or {}
                for token, logprob in candidates.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [candidates],
                                             beam.cum_logprob + logprob.logprob)
                    (completed[i] if token in eos else grown).append(new)
            live[i] = sorted(grown, key=score, reverse=True)[: params.beam_width]
    best = []
    for beams, done in zip(live, completed):
        ranked = sorted(done + beams, key=score, reverse=True)[: params.beam_width]
        for beam in ranked:
            beam.finish_reason = "stop" if beam.tokens[-1] in eos else "length"
        best.append(ranked)
    return best
