"""``ModelRunner``: the only place where scheduled requests become tensors.

Each step packs every scheduled chunk into one row ``[1, N]`` (one-token chunks
first, so they attend as one batch), runs the model over the ``PagedKVCache``,
computes logits only for the last token of each request that samples (the last
1 + k with k speculative drafts), and calls the batched ``Sampler``. It keeps one
``torch.Generator`` per request, from the request's first step until the scheduler
reports it finished: seeded from ``SamplingParams.seed``, else from the runner's own
seeded RNG.
Source: vLLM v1 ``GPUModelRunner.execute_model`` (shape of the step), nano-vllm.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from kvgen.engine.sampler import Sampler, SamplerOutput, SamplingRow, token_logprobs
from kvgen.engine.types import (
    ModelRunnerOutput,
    SampleLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from kvgen.kv_cache.paged import PagedAttentionMetadata, PagedKVCache
from kvgen.sampling import ops

_SEED_SPAN = 2**63 - 1  # unseeded requests draw their seed from [0, 2**63 - 1)
_PROMPT_LOGPROB_ROWS = 256  # LM-head rows per pass for prompt logprobs (a [256, V] float32 block)


@dataclass
class PackedStep:
    """One step's model inputs. input_ids, positions: [1, N] long; ``sample_rows``: [R] indices
    (into the packed tokens) of the last token of each request that samples, in ``sample_requests`` order (with
    k drafts, its last 1 + k tokens).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: PagedAttentionMetadata
    sample_rows: torch.Tensor
    sample_requests: list[ScheduledRequest]
    # (request, packed index of its chunk's first token, number of its positions whose next token is a prompt token)
    # for requests with SamplingParams.prompt_logprobs
    prompt_logprob_chunks: list[tuple[ScheduledRequest, int, int]] = field(default_factory=list)


def pack_step(scheduled: Sequence[ScheduledRequest], block_size: int) -> PackedStep:
    """Pack the step's chunks: one-token chunks first (stable order), then the longer ones."""
    order = sorted(scheduled, key=lambda s: len(s.token_ids) != 1)
    ids = [t for s in order for t in s.token_ids]
    positions = [p for s in order for p in range(s.start_position, s.start_position + len(s.token_ids))]
    query_lens = [len(s.token_ids) for s in order]
    meta = PagedAttentionMetadata.build(query_lens, [s.start_position for s in order], [s.block_table for s in order], block_size)
    last = list(itertools.accumulate(query_lens, initial=-1))[1:]  # index of each chunk's last token
    sample_requests = [s for s in order if s.needs_sample]
    rows = [r for i, s in zip(last, order) if s.needs_sample for r in range(i - len(s.spec_token_ids), i + 1)]
    sample_rows = torch.tensor(rows, dtype=torch.long)  # [R]
    input_ids = torch.tensor([ids], dtype=torch.long)  # [1, N]
    prompt_chunks = [  # (request, its chunk's first packed index, positions scored)
        (s, end - len(s.token_ids) + 1, min(s.start_position + len(s.token_ids), len(s.prompt_token_ids) - 1) - s.start_position)
        for s, end in zip(order, last) if s.sampling_params.prompt_logprobs is not None
    ]
    return PackedStep(input_ids, torch.tensor([positions], dtype=torch.long), meta, sample_rows, sample_requests,
                      [c for c in prompt_chunks if c[2] > 0])


class ModelRunner:
    """Runs scheduled steps of ``model`` over ``cache``.

    ``eos_token_ids`` are what ``min_tokens`` suppresses (with each request's
    ``stop_token_ids``); ``seed`` seeds the generator that seeds unseeded requests.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = sampler or Sampler(getattr(model, "kernels", None))  # the C++ draw with the C++ model
        self._seed_rng = torch.Generator()
        if seed is None:
            self._seed_rng.seed()
        else:
            self._seed_rng.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    @property
    def num_tracked_requests(self) -> int:
        """Requests whose per-request state (generator) the runner holds."""
        return len(self._generators)

    def _generator(self, scheduled: ScheduledRequest) -> torch.Generator:
        gen = self._generators.get(scheduled.request_id)
        if gen is None or scheduled.is_new:
            seed = scheduled.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, _SEED_SPAN, (1,), generator=self._seed_rng))
            gen = torch.Generator()
            gen.manual_seed(seed)
            self._generators[scheduled.request_id] = gen
        return gen

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the sampled token (and logprobs if asked) of every ``needs_sample`` request."""
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput({})
        step = self.prepare_inputs(scheduler_output.scheduled)
        hidden = self.run_model(step)  # [1, N, C]
        prompt_logprobs = self.compute_prompt_logprobs(hidden, step) if step.prompt_logprob_chunks else None
        if not step.sample_requests:
            return ModelRunnerOutput({}, None, prompt_logprobs)
        token_ids, logprobs = self.sample(self.compute_logits(hidden, step), step)
        return ModelRunnerOutput(token_ids, logprobs or None, prompt_logprobs)

    # The phases of ``execute``, separate methods so that a profiler can wrap them from outside.

    def prepare_inputs(self, scheduled: Sequence[ScheduledRequest]) -> PackedStep:
        """Start new requests' generators and pack the step's chunks (see :func:`pack_step`)."""
        for s in scheduled:
            self._generator(s)
        return pack_step(scheduled, self.cache.block_size)

    def run_model(self, step: PackedStep) -> torch.Tensor:
        """The model over the packed row; returns hidden states [1, N, C]."""
        return self.model(step.input_ids, step.positions, self.cache, step.attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, step: PackedStep) -> torch.Tensor:
        """LM head on the sampled rows only: hidden [1, N, C] -> logits [R, V] float32."""
        lm_head = cast("Callable[[torch.Tensor], torch.Tensor]", self.model.compute_logits)
        return lm_head(hidden[0].index_select(0, step.sample_rows))  # [R, V]

    def compute_prompt_logprobs(self, hidden: torch.Tensor, step: PackedStep) -> dict[str, SampleLogprobs]:
        """Per request of ``step.prompt_logprob_chunks``: the logprob of each next prompt token under its chunk's
        logits (raw log-softmax, as the sampled tokens'), and the ``prompt_logprobs`` best; hidden [1, N, C]. The
        LM head runs on at most ``_PROMPT_LOGPROB_ROWS`` rows at a time ([rows, V] float32 each)."""
        lm_head = cast("Callable[[torch.Tensor], torch.Tensor]", self.model.compute_logits)
        out: dict[str, SampleLogprobs] = {}
        for s, first, count in step.prompt_logprob_chunks:
            entries: SampleLogprobs = out.setdefault(s.request_id, [])
            for a in range(0, count, _PROMPT_LOGPROB_ROWS):
                b = min(count, a + _PROMPT_LOGPROB_ROWS)
                logprobs = ops.compute_logprobs(lm_head(hidden[0, first + a : first + b]))  # [b - a, V]
                next_ids = s.prompt_token_ids[s.start_position + 1 + a : s.start_position + 1 + b]
                found = token_logprobs(logprobs, torch.tensor(next_ids), [s.sampling_params.prompt_logprobs] * (b - a))
                entries.extend(lp for lp in found if lp is not None)
        return out

    def sample(self, logits: torch.Tensor, step: PackedStep) -> tuple[dict[str, list[int]], dict[str, SampleLogprobs]]:
        """The batched sampler over logits [R, V] (one row per request that samples, 1 + k with k drafts, each row
        with the history it would have had), then the drafts verified: a request keeps its drafts up to the first
        that differs from its row's token, then that token. Returns (request_id -> new tokens, -> their logprobs).
        """
        rows = [
            SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids + s.spec_token_ids[:j] if j else
                        s.output_token_ids, self._generators[s.request_id], self.eos_token_ids, s.grammar)
            for s in step.sample_requests for j in range(1 + len(s.spec_token_ids))
        ]
        states = {s.request_id: self._generators[s.request_id].get_state() for s in step.sample_requests
                  if s.spec_token_ids and not s.sampling_params.is_greedy}
        sampled: SamplerOutput = self.sampler(logits, rows)
        token_ids: dict[str, list[int]] = {}
        logprobs: dict[str, SampleLogprobs] = {}
        first = 0
        for s in step.sample_requests:
            num_rows = 1 + len(s.spec_token_ids)
            kept = verify_drafts(s.spec_token_ids, sampled.token_ids[first : first + num_rows])
            token_ids[s.request_id] = kept
            if s.sampling_params.logprobs is not None:
                logprobs[s.request_id] = cast("SampleLogprobs", sampled.logprobs[first : first + len(kept)])
            if s.request_id in states and len(kept) < num_rows:  # as if only the kept rows had drawn
                generator = self._generators[s.request_id]
                generator.set_state(states[s.request_id])
                ops.uniforms(len(kept), [generator] * len(kept))
            first += num_rows
        return token_ids, logprobs


def verify_drafts(drafts: Sequence[int], token_ids: Sequence[int]) -> list[int]:
    """The tokens kept from one request's rows: ``token_ids[j]`` was sampled after ``drafts[:j]``, so drafts are kept
    while they equal the token sampled at their position, and the first differing token (or the one after the
    last draft) ends the list. token_ids: 1 + len(drafts) ids. Source: Leviathan et al. 2023 with point-mass drafts.
    """
    assert len(token_ids) == len(drafts) + 1, (drafts, token_ids)
    kept: list[int] = []
    for draft, token_id in zip([*drafts, None], token_ids):
        kept.append(token_id)
        if token_id != draft:
            break
    return kept
