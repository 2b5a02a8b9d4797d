"""Assisted decoding: a smaller assistant model (same vocabulary) drafts tokens that the model verifies in one
forward (:func:`speculative_loop`): greedy tokens are greedy search's; sampling keeps the model's distribution
(speculative sampling over the assistant's probabilities).

The assistant decodes greedily (or samples, with ``do_sample``) from its own KV cache with the same logits
processors, up to ``num_assistant_tokens`` ids, stopping early after an EOS or a token it gives less than
``assistant_confidence_threshold`` probability; its cache keeps the accepted tokens between steps. The draft
length follows ``num_assistant_tokens_schedule`` ("heuristic": +2 after a fully accepted draft, else -1).
transformers also tunes the threshold from an ROC curve when scikit-learn is installed; kvgen keeps it fixed
(greedy tokens do not depend on it; sampled draws are the model's distribution, not transformers' draws).
Source: Leviathan et al. 2023; transformers 4.55 ``AssistedCandidateGenerator`` and ``ConfidenceCriteria``.
"""

from __future__ import annotations

import torch

from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.generation.speculative import speculative_loop
from kvgen.models import CausalLM
from kvgen.sampling.ops import choose_tokens


class AssistantDrafter:
    """Drafts with ``assistant`` from the model's sequence; returns the drafts' processed scores [k, V]."""

    def __init__(self, assistant: CausalLM, ctx: LoopContext, input_ids: torch.Tensor) -> None:
        cfg = ctx.config
        cache = cfg.cache_implementation if cfg.use_cache else None
        self.runner = StepRunner(assistant, input_ids, torch.ones_like(input_ids), cache, cfg.max_new_tokens)
        self.ctx, self.num_tokens = ctx, float(cfg.num_assistant_tokens)

    def draft(self, sequences: torch.Tensor, max_tokens: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``max_tokens`` ids continuing ``sequences`` [1, S] and their processed scores [k, V]; the assistant's
        cache first drops what the model did not keep."""
        cfg, runner = self.ctx.config, self.runner
        num = min(int(self.num_tokens), max_tokens)
        if num <= 0:
            return [], None
        ours, theirs = runner.sequences[0], sequences[0]
        size = min(len(ours), len(theirs))
        differs = (ours[:size] != theirs[:size]).nonzero()
        common = int(differs[0, 0]) if len(differs) else size  # the assistant's tokens the model kept
        runner.keep_columns(common)
        runner.append_columns(sequences[:, common:])  # [1, S - common]: at least the model's last choice
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(num):
            scores = self.ctx.processors(runner.sequences, runner.next_logits())  # [1, V]
            token = int(choose_tokens(scores, cfg.do_sample, self.ctx.generator)[0, 0])
            runner.append(torch.tensor([token]))
            tokens.append(token)
            rows.append(scores[0])
            if token in cfg.eos_token_ids:
                break
            threshold = cfg.assistant_confidence_threshold
            if threshold and float(scores[0].float().softmax(-1)[token]) < threshold:
                break
        return tokens, torch.stack(rows)  # [k, V]

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if self.ctx.config.num_assistant_tokens_schedule != "constant":
            self.num_tokens = self.num_tokens + 2.0 if num_accepted == num_drafted else max(1.0, self.num_tokens - 1.0)


def assisted_decoding(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Decode one row ([1, T] prompt) with ``ctx.assistant``'s drafts."""
    assert ctx.assistant is not None, "generate() passes the assistant model"
    return speculative_loop(runner, ctx, AssistantDrafter(ctx.assistant, ctx, runner.sequences))
