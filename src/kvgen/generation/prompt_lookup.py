"""Prompt lookup decoding: greedy search (or sampling) that drafts tokens by copying what followed the
sequence's last n-gram earlier in the sequence, and verifies all drafts in one forward.

Each step: draft up to k ids (``find_draft``), feed the last token plus the drafts (one forward over
k + 1 columns: the weights are read once, but here the quantized matmul is compute-bound past ~4 rows, so
k + 1 columns cost ~1.1x one column at k = 1 and ~3x at k = 10), process the k + 1 logit rows with the
prefix each would have had, choose a token per row (argmax, or one multinomial draw over the k + 1 rows),
keep the drafts up to the first one that differs from the choice, then the choice after them. Greedy
tokens are those of greedy search whatever the drafts, so greedy search adapts k (transformers' heuristic
schedule for draft models: +2 after a fully accepted draft, -1 otherwise, within [1,
``prompt_lookup_num_tokens``]); sampling keeps transformers' fixed k, which its draws depend on.
Source: Saxena 2023, "Prompt Lookup Decoding"; transformers 4.55 ``PromptLookupCandidateGenerator`` and
``GenerationMixin._assisted_decoding`` (draft choice, acceptance rule and draws, token for token).
"""

from __future__ import annotations

import torch

from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ngram import find_draft
from kvgen.sampling.ops import choose_tokens
from kvgen.sampling.stopping import PRIORITY, FinishReason


def prompt_lookup_decoding(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Decode one row ([1, T] prompt) with drafted tokens; ``ctx.config.do_sample`` draws from ``ctx.generator``."""
    cfg = ctx.config
    assert runner.sequences.shape[0] == 1, "generate() checks batch size 1"
    prompt_length = runner.sequences.shape[1]
    max_ngram = cfg.max_matching_ngram_size or 2
    assert cfg.prompt_lookup_num_tokens is not None  # this strategy is chosen by it
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    num_new, code, num_draft = 0, 0, cfg.prompt_lookup_num_tokens
    while code == 0:
        length = runner.sequences.shape[1]
        room = cfg.max_new_tokens - num_new - 1  # drafts beyond it could never be kept
        draft = find_draft(runner.sequences[0].tolist(), max_ngram, min(num_draft, room), cfg.eos_token_ids)
        if draft:
            runner.append_columns(torch.tensor([draft]))  # [1, k]
        logits = runner.next_logits(len(draft) + 1).view(len(draft) + 1, -1)  # [k + 1, V]
        scores = torch.stack([ctx.processors(runner.sequences[:, : length + i], logits[i : i + 1])[0]
                              for i in range(len(draft) + 1)])  # [k + 1, V]
        chosen = choose_tokens(scores, cfg.do_sample, ctx.generator).flatten().tolist()  # [k + 1]
        num_accepted = next((i for i, (d, c) in enumerate(zip(draft, chosen)) if d != c), len(draft))
        if draft and not cfg.do_sample:  # draft length: HF's "heuristic" schedule (sampling keeps HF's fixed one)
            full = num_accepted == len(draft)
            num_draft = min(num_draft + 2, cfg.prompt_lookup_num_tokens) if full else max(1, num_draft - 1)
        kept: list[int] = []  # the accepted drafts and the choice after them, up to the first stop
        for token in chosen[: num_accepted + 1]:
            kept.append(token)
            code = int(ctx.stopper.check(torch.cat([runner.sequences[:, :length], torch.tensor([kept])], 1))[0])
            if code:
                break
        runner.keep_columns(length + min(len(kept), num_accepted))  # kept drafts stay in the cache
        if len(kept) > num_accepted:
            runner.append(torch.tensor(kept[-1:]))
        num_new += len(kept)
        scores_out.extend(scores[: len(kept)].split(1))  # [1, V] each
        logits_out.extend(logits[: len(kept)].split(1))
        if ctx.streamer is not None:
            for token in kept:
                ctx.streamer.put(torch.tensor([token]))
    if ctx.streamer is not None:
        ctx.streamer.end()
    return GenerateOutput(
        sequences=runner.sequences,
        prompt_length=prompt_length,
        finish_reasons=[PRIORITY[code - 1].value if code else FinishReason.LENGTH.value],
        num_new_tokens=[num_new],
        scores=tuple(scores_out) if cfg.output_scores else None,
        logits=tuple(logits_out) if cfg.output_logits else None,
        timings=GenerateTimings(runner.prefill_s, runner.decode_s, max(runner.num_steps - 1, 0)),
    )
