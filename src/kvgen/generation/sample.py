"""Multinomial sampling from the processed (warped) distribution."""

from __future__ import annotations

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import choose_tokens


def multinomial_sample(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Draw each row's token from softmax(scores) with ``ctx.generator`` (reproducible per seed)."""
    return token_loop(runner, ctx, lambda scores: choose_tokens(scores, True, ctx.generator).squeeze(1))
