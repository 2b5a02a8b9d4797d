"""Sample-and-rank (Adiwardana et al. 2020, "Towards a Human-like Open-Domain Chatbot", sec. 2.4).

Draw ``best_of`` samples per prompt (processors and warpers as in multinomial
sampling, one ``torch.Generator``), then return the ``num_return_sequences``
with the highest score, best first. The score of a sample with n generated
tokens (EOS included) is

    sum_t log softmax(raw logits_t)[token_t] / n ** length_penalty

i.e. its log-likelihood under the *unprocessed* model distribution (so the
ranking does not depend on temperature or truncation), length-normalised as
beam hypotheses are (``length_penalty=1.0``, the default, gives the mean
log-prob per token; ``0.0`` gives the plain sum of the paper).
transformers has no such mode; ``best_of`` follows vLLM / OpenAI naming.
"""

from __future__ import annotations

import dataclasses

import torch

from kvgen.generation.decoding import LoopContext, token_loop
from kvgen.generation.output import GenerateOutput
from kvgen.generation.runner import StepRunner
from kvgen.sampling.ops import choose_tokens


class _RawLogitsRecorder:
    """Wraps the processors to remember each step's raw logits [N, V] before processing."""

    def __init__(self, processors) -> None:
        self.processors = processors
        self.raw: torch.Tensor | None = None

    def __call__(self, token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        self.raw = logits
        return self.processors(token_ids, logits)


def sample_and_rank(runner: StepRunner, ctx: LoopContext) -> GenerateOutput:
    """Sample B*best_of rows (copies of each prompt), return the best B*num_return_sequences, scored."""
    cfg = ctx.config
    recorder = _RawLogitsRecorder(ctx.processors)
    step_logprobs: list[torch.Tensor] = []  # per step [N] log-prob of the drawn token under the raw logits

    def choose(scores: torch.Tensor) -> torch.Tensor:
        tokens = choose_tokens(scores, do_sample=True, generator=ctx.generator).squeeze(1)  # [N]
        assert recorder.raw is not None
        step_logprobs.append(torch.log_softmax(recorder.raw, dim=-1).gather(1, tokens[:, None]).squeeze(1))
        return tokens

    out = token_loop(runner, dataclasses.replace(ctx, processors=recorder), choose)
    scores = sequence_scores(torch.stack(step_logprobs, dim=1), out.num_new_tokens, cfg.length_penalty)
    return _keep_best(out, scores, cfg.best_of or 1, cfg.num_return_sequences)


def sequence_scores(logprobs: torch.Tensor, num_new_tokens: list[int], length_penalty: float) -> torch.Tensor:
    """Scores [N] float32: sum of the first n_i of ``logprobs [N, T]`` divided by n_i ** length_penalty."""
    lengths = torch.tensor(num_new_tokens)  # [N]
    counted = torch.arange(logprobs.shape[1])[None, :] < lengths[:, None]  # [N, T]
    total = torch.where(counted, logprobs, 0.0).sum(dim=1)  # [N]
    return total / lengths.to(torch.float32) ** length_penalty


def _keep_best(out: GenerateOutput, scores: torch.Tensor, best_of: int, n: int) -> GenerateOutput:
    """Per prompt, the ``n`` highest-scoring of its ``best_of`` consecutive rows, best first (ties: first drawn)."""
    order = torch.sort(scores.view(-1, best_of), dim=1, descending=True, stable=True).indices[:, :n]  # [B, n]
    rows = (order + torch.arange(order.shape[0])[:, None] * best_of).view(-1)  # [B*n]
    keep = rows.tolist()
    num_new = [out.num_new_tokens[r] for r in keep]
    width = out.prompt_length + max(num_new)
    return dataclasses.replace(
        out,
        sequences=out.sequences[rows, :width],  # [B*n, T + T_new]
        finish_reasons=[out.finish_reasons[r] for r in keep],
        num_new_tokens=num_new,
        scores=tuple(s[rows] for s in out.scores) if out.scores is not None else None,
        logits=tuple(s[rows] for s in out.logits) if out.logits is not None else None,
        sequences_scores=scores[rows],  # [B*n]
    )
