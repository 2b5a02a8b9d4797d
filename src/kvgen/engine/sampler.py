"""Batched ``Sampler``: one next token per row, each row with its own ``SamplingParams`` and generator.

Order (vLLM v1 ``Sampler.forward``): logprobs of the RAW logits (vLLM's default
``raw_logprobs``) -> min_tokens (EOS and ``stop_token_ids`` suppressed) ->
logit_bias (OpenAI: added to the logits) -> repetition penalty (prompt and output) -> presence / frequency penalties (output)
-> argmax for greedy rows (temperature 0) -> temperature -> min_p -> top_k ->
top_p -> one multinomial draw per sampled row from that row's ``torch.Generator``,
so a seeded request gets the same tokens whatever else is in the batch. Every
transform is the per-row op of ``kvgen.sampling.ops`` that ``generate()`` uses; a
transform runs only when some row enables it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.types import TokenLogprobs
from kvgen.sampling import ops


@dataclass
class SamplingRow:
    """What the sampler needs about one row besides its logits."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """token_ids: [B] ints; logprobs: one entry per row, None where the row asked for none."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Ragged id lists as [B, T] long, right-padded with -1 (which ops never count)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out  # [B, T]


def _column(values: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)  # [B]


class Sampler:
    """``sampler(logits [B, V] float32, rows) -> SamplerOutput`` (see module docstring for the order)."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        params = [r.sampling_params for r in rows]
        wants_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = ops.compute_logprobs(logits) if any(wants_logprobs) else None  # [B, V]
        logits = self._apply_min_tokens(logits, rows)
        logits = self._apply_logit_bias(logits, rows)
        logits = self._apply_penalties(logits, rows)
        token_ids = self._choose(logits, rows)  # [B]
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            logprobs = _token_logprobs(raw_logprobs, token_ids, [p.logprobs for p in params])
        return SamplerOutput(token_ids.tolist(), logprobs)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows short of ``min_tokens`` may not draw EOS (unless ``ignore_eos``) or a stop token id."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(rows):
            p = r.sampling_params
            if len(r.output_token_ids) < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                if stop_ids:
                    groups.setdefault(tuple(sorted(stop_ids)), []).append(i)
        num_generated = _column([len(r.output_token_ids) for r in rows], torch.long)  # [B]
        for stop_ids, members in groups.items():
            min_tokens = torch.zeros(len(rows), dtype=torch.long)  # [B]; 0 leaves a row alone
            min_tokens[members] = _column([rows[i].sampling_params.min_tokens for i in members], torch.long)
            logits = ops.apply_min_tokens(logits, num_generated, min_tokens, stop_ids)
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Add each row's ``logit_bias`` (token id -> bias) to its logits [B, V]; ids >= V are ignored."""
        entries = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.sampling_params.logit_bias or {}).items()]
        entries = [e for e in entries if e[1] < logits.shape[1]]
        if not entries:
            return logits
        row_ids, token_ids, biases = zip(*entries)
        index = (torch.tensor(row_ids), torch.tensor(token_ids))  # [E], [E]
        values = torch.tensor(biases, dtype=logits.dtype)  # [E]
        return logits.index_put(index, values, accumulate=True)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [r.sampling_params for r in rows]
        repetition = [p.repetition_penalty for p in params]
        if any(x != 1.0 for x in repetition):
            history = _padded([r.prompt_token_ids + r.output_token_ids for r in rows])  # [B, T]
            logits = ops.apply_repetition_penalty(logits, history, _column(repetition))
        presence, frequency = [p.presence_penalty for p in params], [p.frequency_penalty for p in params]
        if any(x != 0.0 for x in presence + frequency):
            outputs = _padded([r.output_token_ids for r in rows])  # [B, T]
            logits = ops.apply_presence_frequency_penalty(logits, outputs, _column(presence), _column(frequency))
        return logits

    @staticmethod
    def _choose(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Argmax for greedy rows, a filtered multinomial draw for the others. Returns [B] long."""
        token_ids = ops.greedy(logits)  # [B]
        sampled = [i for i, r in enumerate(rows) if not r.sampling_params.is_greedy]
        if not sampled:
            return token_ids
        params = [rows[i].sampling_params for i in sampled]
        x = logits[sampled]  # [B', V]
        x = ops.apply_temperature(x, _column([p.temperature for p in params]))
        if any(p.min_p > 0 for p in params):
            x = ops.apply_min_p(x, _column([p.min_p for p in params]))
        if any(p.top_k > 0 for p in params):
            x = ops.apply_top_k(x, _column([p.top_k for p in params], torch.long))
        if any(p.top_p < 1 for p in params):
            x = ops.apply_top_p(x, _column([p.top_p for p in params]))
        token_ids[sampled] = ops.sample(x, [rows[i].generator for i in sampled])
        return token_ids


def _token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, nums: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row: the chosen id's logprob and the ``nums[i]`` largest alternatives (None where not asked).

    logprobs: [B, V] float32; token_ids: [B] long.
    """
    chosen = ops.gather_logprobs(logprobs, token_ids).tolist()  # [B]
    top_values, top_ids = ops.top_logprobs(logprobs, max(n or 0 for n in nums))  # [B, k_max]
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(nums):
        if n is None:
            out.append(None)
            continue
        top = dict(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist()))
        out.append(TokenLogprobs(chosen[i], top))
    return out
