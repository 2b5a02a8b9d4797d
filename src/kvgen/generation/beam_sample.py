"""Beam sample: beam search whose K candidates per prompt are drawn, not ranked.

Each step the processed log-probs (processors *and* warpers, applied after
``log_softmax`` with ``min_tokens_to_keep = #EOS + 1``, as HF) are added to the
beam scores, and K continuations are drawn without replacement from the
softmax over all ``nb * V`` of them with ``ctx.generator``; the rest is beam
search (finished hypotheses, length penalty, early stopping).
Must agree with transformers 4.55 ``GenerationMixin._beam_search`` with
``do_sample=True`` (same draws for the same seed and probabilities).
"""

from __future__ import annotations

from kvgen.generation.beam_search import pick_sampled, run_beams
from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner


def beam_sample(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Stochastic beam search over B*num_beams rows; reproducible for a seeded ``ctx.generator``."""
    return run_beams(runner, ctx, pick_sampled)
