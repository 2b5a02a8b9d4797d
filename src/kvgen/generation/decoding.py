"""The token-by-token loop shared by greedy search and multinomial sampling.

Each step: logits [N, V] -> logits processors -> choose a token per row ->
finished rows emit the pad token -> stopping checks per row. The loop ends
when every row has finished (no batch-size-1 shortcuts).
Agrees with transformers 4.55 ``GenerationMixin._sample``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgen.generation.config import GenerationConfig
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner

# (sequences [N, S], scores [N, V]) -> (done [N] bool, reason)
RowStop = tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]


@dataclass
class LoopContext:
    """Everything a strategy needs besides the runner."""

    config: GenerationConfig
    processors: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    row_stops: list[RowStop] = field(default_factory=list)
    generator: torch.Generator | None = None
    streamer: Any = None


def token_loop(
    runner: StepRunner, ctx: LoopContext, choose: Callable[[torch.Tensor], torch.Tensor]
) -> GenerateOutput:
    """Decode until every row has finished; ``choose(scores [N, V]) -> [N]`` picks tokens."""
    cfg = ctx.config
    prompt_length = runner.sequences.shape[1]
    n = runner.sequences.shape[0]
    eos = torch.tensor(cfg.eos_token_ids, dtype=torch.long)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    unfinished = torch.ones(n, dtype=torch.bool)
    reasons: list[str | None] = [None] * n
    num_new = [0] * n
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    for step in range(cfg.max_new_tokens):
        logits = runner.next_logits()  # [N, V]
        scores = ctx.processors(runner.sequences, logits)  # [N, V]
        if cfg.output_scores:
            all_scores.append(scores)
        if cfg.output_logits:
            all_logits.append(logits)
        next_tokens = torch.where(unfinished, choose(scores), pad)  # [N]
        runner.append(next_tokens)
        if ctx.streamer is not None:
            ctx.streamer.put(next_tokens)
        for i in unfinished.nonzero().flatten().tolist():
            num_new[i] = step + 1
        done = torch.zeros(n, dtype=torch.bool)
        if eos.numel():
            hit = torch.isin(next_tokens, eos) & unfinished
            _mark(reasons, hit, "stop")
            done |= hit
        for stop_fn, reason in ctx.row_stops:
            hit = stop_fn(runner.sequences, scores) & unfinished & ~done
            _mark(reasons, hit, reason)
            done |= hit
        unfinished &= ~done
        if not bool(unfinished.any()):
            break
    _mark(reasons, unfinished, "length")
    if ctx.streamer is not None:
        ctx.streamer.end()
    timings = GenerateTimings(runner.prefill_s, runner.decode_s, max(runner.num_steps - 1, 0))
    return GenerateOutput(
        sequences=runner.sequences,
        prompt_length=prompt_length,
        finish_reasons=[r or "length" for r in reasons],
        num_new_tokens=num_new,
        scores=tuple(all_scores) if cfg.output_scores else None,
        logits=tuple(all_logits) if cfg.output_logits else None,
        timings=timings,
    )


def _mark(reasons: list[str | None], rows: torch.Tensor, reason: str) -> None:
    for i in rows.nonzero().flatten().tolist():
        if reasons[i] is None:
            reasons[i] = reason
