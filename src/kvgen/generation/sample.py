"""Multinomial sampling from the processed (warped) distribution."""

from __future__ import annotations

import torch

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner


def multinomial_sample(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Draw each row's token from softmax(scores) with ``ctx.generator`` (reproducible per seed)."""

    def choose(scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)  # [N, V]
        return torch.multinomial(probs, 1, generator=ctx.generator).squeeze(1)  # [N]

    return token_loop(runner, ctx, choose)
