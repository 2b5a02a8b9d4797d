"""Greedy search: the argmax of the processed scores at every step."""

from __future__ import annotations

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import choose_tokens


def greedy_search(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Pick ``argmax`` of scores ``[N, V]`` each step (ties: lowest id, as torch.argmax / HF)."""
    return token_loop(runner, ctx, lambda scores: choose_tokens(scores, do_sample=False).squeeze(1))
