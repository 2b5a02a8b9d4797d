"""Constrained beam search: beam search whose output must contain given token sequences (``force_words_ids``,
``constraints``: :mod:`kvgen.generation.constraints`).

Each step takes beam search's K = max(2, 1 + #EOS) * nb best continuations per prompt. An EOS among the first
nb finishes a hypothesis only if it fulfils every constraint; the nb best non-EOS continuations are pooled with
*advance* continuations (each beam extended by every token that makes progress on its constraints). The pool is
ranked by bank (constraint tokens fulfilled, see ``ConstraintListState.get_bank``), then score, and the next
beams are taken round-robin over banks, the best of each bank first, so hypotheses at every stage of progress
survive. At the end the open beams that fulfil the constraints join the finished ones (every open beam does
when fewer than ``num_return_sequences`` fulfil them).
Source: Hokamp & Liu 2017 (grid beam search); Post & Vilar 2018 (dynamic beam allocation). Must agree with
transformers 4.55 ``GenerationMixin._constrained_beam_search`` and ``ConstrainedBeamSearchScorer``, token for
token and score for score. As there, ``output_scores`` holds each step's processed log-probs plus the beam
scores, finished hypotheses are stored without their EOS, and the output appends the first EOS id to every
hypothesis shorter than the longest one plus one (up to the maximum length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvgen.generation.beam_search import NEG
from kvgen.generation.config import GenerationConfig
from kvgen.generation.constraints import (
    ConstraintListState,
    build_constraints,
    fulfils_all,
)
from kvgen.generation.decoding import LoopContext
from kvgen.generation.group_beam_search import Hypotheses
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner
from kvgen.sampling.stopping import FinishReason, reason_of


@dataclass
class Search:
    """Per-call constants and the per-prompt state: ``hyps[b]`` / ``done[b]`` of prompt b."""

    constraints: list[Any]
    num_beams: int
    eos_token_ids: list[int]
    pad_token_id: int
    hyps: list[Hypotheses]
    done: list[bool]


def constrained_beam_search(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Constrained beam search over B*num_beams rows (copies of each prompt); returns B*num_return_sequences rows.
    Raises ``ValueError`` for malformed constraints or constraint ids outside the vocabulary."""
    cfg = ctx.config
    nb, prompt_len = cfg.num_beams, runner.sequences.shape[1]
    b, vocab = runner.sequences.shape[0] // nb, runner.model.config.vocab_size
    constraints = build_constraints(cfg.force_words_ids, cfg.constraints)
    if not constraints:
        raise ValueError("constrained beam search needs at least one constraint")
    _check_vocab(constraints, vocab)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    search = Search(constraints, nb, cfg.eos_token_ids, pad,
                    [Hypotheses(nb, cfg.length_penalty, cfg.early_stopping, cfg.max_new_tokens) for _ in range(b)],
                    [False] * b)
    beam_scores = torch.zeros((b, nb), dtype=torch.float32)
    beam_scores[:, 1:] = NEG  # only beam 0 may expand at first
    beam_scores = beam_scores.view(-1)  # [B*nb]
    num_keep = max(2, 1 + len(cfg.eos_token_ids)) * nb
    all_scores, all_logits = [], []
    for step in range(cfg.max_new_tokens):
        logits = runner.next_logits()  # [B*nb, V]
        acc = ctx.processors(runner.sequences, F.log_softmax(logits, dim=-1)) + beam_scores[:, None]  # [B*nb, V]
        if cfg.output_scores:
            all_scores.append(acc)
        if cfg.output_logits:
            all_logits.append(logits)
        top_scores, top_idx = torch.topk(acc.view(b, -1), num_keep, dim=1, largest=True, sorted=True)  # [B, K]
        top = (top_scores.tolist(), (top_idx // vocab).tolist(), (top_idx % vocab).tolist())
        seqs = runner.sequences.tolist()
        picked = [_step_prompt(search, i, tuple(t[i] for t in top), seqs, acc, step + 1) for i in range(b)]
        beam_scores = torch.cat([p[0] for p in picked])  # [B*nb]
        rows = torch.cat([p[2] for p in picked])  # [B*nb]
        runner.reorder(rows)
        runner.append(torch.cat([p[1] for p in picked]))
        if all(search.done) or bool((ctx.stopper.check(runner.sequences) > 0).all()):
            break
    _add_open_beams(search, runner, beam_scores, ctx, prompt_len)
    timings = GenerateTimings(runner.prefill_s, runner.decode_s, max(runner.num_steps - 1, 0))
    out = _best_hypotheses(search, cfg, prompt_len, timings)
    out.scores = tuple(all_scores) if cfg.output_scores else None
    out.logits = tuple(all_logits) if cfg.output_logits else None
    return out


def _check_vocab(constraints: list[Any], vocab: int) -> None:
    """``ValueError`` for a constraint id outside the vocabulary (constraints without ``token_ids`` unchecked)."""
    for c in constraints:
        ids = getattr(c, "token_ids", None) or []
        if any(t >= vocab for word in ids for t in (word if isinstance(word, list) else [word])):
            raise ValueError(f"constraint token ids must be < vocab_size {vocab}, got {c.token_ids}")


def _step_prompt(
    search: Search, i: int, top: tuple[list, ...], seqs: list[list[int]], acc: torch.Tensor, num_new: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt i's next beams: (scores float32, tokens int64, global parent rows int64), each [nb].

    top: (accumulated scores, parent beam, token), each [K] best first; seqs: every row's tokens;
    acc: [B*nb, V] accumulated scores. A finished prompt idles on padding from row 0, as transformers."""
    nb = search.num_beams
    if search.done[i]:
        return torch.zeros(nb), torch.full((nb,), search.pad_token_id), torch.zeros(nb, dtype=torch.long)
    scores, tokens, rows = [], [], []
    for rank, (score, parent, token) in enumerate(zip(*top)):
        row = i * nb + parent
        if token in search.eos_token_ids:
            if rank < nb and fulfils_all(search.constraints, seqs[row]):
                search.hyps[i].add(seqs[row], score, num_new, FinishReason.STOP.value)
        else:
            scores.append(score)
            tokens.append(token)
            rows.append(row)
        if len(rows) == nb:
            break
    assert len(rows) == nb, "fewer non-EOS candidates than beams"
    picked = _with_advances(search, i, (scores, tokens, rows), seqs, acc)
    search.done[i] = search.hyps[i].is_done(max(top[0]), num_new)
    return picked


def _with_advances(
    search: Search, i: int, chosen: tuple[list, list, list], seqs: list[list[int]], acc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool the chosen beams with the advance continuations of prompt i's beams; keep nb round-robin over banks
    (transformers' ``step_sentence_constraint``). Returns (scores, tokens, rows), each [nb]."""
    nb, (scores, tokens, rows) = search.num_beams, (list(c) for c in chosen)
    pool = [seqs[r] + [t] for r, t in zip(rows, tokens)]  # the chosen hypotheses, then advances not among them
    states = [ConstraintListState.after(search.constraints, seq) for seq in pool]
    new_scores: list[torch.Tensor] = []
    for row in range(i * nb, (i + 1) * nb):
        before = ConstraintListState.after(search.constraints, seqs[row])
        if before.completed:
            continue
        for token in before.advance() or []:
            state = before.copy(stateful=True)
            state.add(token)
            if seqs[row] + [token] not in pool:
                pool.append(seqs[row] + [token])
                states.append(state)
                tokens.append(token)
                rows.append(row)
                new_scores.append(acc[row, token])
    all_scores = torch.tensor(scores, dtype=torch.float32)
    if not new_scores:
        return all_scores, torch.tensor(tokens), torch.tensor(rows)
    all_scores = torch.cat([all_scores, torch.stack(new_scores)])  # [nb + n_new]
    banks = torch.tensor([s.get_bank() for s in states])  # [nb + n_new] int64, read after every advance
    order = (banks * 100 + all_scores).sort(descending=True).indices  # bank first, then score
    sorted_banks = banks[order].tolist()
    rank_in_bank = [0] * len(order)
    for j in range(1, len(order)):
        rank_in_bank[j] = rank_in_bank[j - 1] + 1 if sorted_banks[j] == sorted_banks[j - 1] else 0
    keep = order[sorted(range(len(order)), key=rank_in_bank.__getitem__)[:nb]]  # round-robin over banks
    return all_scores[keep], torch.tensor(tokens)[keep], torch.tensor(rows)[keep]


def _add_open_beams(search: Search, runner: StepRunner, beam_scores: torch.Tensor, ctx: LoopContext,
                    prompt_len: int) -> None:
    """Offer the open beams of every prompt not done to its hypotheses (transformers' ``finalize``)."""
    nb, n_return = search.num_beams, ctx.config.num_return_sequences
    seqs = runner.sequences.tolist()
    codes = ctx.stopper.check_rows(runner.sequences)  # [B*nb] finish codes
    for i, hyps in enumerate(search.hyps):
        if search.done[i]:
            continue
        beams = range(i * nb, (i + 1) * nb)
        fulfilled = [r for r in beams if fulfils_all(search.constraints, seqs[r])]
        offered = fulfilled + ([r for r in beams if r not in fulfilled] if len(fulfilled) < n_return else [])
        for r in offered:
            reason = reason_of(codes[r])
            reason = reason if reason not in (None, FinishReason.STOP) else FinishReason.LENGTH
            hyps.add(seqs[r], float(beam_scores[r]), len(seqs[r]) - prompt_len, reason.value)


def _best_hypotheses(search: Search, cfg: GenerationConfig, prompt_len: int, timings: GenerateTimings
                     ) -> GenerateOutput:
    """The ``num_return_sequences`` best hypotheses of each prompt as rows [B*n, W]: each followed by the first EOS
    id where it is shorter than W = min(longest + 1, prompt + max_new_tokens), then padding (transformers)."""
    best: list[tuple[float, list[int], str]] = []
    for hyps in search.hyps:
        ranked = sorted(hyps.beams, key=lambda beam: beam[0])
        best += [ranked.pop() for _ in range(cfg.num_return_sequences)]
    width = min(max(len(ids) for _, ids, _ in best) + 1, prompt_len + cfg.max_new_tokens)
    seqs = torch.full((len(best), width), search.pad_token_id, dtype=torch.long)  # [B*n, W]
    num_new = []
    for row, (_, ids, _) in enumerate(best):
        seqs[row, : len(ids)] = torch.tensor(ids)
        with_eos = len(ids) < width and bool(search.eos_token_ids)
        if with_eos:
            seqs[row, len(ids)] = search.eos_token_ids[0]
        num_new.append(len(ids) + with_eos - prompt_len)
    return GenerateOutput(
        sequences=seqs,
        prompt_length=prompt_len,
        finish_reasons=[reason for _, _, reason in best],
        num_new_tokens=num_new,
        sequences_scores=torch.tensor([score for score, _, _ in best], dtype=torch.float32),  # [B*n]
        timings=timings,
    )
