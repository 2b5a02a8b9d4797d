"""Greedy search: the argmax of the processed scores at every step."""

from __future__ import annotations

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import greedy


def greedy_search(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Pick ``argmax`` of scores ``[N, V]`` each step (ties: lowest id, as torch.argmax / HF; the model's C++ argmax
    where it has kernels)."""
    kernels = getattr(runner.model, "kernels", None)
    argmax = None if kernels is None else kernels.argmax
    return token_loop(runner, ctx, lambda scores: greedy(scores, argmax))
