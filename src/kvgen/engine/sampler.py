"""Batched ``Sampler``: one next token per row, each row with its own ``SamplingParams`` and generator.

Order (vLLM v1's model runner, then ``Sampler.forward``, declared in ``kvgen.sampling.pipeline.ENGINE_ORDER``):
the structured-output mask (tokens a request's grammar forbids get -inf; vLLM's ``apply_grammar_bitmask`` before
the sampler) -> logprobs of those logits (vLLM's default ``raw_logprobs``: before every other stage)
-> allowed_token_ids -> bad_words -> min_tokens (EOS and
``stop_token_ids`` suppressed) -> logit_bias -> repetition penalty (prompt and output)
-> presence / frequency penalties (output) -> argmax for greedy rows (temperature 0)
-> temperature -> min_p -> top_k -> top_p -> one inverse-CDF draw per sampled row from
that row's ``torch.Generator``, so a seeded request gets the same tokens whatever else
is in the batch (on the kernels, which compute each row alone; a float32 model's batched matmuls can move a logit
by ~1e-5, which changes a draw only on a near-tie). Every stage is the per-row op of ``kvgen.sampling.ops`` that
``generate()`` uses; a stage runs only when some row enables it. A row whose masks (structured outputs,
allowed_token_ids, bad_words, min_tokens) leave no token with a finite logit gets :data:`NO_TOKEN` instead of a
draw, and the scheduler ends that request alone.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.structured_outputs import GrammarMatcher
from kvgen.engine.types import NO_TOKEN, Logprob, PositionLogprobs
from kvgen.kernels import KernelOps
from kvgen.sampling import ops
from kvgen.sampling.pipeline import (
    ENGINE_FIRST_SAMPLING_STAGE,
    ENGINE_ORDER,
    split_order,
)


@dataclass
class SamplingRow:
    """What the sampler needs about one row besides its logits."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: Sequence[int] = ()
    grammar: GrammarMatcher | None = None  # structured outputs: only the tokens it allows may be drawn


@dataclass
class SamplerOutput:
    """token_ids: [B] ints (:data:`NO_TOKEN` for a row with nothing left to draw); logprobs: one entry per row, None
    where the row asked for none or drew nothing."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Ragged id lists as [B, T] long, right-padded with -1 (which ops never count)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out  # [B, T]


def _column(values: Sequence[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)  # [B]


Stage = Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor]


class Sampler:
    """``sampler(logits [B, V] float32, rows) -> SamplerOutput``, stages in ``ENGINE_ORDER``.

    Stages before ``ENGINE_FIRST_SAMPLING_STAGE`` run on every row; greedy rows then
    take the argmax, sampled rows go through the remaining stages and one draw each
    (``ops.choose_tokens``, inverse CDF). A stage runs only when some row enables it.
    With ``kernels`` (the model's), the draw is their ``softmax_draw`` (softmax and search in one
    pass per row, the same ids as the torch ops), which also applies the temperature when no
    sampled row filters (min_p, top_k, top_p): the OpenAI default request. When one does, their
    ``filter_draw`` runs the sampling stages and the draw per row in C++ (the same ids as the torch
    ops; a row it cannot decide bit-exactly, -1, goes through the torch stages instead).
    """

    def __init__(self, kernels: KernelOps | None = None) -> None:
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        params = [r.sampling_params for r in rows]
        wants_logprobs = [p.logprobs is not None for p in params]
        logits = apply_grammar_mask(logits, rows)  # [B, V]
        raw_logprobs = ops.compute_logprobs(logits) if any(wants_logprobs) else None  # [B, V]
        logits = apply_stages(logits, rows, _EVERY_ROW)  # [B, V]
        if blocked := rows_without_tokens(logits, rows):  # drawn from zeros below, then NO_TOKEN
            logits = logits.index_fill(0, torch.tensor(blocked), 0.0)  # [B, V]
        sampled = [i for i, r in enumerate(rows) if not r.sampling_params.is_greedy]
        is_all_sampled = len(sampled) == len(rows)
        if is_all_sampled:
            token_ids = self._draw(logits, rows)  # [B]
        else:
            token_ids = ops.greedy(logits, None if self.kernels is None else self.kernels.argmax)  # [B]
            if sampled:
                token_ids[sampled] = self._draw(logits[sampled], [rows[i] for i in sampled])
        logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = token_logprobs(raw_logprobs, token_ids, [p.logprobs for p in params])
        ids = token_ids.tolist()
        for i in blocked:
            ids[i], logprobs[i] = NO_TOKEN, None
        return SamplerOutput(ids, logprobs)

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The sampling stages and one draw per row of x [B', V]; returns [B'] long."""
        generators = [r.generator for r in rows]
        if self.kernels is None:
            x = apply_stages(x, rows, _SAMPLED_ONLY)
            return ops.choose_tokens(x, True, generators, draw="inverse_cdf").squeeze(1)
        params = [r.sampling_params for r in rows]
        u = ops.uniforms(len(rows), generators).view(-1)  # [B']
        top_ps = [vllm_top_p(p.top_p) for p in params]
        if not any(p.min_p > 0 or p.top_k > 0 for p in params) and all(p == 1 for p in top_ps):  # the kernel divides
            return self.kernels.softmax_draw(x.float(), _column([p.temperature for p in params]), u)
        temperature, min_p, top_k, top_p = torch.tensor(  # one [4, B'] float64 tensor: its rows are the op's columns
            [[p.temperature for p in params], [p.min_p for p in params], [p.top_k for p in params], top_ps],
            dtype=torch.float64)
        token_ids = self.kernels.filter_draw(x.float(), temperature, min_p, top_k, top_p, u)  # [B'], -1: undecided
        if undecided := [i for i, t in enumerate(token_ids.tolist()) if t < 0]:  # float32 rounding could matter
            y = apply_stages(x[undecided], [rows[i] for i in undecided], _SAMPLED_ONLY)  # the torch stages
            token_ids[undecided] = self.kernels.softmax_draw(y.float(), torch.ones(len(undecided), dtype=torch.float64),
                                                             u[undecided])
        return token_ids


def apply_stages(logits: torch.Tensor, rows: list[SamplingRow], names: Sequence[str]) -> torch.Tensor:
    """Run the named stages (of ``ENGINE_ORDER``) in the given order. logits: [B, V]. Returns [B, V]."""
    for name in names:
        logits = _STAGES[name](logits, rows)
    return logits


def rows_without_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Indices of the rows of logits [B, V] whose masks (a grammar, allowed_token_ids, bad_words, min_tokens: the
    stages that set -inf) left no finite logit; only rows with such a mask are looked at."""
    masked = [i for i, r in enumerate(rows) if r.grammar is not None or r.sampling_params.allowed_token_ids
              or r.sampling_params.bad_words_token_ids or len(r.output_token_ids) < r.sampling_params.min_tokens]
    if not masked:
        return []
    best = logits[masked].amax(dim=1).tolist()  # [len(masked)]
    return [i for i, b in zip(masked, best) if b == float("-inf")]


def apply_grammar_mask(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for the tokens each row's grammar forbids (structured outputs); logits [B, V] -> [B, V]. A row whose
    grammar allows nothing (a matcher in error) is left as it is: the scheduler then ends the request."""
    constrained = [(i, r.grammar.allowed_tokens()) for i, r in enumerate(rows) if r.grammar is not None]
    constrained = [(i, allowed) for i, allowed in constrained if allowed.any()]
    if not constrained:
        return logits
    allowed = torch.ones_like(logits, dtype=torch.bool)  # [B, V]
    for i, row_allowed in constrained:
        allowed[i, : row_allowed.numel()] = row_allowed
        allowed[i, row_allowed.numel() :] = False
    return logits.masked_fill(~allowed, float("-inf"))


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for every id outside a row's ``allowed_token_ids`` (rows without the setting untouched); [B, V]."""
    limited = [(i, r.sampling_params.allowed_token_ids) for i, r in enumerate(rows) if r.sampling_params.allowed_token_ids]
    if not limited:
        return logits
    banned = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]
    for i, allowed in limited:
        banned[i] = True
        banned[i, torch.tensor(allowed, dtype=torch.long)] = False
    return logits.masked_fill(banned, float("-inf"))


def apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """-inf for the last token of each of a row's ``bad_words_token_ids`` whose other tokens end its output (a
    one-token word is always banned); [B, V]. Source: vLLM v1 ``apply_bad_words`` (output tokens only)."""
    banned = [(i, ids[-1]) for i, r in enumerate(rows) for ids in r.sampling_params.bad_words_token_ids or ()
              if len(ids) == 1 or (len(ids) - 1 <= len(r.output_token_ids) and r.output_token_ids[1 - len(ids):] == ids[:-1])]
    banned = [(i, t) for i, t in banned if t < logits.shape[1]]
    if not banned:
        return logits
    row_ids, token_ids = zip(*banned)
    return logits.index_put((torch.tensor(row_ids), torch.tensor(token_ids)), torch.tensor(float("-inf")))


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows short of ``min_tokens`` may not draw EOS or a stop token id; EOS even with ``ignore_eos`` (vLLM's
    ``MinTokensLogitsProcessor`` masks ``all_stop_token_ids``, which hold EOS whatever ``ignore_eos``)."""
    groups: dict[tuple[int, ...], list[int]] = {}  # stop ids -> rows short of min_tokens
    for i, r in enumerate(rows):
        p = r.sampling_params
        if len(r.output_token_ids) < p.min_tokens:
            ids = set(p.stop_token_ids or ()) | set(r.eos_token_ids)
            if ids:
                groups.setdefault(tuple(sorted(ids)), []).append(i)
    if not groups:
        return logits
    num_generated = _column([len(r.output_token_ids) for r in rows], torch.long)  # [B]
    for stop_ids, members in groups.items():
        min_tokens = torch.zeros(len(rows), dtype=torch.long)  # [B]; 0 leaves a row alone
        min_tokens[members] = _column([rows[i].sampling_params.min_tokens for i in members], torch.long)
        logits = ops.apply_min_tokens(logits, num_generated, min_tokens, stop_ids)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` (token id -> bias) to its logits [B, V]; ids >= V are ignored."""
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.sampling_params.logit_bias or {}).items()]
    entries = [e for e in entries if e[1] < logits.shape[1]]
    if not entries:
        return logits
    row_ids, token_ids, biases = zip(*entries)
    index = (torch.tensor(row_ids), torch.tensor(token_ids))  # [E], [E]: (row, id) pairs are unique (dict keys)
    return logits.index_put(index, logits[index] + torch.tensor(biases, dtype=logits.dtype))  # x + b, as accumulate


def apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """CTRL penalty over prompt and output ids (vLLM: both count as seen)."""
    repetition = [r.sampling_params.repetition_penalty for r in rows]
    if all(x == 1.0 for x in repetition):
        return logits
    history = _padded([r.prompt_token_ids + r.output_token_ids for r in rows])  # [B, T]
    return ops.apply_repetition_penalty(logits, history, _column(repetition))


def apply_presence_frequency_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI penalties over output ids: frequency (per count), then presence."""
    presence = [r.sampling_params.presence_penalty for r in rows]
    frequency = [r.sampling_params.frequency_penalty for r in rows]
    if all(x == 0.0 for x in presence + frequency):
        return logits
    outputs = _padded([r.output_token_ids for r in rows])  # [B, T]
    return ops.apply_presence_frequency_penalty(logits, outputs, _column(presence), _column(frequency))


def apply_temperature(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Divide sampled rows by their temperature (>= SAMPLING_EPS here: lower is greedy)."""
    return ops.apply_temperature(logits, _column([r.sampling_params.temperature for r in rows]))


def apply_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    min_p = [r.sampling_params.min_p for r in rows]
    return ops.apply_min_p(logits, _column(min_p)) if any(x > 0 for x in min_p) else logits


def apply_top_k(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    top_k = [r.sampling_params.top_k for r in rows]
    return ops.apply_top_k(logits, _column(top_k, torch.long)) if any(k > 0 for k in top_k) else logits


def apply_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    top_p = [vllm_top_p(r.sampling_params.top_p) for r in rows]
    return ops.apply_top_p(logits, _column(top_p)) if any(p < 1 for p in top_p) else logits


_FLOAT32_TINY = torch.finfo(torch.float32).tiny


def vllm_top_p(top_p: float) -> float:
    """top_p rounded to float32, as vLLM v1 holds it (``InputBatch.top_p_cpu_tensor``), so that the threshold
    ``1 - top_p`` (exact in float64, then rounded to float32 by ``ops.apply_top_p``) is vLLM's float32 ``1 - p``:
    0.10000002 for 0.9, where 1 - 0.9 in float64 rounds to 0.1000000015. Kept above 0 (a top_p below float32's range
    keeps the top token, as vLLM's 0 does)."""
    return max(struct.unpack("f", struct.pack("f", top_p))[0], _FLOAT32_TINY)


# ENGINE_ORDER's stage names -> the batched stage over SamplingRows (each a kvgen.sampling.ops op).
_STAGES: dict[str, Stage] = {
    "allowed_token_ids": apply_allowed_token_ids,
    "bad_words": apply_bad_words,
    "min_tokens": apply_min_tokens,
    "logit_bias": apply_logit_bias,
    "repetition_penalty": apply_repetition_penalty,
    "presence_frequency_penalty": apply_presence_frequency_penalty,
    "temperature": apply_temperature,
    "min_p": apply_min_p,
    "top_k": apply_top_k,
    "top_p": apply_top_p,
}
_EVERY_ROW, _SAMPLED_ONLY = split_order(ENGINE_ORDER, ENGINE_FIRST_SAMPLING_STAGE)


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, nums: list[int | None]
                   ) -> list[PositionLogprobs | None]:
    """Per row, vLLM's logprobs dict: the chosen id (its logprob and vocabulary rank) first, then the ``nums[i]``
    most likely ids with ranks 1..nums[i] (None where not asked; ``decoded_token`` is left for the output processor).

    logprobs: [B, V] float32; token_ids: [B] long. Source: vLLM v1 ``LogprobsProcessor._make_logprob_dict``.
    """
    chosen = ops.gather_logprobs(logprobs, token_ids).tolist()  # [B]
    ranks = ops.logprob_ranks(logprobs, token_ids).tolist()  # [B]
    ids = token_ids.tolist()  # [B]
    top_values, top_ids = ops.top_logprobs(logprobs, max(n or 0 for n in nums))  # [B, k_max]
    out: list[PositionLogprobs | None] = []
    for i, n in enumerate(nums):
        if n is None:
            out.append(None)
            continue
        entry = {ids[i]: Logprob(chosen[i], ranks[i])}
        for rank, (token_id, value) in enumerate(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist()), 1):
            entry[token_id] = Logprob(value, rank)
        out.append(entry)
    return out
