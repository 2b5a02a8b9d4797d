"""Diverse (group) beam search (Vijayakumar et al. 2016, "Diverse Beam Search").

The ``nb`` beams of a prompt form ``G`` groups of ``nb / G``; within one step
the groups choose in order, and group g's log-probs are lowered by
``diversity_penalty`` times the number of times each token was just chosen by
groups 0..g-1 of the same prompt (Hamming diversity). Each group keeps its own
n-best list of finished hypotheses; the best ``num_return_sequences`` over all
groups are returned.
Must agree with transformers 4.55 ``GenerationMixin._group_beam_search`` with
its ``BeamSearchScorer`` / ``BeamHypotheses`` and ``HammingDiversityLogitsProcessor``
(placed right after classifier-free guidance and ``SequenceBiasLogitsProcessor``, as HF orders them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner
from kvgen.sampling.logits_process import (
    LogitsProcessorList,
    SequenceBiasLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from kvgen.sampling.ops import choose_tokens
from kvgen.sampling.stopping import FinishReason, reason_of


@dataclass
class Hypotheses:
    """The n-best finished hypotheses of one group of one prompt (HF ``BeamHypotheses``).

    ``beams`` holds (score, token ids incl. prompt, finish reason); score =
    sum log-prob / generated_len**length_penalty.
    """

    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    beams: list[tuple[float, list[int], str]] = field(default_factory=list)
    worst_score: float = 1e9

    def add(self, ids: list[int], sum_logprobs: float, generated_len: int, reason: str) -> None:
        score = sum_logprobs / (generated_len**self.length_penalty)
        if len(self.beams) < self.num_beams or score > self.worst_score:
            self.beams.append((score, ids, reason))
            if len(self.beams) > self.num_beams:
                ranked = sorted((s, i) for i, (s, _, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, num_new: int) -> bool:
        """No live beam can beat the worst kept hypothesis any more (the ``early_stopping`` rule)."""
        if len(self.beams) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0.0 else num_new
        return self.worst_score >= best_sum_logprobs / length**self.length_penalty


@dataclass
class GroupState:
    """Everything that changes during the loop; ``hyps[b][g]`` is prompt b's group g."""

    hyps: list[list[Hypotheses]]
    done: list[list[bool]]
    beam_scores: torch.Tensor  # [B*nb] float32 running sum of log-probs per beam row


def group_beam_search(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Diverse beam search over B*num_beams rows (copies of each prompt); returns B*num_return_sequences rows."""
    cfg = ctx.config
    nb, num_groups, prompt_len = cfg.num_beams, cfg.num_beam_groups, runner.sequences.shape[1]
    g_size, b = nb // num_groups, runner.sequences.shape[0] // nb
    hyps = [
        [Hypotheses(g_size, cfg.length_penalty, cfg.early_stopping, cfg.max_new_tokens) for _ in range(num_groups)]
        for _ in range(b)
    ]
    beam_scores = torch.full((b, nb), -1e9, dtype=torch.float32)
    beam_scores[:, ::g_size] = 0  # only the first beam of each group may expand at first
    state = GroupState(hyps, [[False] * num_groups for _ in range(b)], beam_scores.view(-1))
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    row_reasons: list[str | None] = [None] * (b * nb)
    for step in range(cfg.max_new_tokens):
        logits = runner.next_logits()  # [B*nb, V]
        tokens, parents, processed = _step_groups(runner, ctx, state, F.log_softmax(logits, dim=-1), step)
        if cfg.output_scores:
            all_scores.append(processed)
        if cfg.output_logits:
            all_logits.append(logits)
        runner.reorder(parents)
        runner.append(tokens)
        if all(all(d) for d in state.done):
            break
        row_reasons = _row_reasons(runner, ctx)
        if all(r is not None for r in row_reasons):
            break
    _add_open_beams(runner, state, prompt_len, row_reasons)
    timings = GenerateTimings(runner.prefill_s, runner.decode_s, max(runner.num_steps - 1, 0))
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    out = _best_hypotheses(state.hyps, cfg.num_return_sequences, prompt_len, pad, timings)
    out.scores = tuple(all_scores) if cfg.output_scores else None
    out.logits = tuple(all_logits) if cfg.output_logits else None
    return out


def _step_groups(
    runner: StepRunner, ctx: LoopContext, state: GroupState, log_probs: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Let each group choose in turn. Returns (tokens [B*nb], parent rows [B*nb], processed log-probs [B*nb, V])."""
    cfg = ctx.config
    nb, num_groups, vocab = cfg.num_beams, cfg.num_beam_groups, log_probs.shape[-1]
    g_size, b = nb // num_groups, log_probs.shape[0] // nb
    assert isinstance(ctx.processors, LogitsProcessorList), "group beam search splits the processor list"
    before, after = _split_processors(ctx.processors)
    tokens = torch.zeros(b * nb, dtype=torch.long)  # this step's choices, filled group by group
    parents = torch.zeros(b * nb, dtype=torch.long)
    processed = torch.zeros_like(log_probs)  # [B*nb, V]
    for g in range(num_groups):
        rows = (torch.arange(b)[:, None] * nb + g * g_size + torch.arange(g_size)).view(-1)  # [B*g_size]
        ids = runner.sequences[rows]  # [B*g_size, S]
        scores = before(ids, log_probs[rows])  # [B*g_size, V]
        scores = _diversity(scores, tokens.view(b, nb)[:, : g * g_size], cfg.diversity_penalty)
        processed[rows] = after(ids, scores)
        acc = (processed[rows] + state.beam_scores[rows, None]).view(b, -1)  # [B, g_size*V]
        top_idx = choose_tokens(acc, do_sample=False, num_tokens=max(2, 1 + len(cfg.eos_token_ids)) * g_size)  # [B, K]
        top_scores = acc.gather(1, top_idx)  # [B, K], best first
        top = (top_scores, top_idx // vocab, top_idx % vocab)  # scores, parent in group, token: [B, K] each
        for i in range(b):
            mine = slice(i * g_size, (i + 1) * g_size)  # prompt i's rows within the group
            tok, par, sc = _advance_group(state, ctx, (i, g), tuple(t[i] for t in top), ids[mine], step)
            tokens[rows[mine]], parents[rows[mine]], state.beam_scores[rows[mine]] = tok, rows[par], sc
    return tokens, parents, processed


def _advance_group(
    state: GroupState,
    ctx: LoopContext,
    where: tuple[int, int],
    top: tuple[torch.Tensor, ...],
    ids: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt i, group g (``where``): next (tokens, parents, scores) [g_size], parents indexing the group's rows of
    every prompt [B*g_size]; marks the group done."""
    (i, g), g_size = where, ids.shape[0]
    if state.done[i][g]:  # a finished group idles on padding from the group's first row (prompt 0's), as HF
        pad = ctx.config.pad_token_id or 0
        return torch.full((g_size,), pad), torch.zeros(g_size, dtype=torch.long), torch.zeros(g_size)
    tok, par, sc = _choose_beams(state.hyps[i][g], top, ids, ctx.config.eos_token_ids, step)
    state.done[i][g] = state.hyps[i][g].is_done(float(top[0].max()), step + 1)
    return tok, i * g_size + par, sc


def _split_processors(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, LogitsProcessorList]:
    """The processors HF runs before its Hamming diversity processor (classifier-free guidance, sequence bias), and
    the rest."""
    first = (UnbatchedClassifierFreeGuidanceLogitsProcessor, SequenceBiasLogitsProcessor)
    before = LogitsProcessorList(p for p in processors if isinstance(p, first))
    after = LogitsProcessorList(p for p in processors if not isinstance(p, first))
    return before, after


def _diversity(scores: torch.Tensor, earlier: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores [B*g_size, V] minus ``penalty`` x how often earlier groups [B, n_earlier] chose each token this step."""
    if penalty <= 0.0 or earlier.shape[1] == 0:
        return scores
    b, vocab = earlier.shape[0], scores.shape[-1]
    counts = torch.zeros((b, vocab), dtype=torch.long).scatter_add_(1, earlier, torch.ones_like(earlier))  # [B, V]
    return (scores.view(b, -1, vocab) - penalty * counts[:, None, :]).view(-1, vocab)  # [B*g_size, V]


def _choose_beams(
    hyps: Hypotheses, top: tuple[torch.Tensor, ...], ids: torch.Tensor, eos_ids: list[int], step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group of one prompt (HF ``BeamSearchScorer.process``): EOS candidates ranked within the first
    g_size become hypotheses, the best non-EOS ones the next beams.

    top: (scores, parent in group, token), each [K], best first; ids: [g_size, S] the group's beams.
    Returns (tokens, parents, scores), each [g_size].
    """
    g_size = ids.shape[0]
    chosen: list[tuple[int, int, float]] = []
    for rank, (score, parent, token) in enumerate(zip(*(t.tolist() for t in top))):
        if token in eos_ids:
            if rank < g_size:
                hyps.add(ids[parent].tolist() + [token], score, step + 1, "stop")
        else:
            chosen.append((token, parent, score))
        if len(chosen) == g_size:
            break
    assert len(chosen) == g_size, "fewer non-EOS candidates than beams"
    tok, par, sc = zip(*chosen)
    return torch.tensor(tok), torch.tensor(par), torch.tensor(sc, dtype=torch.float32)


def _row_reasons(runner: StepRunner, ctx: LoopContext) -> list[str | None]:
    """Per beam row, why it would stop now (HF stops group beam search only when every row would)."""
    codes = ctx.stopper.check_rows(runner.sequences)  # [B*nb] finish codes
    return [r.value if (r := reason_of(c)) is not None else None for c in codes]


def _add_open_beams(runner: StepRunner, state: GroupState, prompt_len: int, reasons: list[str | None]) -> None:
    """Offer every live beam of a group that is not done to its hypotheses (HF ``BeamSearchScorer.finalize``)."""
    g_size = state.hyps[0][0].num_beams
    num_new = runner.sequences.shape[1] - prompt_len
    for i, groups in enumerate(state.hyps):
        for g, hyps in enumerate(groups):
            if state.done[i][g]:
                continue
            for j in range(g_size):
                row = (i * len(groups) + g) * g_size + j
                reason = reasons[row]
                reason = reason if reason is not None and reason != "stop" else FinishReason.LENGTH.value
                hyps.add(runner.sequences[row].tolist(), float(state.beam_scores[row]), num_new, reason)


def _best_hypotheses(
    hyps: list[list[Hypotheses]], n: int, prompt_len: int, pad: int, timings: GenerateTimings
) -> GenerateOutput:
    """The ``n`` best hypotheses of each prompt over all its groups, as rows [B*n, T + T_new] padded with ``pad``."""
    best: list[tuple[float, list[int], str]] = []
    for groups in hyps:
        ranked = sorted((beam for h in groups for beam in h.beams), key=lambda beam: beam[0])
        best += [ranked.pop() for _ in range(n)]
    width = max(len(ids) for _, ids, _ in best)
    seqs = torch.full((len(best), width), pad, dtype=torch.long)  # [B*n, T + T_new]
    for row, (_, ids, _) in enumerate(best):
        seqs[row, : len(ids)] = torch.tensor(ids)
    return GenerateOutput(
        sequences=seqs,
        prompt_length=prompt_len,
        finish_reasons=[reason for _, _, reason in best],
        num_new_tokens=[len(ids) - prompt_len for _, ids, _ in best],
        sequences_scores=torch.tensor([score for score, _, _ in best], dtype=torch.float32),  # [B*n]
        timings=timings,
    )
