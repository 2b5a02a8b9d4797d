"""The draft-and-verify loop shared by prompt lookup and assisted decoding (batch size 1).

Each step: a drafter proposes up to k ids; one forward over the last token plus the drafts gives k + 1 logit
rows, processed with the prefix each would have had; the drafts are kept up to the first one the model would
not have chosen, then one more token. Choosing: greedy takes the argmax of each row, so its tokens are
greedy search's whatever the drafts; sampling without draft probabilities (n-gram drafts) draws each row and
compares (exact for point-mass drafts); sampling with an assistant's probabilities q uses speculative sampling
(keep draft x with probability min(1, p(x) / q(x)), else draw from max(p - q, 0) normalized), which leaves
the target distribution unchanged.
Source: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
transformers 4.55 ``GenerationMixin._assisted_decoding`` and ``_speculative_sampling``.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import choose_tokens
from kvgen.sampling.stopping import PRIORITY, FinishReason


class Drafter(Protocol):
    """Proposes draft tokens for the one row of ``sequences`` [1, S] and learns from how many were accepted."""

    def draft(self, sequences: torch.Tensor, max_tokens: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``max_tokens`` draft ids, and their processed scores [k, V] when the drafter has a distribution."""
        ...

    def update(self, num_drafted: int, num_accepted: int) -> None: ...


def speculative_sample(draft: list[int], draft_scores: torch.Tensor, scores: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[list[int], int]:
    """(the accepted drafts and one new token, the number accepted) by speculative sampling.

    draft_scores: [k, V] the drafter's processed scores of the k drafts; scores: [k + 1, V] the model's for
    the same positions and the one after. Draws k uniforms, then one token, from ``generator``.
    """
    k = len(draft)
    q, p = draft_scores.float().softmax(-1), scores.float().softmax(-1)  # [k, V], [k + 1, V]
    ids = torch.tensor(draft)  # [k]
    ratio = p[torch.arange(k), ids] / q[torch.arange(k), ids]  # [k]
    rejected = (torch.rand(k, generator=generator) > ratio).tolist()
    n = rejected.index(True) if True in rejected else k
    if n < k:
        residual = (p[n] - q[n]).clamp(min=0)  # [V]
        residual = residual / residual.sum() if float(residual.sum()) > 0 else p[n]
    else:
        residual = p[k]
    token = int(torch.multinomial(residual[None], 1, generator=generator)[0, 0])
    return [*draft[:n], token], n


def speculative_loop(runner: StepRunner, ctx: LoopContext, drafter: Drafter) -> GenerateOutput:
    """Decode one row ([1, T] prompt) with ``drafter``'s drafts; ``ctx.config.do_sample`` draws from ``ctx.generator``."""
    cfg = ctx.config
    assert runner.sequences.shape[0] == 1, "generate() checks batch size 1"
    prompt_length = runner.sequences.shape[1]
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    num_new, code, draft_s = 0, 0, 0.0
    while code == 0:
        length = runner.sequences.shape[1]
        start = time.perf_counter()
        draft, draft_scores = drafter.draft(runner.sequences, cfg.max_new_tokens - num_new - 1)  # room for one more
        draft_s += time.perf_counter() - start
        if draft:
            runner.append_columns(torch.tensor([draft]))  # [1, k]
        logits = runner.next_logits(len(draft) + 1).view(len(draft) + 1, -1)  # [k + 1, V]
        scores = torch.stack([ctx.processors(runner.sequences[:, : length + i], logits[i : i + 1])[0]
                              for i in range(len(draft) + 1)])  # [k + 1, V]
        if cfg.do_sample and draft and draft_scores is not None:
            chosen, num_accepted = speculative_sample(draft, draft_scores, scores, ctx.generator)
        else:
            chosen = choose_tokens(scores, cfg.do_sample, ctx.generator).flatten().tolist()  # [k + 1]
            num_accepted = next((i for i, (d, c) in enumerate(zip(draft, chosen)) if d != c), len(draft))
        if draft:
            drafter.update(len(draft), num_accepted)
        kept: list[int] = []  # the accepted drafts and the choice after them, up to the first stop
        for token in chosen[: num_accepted + 1]:
            kept.append(token)
            code = ctx.stopper.check_rows(torch.cat([runner.sequences[:, :length], torch.tensor([kept])], 1))[0]
            if code:
                break
        runner.keep_columns(length + min(len(kept), num_accepted))  # kept drafts stay in the cache
        if len(kept) > num_accepted:
            runner.append(torch.tensor(kept[-1:]))
        num_new += len(kept)
        scores_out.extend(scores[: len(kept)].split(1))  # [1, V] each
        logits_out.extend(logits[: len(kept)].split(1))
        if ctx.streamer is not None:  # one put of the step's tokens, as transformers' ``streamer.put(valid_tokens)``
            ctx.streamer.put(torch.tensor([kept]))  # [1, k]
    if ctx.streamer is not None:
        ctx.streamer.end()
    return GenerateOutput(
        sequences=runner.sequences,
        prompt_length=prompt_length,
        finish_reasons=[PRIORITY[code - 1].value if code else FinishReason.LENGTH.value],
        num_new_tokens=[num_new],
        scores=tuple(scores_out) if cfg.output_scores else None,
        logits=tuple(logits_out) if cfg.output_logits else None,
        timings=GenerateTimings(runner.prefill_s, runner.decode_s + draft_s, max(runner.num_steps - 1, 0)),
    )
