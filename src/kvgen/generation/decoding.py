"""The token-by-token loop shared by greedy search and multinomial sampling.

Each step: logits [N, V] -> logits processors -> choose a token per row ->
finished rows emit the pad token -> stopping checks per row. The loop ends
when every row has finished (no batch-size-1 shortcuts).
Agrees with transformers 4.55 ``GenerationMixin._sample``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.generation.config import GenerationConfig
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner
from kvgen.models import CausalLM
from kvgen.sampling.stopping import PRIORITY, FinishReason, StopChecker


@dataclass
class LoopContext:
    """Everything a strategy needs besides the runner."""

    config: GenerationConfig
    processors: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    stopper: StopChecker
    generator: torch.Generator | None = None
    streamer: Any = None
    assistant: CausalLM | None = None  # assisted decoding's assistant model


def token_loop(
    runner: StepRunner, ctx: LoopContext, choose: Callable[[torch.Tensor], torch.Tensor],
    next_logits: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> GenerateOutput:
    """Decode until every row has finished; ``choose(scores [N, V]) -> [N]`` picks tokens. ``next_logits()``: the
    logits [N, V] the processors get and the model's own [N, V] (``output_logits``); default both the runner's."""
    cfg = ctx.config
    prompt_length = runner.sequences.shape[1]
    n = runner.sequences.shape[0]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    # rows still running, kept as a list: the per-row bookkeeping is Python, not a dozen small tensor ops a step
    unfinished = [True] * n
    reasons: list[str | None] = [None] * n
    num_new = [0] * n
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    for step in range(cfg.max_new_tokens):
        logits, raw = (runner.next_logits(),) * 2 if next_logits is None else next_logits()  # [N, V] each
        scores = ctx.processors(runner.sequences, logits)  # [N, V]
        if cfg.output_scores:
            all_scores.append(scores)
        if cfg.output_logits:
            all_logits.append(raw)
        next_tokens = choose(scores)  # [N]
        if not all(unfinished):  # finished rows emit the pad token, which the next forward reads
            if not 0 <= pad < scores.shape[-1]:  # (an id past a toy model's vocabulary is fine until a row finishes)
                raise ValueError(f"pad_token_id must be a token id in [0, {scores.shape[-1]}) to pad the rows that "
                                 f"finish first, got {pad}")
            next_tokens = torch.where(torch.tensor(unfinished), next_tokens, pad)
        runner.append(next_tokens)
        if ctx.streamer is not None:
            ctx.streamer.put(next_tokens)
        codes = ctx.stopper.check_rows(runner.sequences)
        for i in range(n):
            if unfinished[i]:
                num_new[i] = step + 1
                if codes[i]:
                    reasons[i], unfinished[i] = PRIORITY[codes[i] - 1].value, False
        if not any(unfinished):
            break
    if ctx.streamer is not None:
        ctx.streamer.end()
    timings = GenerateTimings(runner.prefill_s, runner.decode_s, max(runner.num_steps - 1, 0))
    return GenerateOutput(
        sequences=runner.sequences,
        prompt_length=prompt_length,
        finish_reasons=[r or FinishReason.LENGTH.value for r in reasons],
        num_new_tokens=num_new,
        scores=tuple(all_scores) if cfg.output_scores else None,
        logits=tuple(all_logits) if cfg.output_logits else None,
        timings=timings,
    )
