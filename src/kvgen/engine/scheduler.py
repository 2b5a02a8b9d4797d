"""``Scheduler``: which requests run each step and how many tokens each gets (pure Python).

Each step spends a token budget: running requests first (a decode takes 1 token, plus its
n-gram drafts under speculative decoding; an unfinished or recomputing prefill a chunk),
then waiting ones are admitted while slots, budget and KV blocks last, starting after
their prefix-cache hit. When the pool runs out, the newest running request (under the
priority policy: the least important) is preempted: its blocks are freed and it is
recomputed later from its tokens.

Source: vLLM v1 ``vllm/v1/core/sched/scheduler.py`` (semantics: chunked prefill,
no admission in a step that preempted, ``num_computed_tokens``); nano-vllm (size).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable, Sequence

from kvgen.engine.block_manager import BlockManager, cdiv
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.spec_decode import NgramProposer, SpeculativeConfig
from kvgen.engine.types import (
    NO_TOKEN,
    EngineCoreOutput,
    ModelRunnerOutput,
    SampleLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from kvgen.sampling.stopping import FinishReason, TokenStops


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower Request.priority first, then arrival time


class Scheduler:
    """Continuous batching over a ``BlockManager``; budgets are in tokens.

    ``long_prefill_token_threshold`` caps one request's prefill chunk per step (None = no cap);
    with ``max_model_len`` set, a request stops ("length") when prompt + output reach it.
    ``speculative_config`` adds n-gram drafts to decodes (``ScheduledRequest.spec_token_ids``); the runner
    returns the tokens kept and ``num_draft_tokens`` / ``num_accepted_tokens`` count them.
    Call ``update_from_output`` after every ``schedule()``, even when nothing ran.
    Raises ``ValueError`` for limits < 1.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        long_prefill_token_threshold: int | None = None,
        policy: SchedulingPolicy | str = SchedulingPolicy.FCFS,
        max_model_len: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ):
        limits: dict[str, int | None] = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        limits |= {"long_prefill_token_threshold": long_prefill_token_threshold, "max_model_len": max_model_len}
        for name, value in limits.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = SchedulingPolicy(policy)
        self.max_model_len = max_model_len
        self.proposer = None if speculative_config is None else NgramProposer(speculative_config)
        self.num_draft_tokens = 0  # drafts scheduled, since the start (vLLM spec_decode_num_draft_tokens)
        self.num_accepted_tokens = 0  # of them, kept
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._seen_by_runner: set[str] = set()
        self._pending_aborts: deque[str] = deque()  # thread-safe appends; applied by schedule()
        self._finished_ids: list[str] = []  # for the next SchedulerOutput
        self._finished_outputs: list[EngineCoreOutput] = []  # finished inside schedule()
        self._preempted_ids: list[str] = []  # preempted between steps (reset_prefix_cache), for the next output

    # ------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request; its id must not be in flight (``LLMEngine.add_request`` checks that).

        Aborts of its id still pending (the id was unknown or finished when they came) are dropped, so they never
        reach this newer request.
        """
        assert request.request_id not in self.requests, f"request {request.request_id!r} is already in flight"
        while request.request_id in self._pending_aborts:  # issued before this add: for an earlier request or none
            self._pending_aborts.remove(request.request_id)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort_request(self, request_id: str) -> None:
        """Abort at the next ``schedule()`` (safe while a step runs); unknown ids are ignored."""
        self._pending_aborts.append(request_id)

    def is_abort_pending(self, request_id: str) -> bool:
        """Whether an abort of ``request_id`` waits for the next ``schedule()``."""
        return request_id in self._pending_aborts

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish now (e.g. a stop string matched) and free their blocks; reports no output.

        Call between steps. Unknown or already finished ids are ignored.
        """
        assert status.is_finished, f"not a finished status: {status}"
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._remove_from_queues(request)
                self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache (``BlockManager.reset_prefix_cache``); False, changing nothing, while running
        requests hold blocks, unless ``reset_running_requests``: then every running request is preempted first (the
        newest first, so they come back in their order; the next ``SchedulerOutput`` lists them) and it returns True.
        Call between steps. Source: vLLM v1 ``Scheduler.reset_prefix_cache``."""
        if reset_running_requests:
            while self.running:
                request = self.running[-1]
                self._preempt(request)
                self._preempted_ids.append(request.request_id)
        is_reset = self.block_manager.reset_prefix_cache()
        assert is_reset or not reset_running_requests, "only running requests hold blocks"
        return is_reset

    def get_num_unfinished(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks."""
        self._apply_aborts()
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(scheduled, preempted, self.max_num_batched_tokens)
        if not preempted:  # a step that had to preempt has no room for newcomers
            self._schedule_waiting(scheduled, budget)
        finished_ids, self._finished_ids = self._finished_ids, []
        preempted_ids, self._preempted_ids = self._preempted_ids + [r.request_id for r in preempted], []
        num_batched_tokens = sum(len(s.token_ids) for s in scheduled)
        return SchedulerOutput(scheduled, num_batched_tokens, preempted_ids, finished_ids)

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted: list[Request], budget: int) -> int:
        limit, i = budget, 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._fits_pool(request):
                self.running.pop(i)
                self._abort_unfittable(request)
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget) if num_new == request.num_tokens - request.num_computed_tokens == 1 else []
            num_preempted = len(preempted)
            if self._allocate_or_preempt(request, num_new + len(drafts), scheduled, preempted):  # else preempted
                scheduled.append(self._scheduled_request(request, num_new, drafts))
            i = len(scheduled)  # running[:i] are this step's scheduled requests (preemptions shift the rest left)
            if len(preempted) > num_preempted:  # a victim scheduled earlier this step gives its tokens back
                budget = limit - sum(len(s.token_ids) for s in scheduled)
            else:
                budget -= num_new + len(drafts)
        return budget

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """A decode's n-gram drafts: within the budget, the room left by ``max_tokens`` and ``max_model_len`` (a
        draft past them could never be kept), and the free KV blocks less one per running request (drafts never
        take the block another request's decode needs, so they never cause a preemption)."""
        if self.proposer is None:
            return []
        if (limit := self.proposer.config.disable_by_batch_size) is not None and len(self.running) > limit:
            return []
        room = budget - 1
        if (max_tokens := request.sampling_params.max_tokens) is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens - 1)
        room = min(room, request.num_spec_tokens_allowed or room)
        drafts = self.proposer.propose(request, room) if room > 0 else []
        size, end = self.block_manager.block_size, request.num_computed_tokens + 1
        extra_blocks = cdiv(end + len(drafts), size) - max(cdiv(end, size), len(request.block_ids))
        if extra_blocks > 0 and self.block_manager.num_free_blocks - extra_blocks < len(self.running):
            return []
        return drafts

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled: list[ScheduledRequest],
                             preempted: list[Request]) -> bool:
        """Allocate, preempting until it fits: the newest running request (not scheduled yet this step), or under the
        priority policy the least important of all, taken out of ``scheduled`` if it was scheduled this step (as
        vLLM). False if the request itself was preempted."""
        while not self.block_manager.allocate_slots(request, num_new):
            if self.policy is SchedulingPolicy.PRIORITY:
                victim = max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
            else:
                victim = self.running[-1]
            self._unschedule(victim, scheduled)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _unschedule(self, request: Request, scheduled: list[ScheduledRequest]) -> None:
        """Drop the request's share of this step, if it has one."""
        entry = next((s for s in scheduled if s.request_id == request.request_id), None)
        if entry is not None:
            scheduled.remove(entry)
            self.num_draft_tokens -= len(entry.spec_token_ids)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request, front=True)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        in_flight = {h for s in scheduled for h in self._new_full_block_hashes(self.requests[s.request_id], s)}
        postponed: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if not self._fits_pool(request):
                self._abort_unfittable(request)
                continue
            # prompt logprobs need every prompt position's logits: no prefix-cache hit (as vLLM)
            computed_block_ids, num_cached = (([], 0) if request.sampling_params.prompt_logprobs is not None
                                              else self.block_manager.get_computed_blocks(request))
            if request.sampling_params.prompt_logprobs is None and self._waits_for_in_flight(request, num_cached, in_flight):
                postponed.append(request)  # share those blocks next step instead of recomputing them
                continue
            num_new = self._num_new_tokens(request, num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed_block_ids):
                self.waiting.appendleft(request)
                break
            self._admit(request, num_cached)
            scheduled.append(self._scheduled_request(request, num_new))
            in_flight.update(self._new_full_block_hashes(request, scheduled[-1]))
            budget -= num_new
        self.waiting.extendleft(reversed(postponed))

    def _admit(self, request: Request, num_cached: int) -> None:
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:
            request.num_cached_prefix_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = min(request.num_tokens - num_computed, budget)
        if self.long_prefill_token_threshold is not None:
            num_new = min(num_new, self.long_prefill_token_threshold)
        assert num_new > 0, f"{request.request_id} has nothing to compute"
        return num_new

    def _scheduled_request(self, request: Request, num_new: int, drafts: Sequence[int] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        is_new = request.request_id not in self._seen_by_runner
        self._seen_by_runner.add(request.request_id)
        self.num_draft_tokens += len(drafts)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new] + list(drafts),
            start_position=start,
            block_table=list(request.block_ids),
            needs_sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            is_new=is_new,
            grammar=request.grammar,
            spec_token_ids=list(drafts),
        )

    # ------------------------------------------------------------ prefix sharing within a step

    def _new_full_block_hashes(self, request: Request, scheduled: ScheduledRequest) -> list[bytes]:
        """Hashes of the blocks this step's chunk completes (registered only after it runs)."""
        if not self.block_manager.enable_prefix_caching:
            return []
        size = self.block_manager.block_size
        end = (scheduled.start_position + len(scheduled.token_ids)) // size
        return self.block_manager.block_hashes(request, end)[scheduled.start_position // size :]

    def _waits_for_in_flight(self, request: Request, num_cached: int, in_flight: set[bytes]) -> bool:
        """Whether the request's next cacheable block is being computed by another request now."""
        index = num_cached // self.block_manager.block_size
        if not in_flight or index >= (request.num_tokens - 1) // self.block_manager.block_size:
            return False
        return self.block_manager.block_hashes(request, index + 1)[index] in in_flight

    # ------------------------------------------------------------ after the model ran

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed counts, append sampled tokens, finish requests that stop.

        Returns one output per request that got tokens or finished (aborts included). A request with drafts gets
        the drafts it kept and one more token; its rejected drafts' KV slots count as not computed.
        Raises ``ValueError`` if the runner left out a token it had to sample, or returned more than the drafts allow.
        """
        outputs, self._finished_outputs = self._finished_outputs, []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished since schedule()
            token_ids = runner_output.sampled_token_ids.get(request.request_id) if scheduled.needs_sample else []
            if token_ids is None or (scheduled.needs_sample and not token_ids):
                raise ValueError(f"ModelRunnerOutput has no sampled token for request {request.request_id!r}")
            if len(token_ids) > 1 + len(scheduled.spec_token_ids):
                raise ValueError(f"ModelRunnerOutput has {len(token_ids)} tokens for request {request.request_id!r}, "
                                 f"which had {len(scheduled.spec_token_ids)} drafts")
            num_accepted = len(token_ids) - 1 if scheduled.spec_token_ids else 0
            if scheduled.spec_token_ids:
                self._adapt_num_spec_tokens(request, num_accepted == len(scheduled.spec_token_ids))
            self.num_accepted_tokens += num_accepted
            # the kept drafts' KV counts once they are tokens of the request (appended below)
            request.num_computed_tokens += len(scheduled.token_ids) - len(scheduled.spec_token_ids)
            self.block_manager.cache_full_blocks(request)
            if (prompt_logprobs := (runner_output.prompt_logprobs or {}).get(request.request_id)) is not None:
                request.add_prompt_logprobs(scheduled.start_position, prompt_logprobs)
            if scheduled.needs_sample:
                outputs.append(self._append_tokens(request, token_ids, (runner_output.logprobs or {}).get(request.request_id)))
                # kept drafts are computed now (fewer if a stop dropped some); the newest token is not
                request.num_computed_tokens += min(num_accepted, request.num_tokens - 1 - request.num_computed_tokens)
        return outputs

    def _adapt_num_spec_tokens(self, request: Request, is_all_accepted: bool) -> None:
        """Next step's draft limit: +2 after a step that kept every draft, else -1, within [1,
        num_speculative_tokens] (transformers' "heuristic" schedule). Tokens never depend on it (a rejected draft
        costs only time: the verification of k drafts is compute-bound here), so failing drafts shrink to one."""
        assert self.proposer is not None and self.proposer.config.num_speculative_tokens is not None
        maximum = self.proposer.config.num_speculative_tokens
        allowed = request.num_spec_tokens_allowed or maximum
        request.num_spec_tokens_allowed = min(maximum, allowed + 2) if is_all_accepted else max(1, allowed - 1)

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: SampleLogprobs | None
                       ) -> EngineCoreOutput:
        """Append the step's tokens one by one, checking the stops after each (what follows a stop is dropped)."""
        if request.first_token_time is None:
            request.first_token_time = time.time()
        output = EngineCoreOutput(request.request_id, [], None if logprobs is None else [])
        if request.num_output_tokens == 0 and request.sampling_params.prompt_logprobs is not None:
            output.prompt_logprobs = list(request.prompt_logprobs)
        status, error, is_stop_token = None, None, False
        for i, token_id in enumerate(token_ids):
            if token_id == NO_TOKEN:  # its masks left nothing to draw: it ends here, alone
                names = _masking_params(request)
                status, output.error_param = RequestStatus.FINISHED_ABORTED, names[0]
                error = (f"no token can be generated at output token {request.num_output_tokens}: "
                         f"{', '.join(names)} together leave every token masked out")
                break
            if request.grammar is not None and not request.grammar.accept(token_id):
                # the sampler's mask allowed it, so the matcher itself failed (its limits: a{1000000})
                status, output.error_param = RequestStatus.FINISHED_ABORTED, "structured_outputs"
                error = (f"structured_outputs: the grammar failed at output token {request.num_output_tokens}: "
                         f"{request.grammar.error}")
                break
            request.append_output_token_ids(token_id)
            output.new_token_ids.append(token_id)
            if logprobs is not None and output.new_logprobs is not None:
                output.new_logprobs.append(logprobs[i])
            status, is_stop_token = self._status_after(request)
            if status is not None:
                break
        output.is_stop_token = is_stop_token
        if status is not None:
            self.running.remove(request)
            self._finish(request, status, error)
            output.finish_reason, output.stop_reason, output.error = status.finish_reason, request.stop_reason, error
        return output

    def _status_after(self, request: Request) -> tuple[RequestStatus | None, bool]:
        """After a token: the request's finished status (None: it goes on) and whether the token is EOS or a stop
        token id (left out of the text)."""
        status = self._check_stop(request)
        is_complete = request.grammar is not None and request.grammar.is_terminated
        if is_complete and status is not RequestStatus.FINISHED_STOPPED:
            # a complete structured output, even one its max_tokens-th token completes: "stop", not a truncation
            return RequestStatus.FINISHED_STOPPED, False  # its last token is text
        return status, status is RequestStatus.FINISHED_STOPPED

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Stops that need no text (``kvgen.sampling.stopping.TokenStops``); a stop token wins over length."""
        params = request.sampling_params
        stops = TokenStops(
            eos_token_ids=() if params.ignore_eos else request.eos_token_ids,
            stop_token_ids=tuple(params.stop_token_ids or ()),
            min_new_tokens=params.min_tokens,
            max_new_tokens=params.max_tokens,
            max_total_tokens=self.max_model_len,
        )
        hit = stops.check(request.output_token_ids[-1], request.num_output_tokens, request.num_tokens)
        if hit is None:
            return None
        reason, request.stop_reason = hit
        return RequestStatus.FINISHED_STOPPED if reason is FinishReason.STOP else RequestStatus.FINISHED_LENGTH

    # ------------------------------------------------------------ bookkeeping

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.policy is SchedulingPolicy.PRIORITY:
            key = (request.priority, request.arrival_time)
            index = next((i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key), None)
            self.waiting.insert(len(self.waiting) if index is None else index, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _remove_from_queues(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _fits_pool(self, request: Request) -> bool:
        return cdiv(request.num_tokens, self.block_manager.block_size) <= self.block_manager.num_blocks

    def _abort_unfittable(self, request: Request) -> None:
        bm = self.block_manager
        error = (
            f"request {request.request_id!r} needs {cdiv(request.num_tokens, bm.block_size)} KV blocks of "
            f"{bm.block_size} tokens for {request.num_tokens} tokens, but the pool has {bm.num_blocks}"
        )
        self._finish(request, RequestStatus.FINISHED_ABORTED, error)
        abort = FinishReason.ABORT.to_openai()
        self._finished_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=abort, error=error))

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            request = self.requests.get(self._pending_aborts.popleft())
            if request is not None:
                self._remove_from_queues(request)
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                abort = FinishReason.ABORT.to_openai()
                self._finished_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=abort))

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        request.status, request.finish_time, request.error = status, time.time(), error
        self.block_manager.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_ids.append(request.request_id)


def _masking_params(request: Request) -> list[str]:
    """The request's settings that mask tokens out (the sampler's -inf stages), as the API names them; at least one
    entry ("sampling_params" when none is found, which the masks make impossible)."""
    params = request.sampling_params
    names = [name for name, is_set in (
        ("structured_outputs", request.grammar is not None),
        ("allowed_token_ids", bool(params.allowed_token_ids)),
        ("bad_words", bool(params.bad_words_token_ids)),
        ("min_tokens", request.num_output_tokens < params.min_tokens),
    ) if is_set]
    return names or ["sampling_params"]
