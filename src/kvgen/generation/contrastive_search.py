"""Contrastive search (Su et al. 2022, "A Contrastive Framework for Neural Text Generation", eq. 5).

Each step takes the ``top_k`` most likely next tokens, runs all of them through
the model at once (the KV cache is copied ``top_k`` times per row), and keeps
the candidate v maximising
``(1 - penalty_alpha) * p(v) - penalty_alpha * max_j cos(h_v, h_j)``
where h are last hidden states (after the final norm) and j runs over the
non-padding columns so far. The chosen candidate's cache row and logits are
kept, so no step runs the model twice. Recorded hidden states and attention weights are, as transformers', the
prefill's and then those of each step's chosen candidates.
Must agree with transformers 4.55 ``GenerationMixin._contrastive_search`` (with
``_ranking_fast``).
"""

from __future__ import annotations

import torch

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner


def contrastive_search(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Contrastive search over B rows with ``top_k`` candidates and ``penalty_alpha``; stops as greedy search."""
    candidates = CandidateRunner(runner, ctx.config.top_k, float(ctx.config.penalty_alpha or 0.0))
    out = token_loop(candidates, ctx, candidates.choose)  # type: ignore[arg-type]
    if runner.recorder is not None and runner.recorder.steps:  # transformers records a step's chosen candidates
        runner.recorder.steps.pop()  # as the next step's forward: the last step's never
    return out


class CandidateRunner:
    """Gives ``token_loop`` the ``StepRunner`` interface it uses (``next_logits``, ``append``,
    ``sequences``, timings), with a token choice that runs the top-k candidates through the model."""

    def __init__(self, runner: StepRunner, top_k: int, penalty_alpha: float) -> None:
        self.runner = runner
        self.top_k = top_k
        self.penalty_alpha = penalty_alpha
        self.context: torch.Tensor | None = None  # [B, S, C] last hidden state of every column so far
        self.chosen_hidden: torch.Tensor | None = None  # [B, C] hidden of the last chosen candidates
        self.output: torch.Tensor | None = None  # [B, S] the tokens returned (None: the runner's, until a step)

    @property
    def sequences(self) -> torch.Tensor:
        """Tokens [B, S] int64 so far, finished rows padded; the runner keeps the chosen candidates instead."""
        return self.runner.sequences if self.output is None else self.output

    @property
    def prefill_s(self) -> float:
        return self.runner.prefill_s

    @property
    def decode_s(self) -> float:
        return self.runner.decode_s

    @property
    def num_steps(self) -> int:
        return self.runner.num_steps

    @torch.inference_mode()
    def next_logits(self) -> torch.Tensor:
        """Logits [B, V] float32 after the last column: from the prefill, then from the chosen candidates."""
        if self.context is None:
            self.context = self.runner.hidden_states()  # [B, T, C]
            self.chosen_hidden = self.context[:, -1]  # [B, C]
        assert self.chosen_hidden is not None  # set by the prefill above or by choose()
        return self.runner.model.compute_logits(self.chosen_hidden)  # [B, V]

    @torch.inference_mode()
    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Run the top-k tokens of ``scores [B, V]`` as candidates; keep the best row each. Returns tokens [B]."""
        assert self.context is not None
        b, k = scores.shape[0], self.top_k
        top_probs, top_ids = torch.topk(torch.softmax(scores, dim=-1), k=k, dim=-1)  # [B, K]
        mask = self.runner.attention_mask  # [B, S] columns the context covers
        self.runner.reorder(torch.arange(b).repeat_interleave(k))  # [B*K] rows, cache copied K times
        self.runner.append(top_ids.reshape(-1))
        hidden = self.runner.hidden_states()[:, -1]  # [B*K, C]
        picked = rank_candidates(self.context, hidden.view(b, k, -1), top_probs, mask, self.penalty_alpha)  # [B]
        rows = torch.arange(b) * k + picked  # [B]
        self.runner.reorder(rows)
        if self.runner.recorder is not None:  # output_hidden_states / output_attentions: the chosen rows
            self.runner.recorder.steps[-1].select_rows(rows)
        self.chosen_hidden = hidden.index_select(0, rows)  # [B, C]
        self.context = torch.cat([self.context, self.chosen_hidden[:, None]], dim=1)  # [B, S+1, C]
        return top_ids.gather(1, picked[:, None]).squeeze(1)  # [B]

    def append(self, tokens: torch.Tensor) -> None:
        """Add ``tokens [B]`` (finished rows' padding) to the returned tokens only. The runner keeps the chosen
        candidates, as transformers' cache keeps their keys: without a cache, the next forward reads them again,
        so a finished row's scores are the cached run's."""
        base = self.runner.sequences[:, :-1] if self.output is None else self.output  # [B, S]
        self.output = torch.cat([base, tokens[:, None]], dim=1)  # [B, S+1]


def rank_candidates(
    context: torch.Tensor, candidates: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor, penalty_alpha: float
) -> torch.Tensor:
    """Index [B] int64 of the best candidate per row by the contrastive score (HF ``_ranking_fast``).

    context: [B, S, C] hidden states so far; candidates: [B, K, C]; probs: [B, K]
    model confidence; mask: [B, S] (0 = padding, never counted as similar).
    """
    context = context / context.norm(dim=-1, keepdim=True)  # [B, S, C]
    candidates = candidates / candidates.norm(dim=-1, keepdim=True)  # [B, K, C]
    cosine = torch.bmm(candidates, context.transpose(1, 2))  # [B, K, S]
    cosine = cosine + ((1 - mask.to(cosine.dtype)) * torch.finfo(cosine.dtype).min)[:, None, :]  # [B, K, S]
    degeneration = cosine.max(dim=-1).values  # [B, K]
    score = (1.0 - penalty_alpha) * probs - penalty_alpha * degeneration  # [B, K]
    return score.max(dim=-1).indices  # [B]
