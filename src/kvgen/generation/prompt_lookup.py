"""Prompt lookup decoding: greedy search (or sampling) that drafts tokens by copying what followed the
sequence's last n-gram earlier in the sequence, verified by :func:`speculative_loop`.

One forward over k + 1 columns reads the weights once, but here the quantized matmul is compute-bound past
~4 rows, so k + 1 columns cost ~1.1x one column at k = 1 and ~3x at k = 10. Greedy tokens are those of
greedy search whatever the drafts, so greedy search adapts k (transformers' heuristic schedule for draft
models: +2 after a fully accepted draft, -1 otherwise, within [1, ``prompt_lookup_num_tokens``]); sampling
keeps transformers' fixed k, which its draws depend on.
Source: Saxena 2023, "Prompt Lookup Decoding"; transformers 4.55 ``PromptLookupCandidateGenerator`` and
``GenerationMixin._assisted_decoding`` (draft choice, acceptance rule and draws, token for token).
"""

from __future__ import annotations

import torch

from kvgen.generation.config import GenerationConfig
from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.generation.speculative import speculative_loop
from kvgen.sampling.ngram import find_draft


class NgramDrafter:
    """Drafts by n-gram lookup in the sequence (``max_matching_ngram_size``, default 2); no draft probabilities."""

    def __init__(self, cfg: GenerationConfig) -> None:
        assert cfg.prompt_lookup_num_tokens is not None  # this strategy is chosen by it
        self.max_ngram, self.limit = cfg.max_matching_ngram_size or 2, cfg.prompt_lookup_num_tokens
        self.num_draft, self.is_adaptive, self.eos = self.limit, not cfg.do_sample, cfg.eos_token_ids

    def draft(self, sequences: torch.Tensor, max_tokens: int) -> tuple[list[int], None]:
        # Sampling drafts its k tokens even past the room left, as transformers (whose one draw over the k + 1 rows
        # decides how many random numbers later steps see); the loop stops at the limit all the same.
        num_draft = min(self.num_draft, max_tokens) if self.is_adaptive or max_tokens <= 0 else self.num_draft
        return find_draft(sequences[0].tolist(), self.max_ngram, num_draft, self.eos), None

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if self.is_adaptive:  # HF's "heuristic" schedule (sampling keeps HF's fixed length)
            full = num_accepted == num_drafted
            self.num_draft = min(self.num_draft + 2, self.limit) if full else max(1, self.num_draft - 1)


def prompt_lookup_decoding(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Decode one row ([1, T] prompt) with n-gram drafts; ``ctx.config.do_sample`` draws from ``ctx.generator``."""
    return speculative_loop(runner, ctx, NgramDrafter(ctx.config))
