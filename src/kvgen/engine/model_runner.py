"""``ModelRunner``: the only place where scheduled requests become tensors.

Each step packs every scheduled chunk into one row ``[1, N]`` (one-token chunks
first, so they attend as one batch), runs the model over the ``PagedKVCache``,
computes logits only for the last token of each request that samples, and calls
the batched ``Sampler``. It keeps one ``torch.Generator`` per request, from the
request's first step until the scheduler reports it finished: seeded from
``SamplingParams.seed``, else from the runner's own seeded RNG.
Source: vLLM v1 ``GPUModelRunner.execute_model`` (shape of the step), nano-vllm.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvgen.engine.sampler import Sampler, SamplingRow
from kvgen.engine.types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvgen.kv_cache.paged import PagedAttentionMetadata, PagedKVCache

_SEED_SPAN = 2**63 - 1  # unseeded requests draw their seed from [0, 2**63 - 1)


@dataclass
class PackedStep:
    """One step's model inputs. input_ids, positions: [1, N] long; ``sample_rows``: [R] indices
    (into the packed tokens) of the last token of each request that samples, in ``sample_requests`` order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: PagedAttentionMetadata
    sample_rows: torch.Tensor
    sample_requests: list[ScheduledRequest]


def pack_step(scheduled: Sequence[ScheduledRequest], block_size: int) -> PackedStep:
    """Pack the step's chunks: one-token chunks first (stable order), then the longer ones."""
    order = sorted(scheduled, key=lambda s: len(s.token_ids) != 1)
    ids = [t for s in order for t in s.token_ids]
    positions = [p for s in order for p in range(s.start_position, s.start_position + len(s.token_ids))]
    query_lens = [len(s.token_ids) for s in order]
    meta = PagedAttentionMetadata.build(query_lens, [s.start_position for s in order], [s.block_table for s in order], block_size)
    last = (meta.query_start_loc[1:] - 1).tolist()  # [R] index of each chunk's last token
    sample_requests = [s for s in order if s.needs_sample]
    sample_rows = torch.tensor([i for i, s in zip(last, order) if s.needs_sample], dtype=torch.long)
    input_ids = torch.tensor([ids], dtype=torch.long)  # [1, N]
    return PackedStep(input_ids, torch.tensor([positions], dtype=torch.long), meta, sample_rows, sample_requests)


@dataclass
class RunnerTimings:
    """Cumulative wall-clock seconds of each part of ``execute`` (for benchmarks and profiles)."""

    prepare_s: float = 0.0  # packing token ids, positions, slot mapping, block tables
    forward_s: float = 0.0  # the model over the packed row
    logits_s: float = 0.0  # LM head on the sampled rows
    sample_s: float = 0.0  # the batched sampler
    num_steps: int = 0
    num_tokens: int = 0  # packed tokens over all steps


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
        self.sampler = sampler or Sampler()
        self._seed_rng = torch.Generator()
        if seed is None:
            self._seed_rng.seed()
        else:
            self._seed_rng.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.timings = RunnerTimings()

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
        t0 = time.perf_counter()
        for scheduled in scheduler_output.scheduled:
            self._generator(scheduled)
        step = pack_step(scheduler_output.scheduled, self.cache.block_size)
        t1 = time.perf_counter()
        hidden = self.model(step.input_ids, step.positions, self.cache, step.attn_metadata)  # [1, N, C]
        t2 = time.perf_counter()
        timings = self.timings
        timings.prepare_s, timings.forward_s = timings.prepare_s + t1 - t0, timings.forward_s + t2 - t1
        timings.num_steps, timings.num_tokens = timings.num_steps + 1, timings.num_tokens + step.input_ids.shape[1]
        if not step.sample_requests:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[0].index_select(0, step.sample_rows))  # [R, V] float32
        t3 = time.perf_counter()
        rows = [
            SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids, self._generators[s.request_id], self.eos_token_ids)
            for s in step.sample_requests
        ]
        sampled = self.sampler(logits, rows)
        timings.logits_s, timings.sample_s = timings.logits_s + t3 - t2, timings.sample_s + time.perf_counter() - t3
        request_ids = [s.request_id for s in step.sample_requests]
        logprobs = {rid: lp for rid, lp in zip(request_ids, sampled.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(request_ids, sampled.token_ids)), logprobs or None)
