"""Beam search (and, with a sampling ``pick``, beam sample), vectorized over prompts.

Each prompt keeps ``nb`` live beams ([B*nb] runner rows, prompt-major) and an
n-best list of ``nb`` finished hypotheses. Each step scores every continuation
of every beam, keeps the top K = max(2, 1 + #EOS) * nb candidates, sends
candidates that hit a stop (EOS, stop string, time, length) among the first
``nb`` to the finished list (score = sum log-prob / generated_len**length_penalty)
and continues with the best ``nb`` that did not stop. The KV cache follows each
beam's parent (``runner.reorder``).
Must agree with transformers 4.55 ``GenerationMixin._beam_search`` (its
helpers ``_get_top_k_continuations``, ``_update_finished_beams``,
``_check_early_stop_heuristic``), token for token and score for score.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.generation.decoding import LoopContext
from kvgen.generation.output import GenerateOutput, GenerateTimings
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import choose_tokens
from kvgen.sampling.stopping import FinishReason, reason_of

NEG = -1.0e9  # HF's "impossible" score; kept finite so arithmetic matches HF bit for bit

# (accumulated log-probs [B, nb*V], K, generator) -> (scores [B, K], flat indices [B, K])
Pick = Callable[[torch.Tensor, int, torch.Generator | None], tuple[torch.Tensor, torch.Tensor]]


def pick_top_k(acc: torch.Tensor, k: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The K best continuations of ``acc [B, nb*V]``, best first."""
    idx = choose_tokens(acc, do_sample=False, num_tokens=k)  # [B, K]
    return acc.gather(1, idx), idx


def pick_sampled(acc: torch.Tensor, k: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K continuations drawn without replacement from softmax(``acc [B, nb*V]``) (HF beam sample)."""
    idx = choose_tokens(acc, do_sample=True, generator=generator, num_tokens=k)  # [B, K]
    return acc.gather(1, idx), idx


@dataclass(frozen=True)
class BeamSettings:
    """Per-call constants of the beam loop (lengths in tokens)."""

    num_beams: int
    num_keep: int  # K candidates kept per prompt and step
    prompt_length: int
    max_new_tokens: int
    pad_token_id: int
    length_penalty: float
    early_stopping: bool | str

    @classmethod
    def from_config(cls, ctx: LoopContext, prompt_length: int) -> BeamSettings:
        cfg = ctx.config
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        num_keep = max(2, 1 + len(cfg.eos_token_ids)) * cfg.num_beams
        return cls(
            cfg.num_beams, num_keep, prompt_length, cfg.max_new_tokens, pad, cfg.length_penalty, cfg.early_stopping
        )


@dataclass
class Candidates:
    """The K continuations kept this step, per prompt: everything [B, K] except ``seqs``."""

    scores: torch.Tensor  # float32 accumulated log-probs
    parents: torch.Tensor  # int64 beam index in 0..nb-1
    tokens: torch.Tensor  # int64 new token
    seqs: torch.Tensor  # [B, K, S+1] int64 parent's tokens + the new one
    codes: torch.Tensor  # int64 finish reason code (0 = still running)


@dataclass
class Finished:
    """Each prompt's n-best list of finished hypotheses, best first; all [B, nb] except ``seqs``."""

    seqs: torch.Tensor  # [B, nb, S_max] int64, padded
    scores: torch.Tensor  # float32 length-penalised score (NEG: empty slot)
    lengths: torch.Tensor  # int64 generated tokens
    codes: torch.Tensor  # int64 finish reason code
    is_done: torch.Tensor  # bool


def beam_search(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Deterministic beam search: ``runner`` holds B*num_beams rows (copies of each prompt)."""
    return run_beams(runner, ctx, pick_top_k)


def run_beams(runner: StepRunner, ctx: LoopContext, pick: Pick) -> GenerateOutput:
    """The beam loop shared by beam search and beam sample; returns B*num_return_sequences rows, best first."""
    cfg = ctx.config
    st = BeamSettings.from_config(ctx, runner.sequences.shape[1])
    nb = st.num_beams
    b = runner.sequences.shape[0] // nb
    running = torch.zeros((b, nb), dtype=torch.float32)
    running[:, 1:] = NEG  # only beam 0 may expand at first, so the copies do not pick the same tokens
    # an n-best slot no hypothesis reaches (every other candidate -inf) returns its prompt, as transformers' does
    empty = torch.full((b, nb, st.prompt_length + st.max_new_tokens), st.pad_token_id, dtype=torch.long)
    empty[:, :, : st.prompt_length] = runner.sequences.view(b, nb, -1)  # [B, nb, T]
    fin = Finished(
        empty,
        torch.full((b, nb), NEG, dtype=torch.float32),
        torch.zeros((b, nb), dtype=torch.long),
        torch.zeros((b, nb), dtype=torch.long),
        torch.zeros((b, nb), dtype=torch.bool),
    )
    improvable = torch.ones((b, 1), dtype=torch.bool)
    all_scores, all_logits = [], []
    for step in range(cfg.max_new_tokens):
        logits = runner.next_logits()  # [B*nb, V]
        log_probs = ctx.processors(runner.sequences, F.log_softmax(logits, dim=-1))  # [B*nb, V]
        if cfg.output_scores:
            all_scores.append(log_probs)
        if cfg.output_logits:
            all_logits.append(logits)
        acc = (log_probs.view(b, nb, -1) + running[:, :, None]).view(b, -1)  # [B, nb*V]
        cand = _candidates(runner, ctx, pick(acc, st.num_keep, ctx.generator), logits.shape[-1], step)
        running, rows, tokens = _next_running(cand, nb)
        fin = _update_finished(fin, cand, improvable, step, st)
        improvable = _improvable(improvable, running, fin, step + 1, st)
        if not _has_unfinished(improvable, fin.is_done, cand.codes > 0, st.early_stopping):
            break
        runner.reorder(rows)
        runner.append(tokens)
    timings = GenerateTimings(runner.prefill_s, runner.decode_s, max(runner.num_steps - 1, 0))
    out = _best_hypotheses(fin, cfg.num_return_sequences, st.prompt_length, timings)
    out.scores = tuple(all_scores) if cfg.output_scores else None
    out.logits = tuple(all_logits) if cfg.output_logits else None
    return out


def _candidates(
    runner: StepRunner, ctx: LoopContext, picked: tuple[torch.Tensor, torch.Tensor], vocab: int, step: int
) -> Candidates:
    """Split picked flat indices into (parent beam, token), build the candidate sequences and their stops."""
    scores, idx = picked  # [B, K]
    b, k = scores.shape
    parents, tokens = idx // vocab, idx % vocab  # [B, K]
    beams = runner.sequences.view(b, -1, runner.sequences.shape[1])  # [B, nb, S]
    seqs = torch.cat([beams.gather(1, parents[:, :, None].expand(-1, -1, beams.shape[2])), tokens[:, :, None]], 2)
    codes = ctx.stopper.check(seqs.view(b * k, -1))  # [B*K] finish codes (kvgen.sampling.stopping.PRIORITY)
    return Candidates(scores, parents, tokens, seqs, codes.view(b, k))


def _next_running(cand: Candidates, nb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best ``nb`` candidates that did not stop: (scores [B, nb], runner rows [B*nb], tokens [B*nb])."""
    masked = cand.scores + (cand.codes > 0).to(torch.float32) * NEG  # [B, K]
    best = torch.topk(masked, k=nb)[1]  # [B, nb]
    parents = cand.parents.gather(1, best)  # [B, nb]
    rows = (parents + torch.arange(parents.shape[0])[:, None] * nb).view(-1)  # [B*nb]
    return masked.gather(1, best), rows, cand.tokens.gather(1, best).view(-1)


def _update_finished(
    fin: Finished, cand: Candidates, improvable: torch.Tensor, step: int, st: BeamSettings
) -> Finished:
    """Merge the stopped candidates among the first ``nb`` into the n-best lists (HF ``_update_finished_beams``)."""
    nb = fin.scores.shape[1]
    just_done = cand.codes > 0  # [B, K]
    just_done[:, nb:] = False  # only the first nb candidates may finish (the rest are spares)
    scores = cand.scores / ((step + 1) ** st.length_penalty)  # [B, K]
    is_full = torch.all(fin.is_done, dim=-1, keepdim=True) & (st.early_stopping is True)  # [B, 1]
    scores += is_full.to(torch.float32) * NEG
    scores += (~improvable).to(torch.float32) * NEG
    scores += (~just_done) * NEG
    seqs = F.pad(cand.seqs, (0, fin.seqs.shape[2] - cand.seqs.shape[2]), value=st.pad_token_id)  # [B, K, S_max]
    merged = Finished(
        torch.cat([fin.seqs, seqs], dim=1),  # [B, nb+K, S_max]
        torch.cat([fin.scores, scores], dim=1),  # [B, nb+K]
        torch.cat([fin.lengths, torch.full_like(cand.tokens, step + 1)], dim=1),
        torch.cat([fin.codes, cand.codes], dim=1),
        torch.cat([fin.is_done, just_done], dim=1),
    )
    keep = torch.topk(merged.scores, k=nb)[1]  # [B, nb]
    return Finished(
        merged.seqs.gather(1, keep[:, :, None].expand(-1, -1, merged.seqs.shape[2])),
        merged.scores.gather(1, keep),
        merged.lengths.gather(1, keep),
        merged.codes.gather(1, keep),
        merged.is_done.gather(1, keep),
    )


def _improvable(
    improvable: torch.Tensor, running: torch.Tensor, fin: Finished, num_new: int, st: BeamSettings
) -> torch.Tensor:
    """[B, 1] bool: may a live beam still beat the worst finished one? (HF ``_check_early_stop_heuristic``)."""
    lp = st.length_penalty
    best_len = st.max_new_tokens if st.early_stopping == "never" and lp > 0.0 else num_new
    best_running = running[:, :1] / (best_len**lp)  # [B, 1]
    worst_done = torch.where(fin.is_done, torch.min(fin.scores, dim=1, keepdim=True)[0], NEG)  # [B, nb]
    return improvable & torch.any(best_running > worst_done, dim=-1, keepdim=True)


def _has_unfinished(
    improvable: torch.Tensor, is_done: torch.Tensor, stopped: torch.Tensor, early_stopping: bool | str
) -> bool:
    """Whether the loop goes on (HF ``_beam_search_has_unfinished_sequences``)."""
    all_full = bool(torch.all(is_done)) and early_stopping is True
    return bool(torch.any(improvable)) and not all_full and not bool(torch.all(stopped))


def _best_hypotheses(fin: Finished, n: int, prompt_len: int, timings: GenerateTimings) -> GenerateOutput:
    """The ``n`` best finished hypotheses of each prompt as rows [B*n, ...], cropped to the longest."""
    lengths = fin.lengths[:, :n].reshape(-1)  # [B*n]
    width = prompt_len + int(lengths.max())
    return GenerateOutput(
        sequences=fin.seqs[:, :n, :width].reshape(-1, width),  # [B*n, T + T_new]
        prompt_length=prompt_len,
        finish_reasons=[(reason_of(c) or FinishReason.LENGTH).value for c in fin.codes[:, :n].reshape(-1).tolist()],
        num_new_tokens=lengths.tolist(),
        sequences_scores=fin.scores[:, :n].reshape(-1),  # [B*n]
        timings=timings,
    )
