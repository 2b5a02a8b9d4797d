"""Output processing: engine-core outputs -> ``RequestOutput``s with text and stop strings.

Runs after ``Scheduler.update_from_output`` each step. One engine step::

    scheduler_output = scheduler.schedule()
    runner_output = runner.execute(scheduler_output)  # ModelRunnerOutput({}) when nothing is scheduled
    core_outputs = scheduler.update_from_output(scheduler_output, runner_output)
    processed = output_processor.process_outputs(core_outputs)
    scheduler.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)

Each request's text and stop strings are a ``RequestDetokenizer`` (:mod:`kvgen.engine.detokenizer`).
Source: vLLM v1 ``vllm/v1/engine/output_processor.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgen.engine.detokenizer import RequestDetokenizer
from kvgen.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvgen.engine.request import Request
from kvgen.engine.sampling_params import RequestOutputKind
from kvgen.engine.types import EngineCoreOutput, PositionLogprobs, PromptLogprobs, SampleLogprobs
from kvgen.sampling.stopping import FinishReason
from kvgen.tokenizer import Tokenizer

_STOP = FinishReason.STOP.to_openai()  # the engine reports OpenAI's finish reasons


@dataclass
class RequestState:
    request: Request
    detokenizer: RequestDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    last_token_time: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # an id decoded alone, for each logprob's decoded_token; None when the request does not detokenize
    decode_token: Callable[[int], str] | None = None

    def add(self, output: EngineCoreOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
            self._decode(output.prompt_logprobs)
        self.token_ids.extend(output.new_token_ids)
        if output.new_token_ids:
            self.last_token_time = time.time()
        if self.logprobs is not None and output.new_logprobs:
            self._decode(output.new_logprobs)
            self.logprobs.extend(output.new_logprobs)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(
                position[token_id].logprob for token_id, position in zip(output.new_token_ids, output.new_logprobs))

    def _decode(self, positions: list[PositionLogprobs] | PromptLogprobs) -> None:
        """Each entry's ``decoded_token``: its id decoded alone, as vLLM's ``convert_ids_list_to_tokens``."""
        if self.decode_token is None:
            return
        for position in positions:
            for token_id, logprob in (position or {}).items():
                logprob.decoded_token = self.decode_token(token_id)


@dataclass
class FinishedRequestStats:
    """One finished request's (an ``n > 1`` child's) numbers for the metrics; times in seconds (``time.time``).

    Source: vLLM v1 ``vllm/v1/metrics/stats.py`` (``IterationStats.update_from_finished_request``): queued = arrival to
    first scheduled, prefill = first scheduled to first token, decode = first to last token, inference = first
    scheduled to last token (preemptions included), e2e = arrival to finish.
    """

    request_id: str
    finish_reason: str
    e2e_latency: float
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None

    @property
    def mean_time_per_output_token(self) -> float:
        """Decode time per token after the first (vLLM's: 0 for a one-token request)."""
        return self.decode_time / (self.num_generation_tokens - 1) if self.num_generation_tokens > 1 else 0.0


@dataclass
class IterationStats:
    """What one step's outputs did, for the metrics (vLLM v1 ``IterationStats``; tokens in tokens).

    A request's whole prompt counts in ``num_prompt_tokens`` (and the prefix-cache queries) at its first token.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_preempted_reqs: int = 0  # preemptions this step (a request preempted twice counts twice)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # per finished user request (an n > 1 parent once all its children are done): n, and its longest completion
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stopped_request_ids: list[str]  # stopped by a stop string: pass to Scheduler.finish_requests
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    """Keeps a ``RequestState`` per request from ``add_request`` until its final output.

    ``tokenizer`` None leaves ``text`` empty (token ids only); stop strings then raise ``ValueError``.
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}  # id -> its text decoded alone (logprobs' decoded_token), as met

    def _decode_token(self, token_id: int) -> str:
        """The id decoded alone; "" for an id past the tokenizer's vocabulary (a padded model vocabulary), as HF's
        decode gives."""
        text = self._token_texts.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            is_known = token_id < self.tokenizer.vocab_size
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id]) if is_known else ""
        return text

    def add_request(self, request: Request) -> None:
        """Track a request (call with ``Scheduler.add_request``; ``LLMEngine.add_request`` checks the id is new)."""
        assert request.request_id not in self._states, request.request_id
        params = request.sampling_params
        detokenizer = RequestDetokenizer(self.tokenizer if params.detokenize else None, request.prompt_token_ids,
                                         params)
        decode_token = self._decode_token if self.tokenizer is not None and params.detokenize else None
        state = RequestState(request, detokenizer, decode_token=decode_token)
        if request.sampling_params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self._states[request.request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Forget requests now, with no final output (vLLM ``OutputProcessor.abort_requests``); unknown ids are
        ignored."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        request_outputs: list[RequestOutput] = []
        stopped: list[str] = []
        stats = IterationStats()
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            stop = _update_text(state.detokenizer, output)
            if stop is not None:  # the stop string ends the text before any token-based stop
                if not output.is_finished:
                    stopped.append(output.request_id)
                finish_reason, stop_reason = _STOP, stop
            _count_tokens(stats, state, output)
            state.add(output)
            completion = _completion(state, output, finish_reason, stop_reason)
            if completion is not None:
                delta = state.request.sampling_params.output_kind is RequestOutputKind.DELTA
                prompt_logprobs = output.prompt_logprobs if delta else state.prompt_logprobs
                request_outputs.append(_request_output(state, completion, output.error, prompt_logprobs,
                                                       output.error_param))
            if finish_reason is not None:
                del self._states[output.request_id]
                if finish_reason != FinishReason.ABORT.to_openai() or output.error is not None:
                    stats.finished_requests.append(_finished_stats(state, finish_reason))
        return ProcessedOutputs(request_outputs, stopped, stats)


def _count_tokens(stats: IterationStats, state: RequestState, output: EngineCoreOutput) -> None:
    """The output's new tokens and, on the request's first token, its prompt and prefix-cache hits."""
    stats.num_generation_tokens += len(output.new_token_ids)
    if output.new_token_ids and not state.token_ids:
        request = state.request
        stats.num_prompt_tokens += len(request.prompt_token_ids)
        stats.num_prefix_cache_queries += len(request.prompt_token_ids)
        stats.num_prefix_cache_hits += request.num_cached_prefix_tokens


def _finished_stats(state: RequestState, finish_reason: str) -> FinishedRequestStats:
    """A finished request's phases from its timestamps (a phase it never reached is 0 s); E2E ends now, when its
    last output is made (vLLM: the output processor's iteration timestamp)."""
    request, now = state.request, time.time()

    def interval(start: float | None, end: float | None) -> float:
        return end - start if start is not None and end is not None else 0.0

    scheduled, first, last = request.first_scheduled_time, request.first_token_time, state.last_token_time
    return FinishedRequestStats(
        request.request_id, finish_reason, e2e_latency=now - request.arrival_time,
        queued_time=interval(request.arrival_time, scheduled), prefill_time=interval(scheduled, first),
        decode_time=interval(first, last), inference_time=interval(scheduled, last),
        num_prompt_tokens=len(request.prompt_token_ids), num_generation_tokens=len(state.token_ids),
        max_tokens_param=request.sampling_params.max_tokens)


def _update_text(detokenizer: RequestDetokenizer, output: EngineCoreOutput) -> str | None:
    """Decode the output's tokens; the stop string that matched, if one did. With stop strings, several tokens (kept
    speculative drafts) go in one at a time and those after a match are dropped from ``output``, as if the request
    had stopped there."""
    ids = output.new_token_ids
    if len(ids) < 2 or not detokenizer.has_stop_strings:
        return detokenizer.update(ids, output.is_stop_token, output.is_finished)
    for i in range(len(ids)):
        is_last = i == len(ids) - 1
        stop = detokenizer.update(ids[i : i + 1], output.is_stop_token and is_last, output.is_finished and is_last)
        if stop is not None:
            del ids[i + 1 :]
            if output.new_logprobs is not None:
                del output.new_logprobs[i + 1 :]
            output.is_stop_token = output.is_stop_token and is_last
            return stop
    return None


def _completion(
    state: RequestState, output: EngineCoreOutput, finish_reason: str | None, stop_reason: int | str | None
) -> CompletionOutput | None:
    kind, finished = state.request.sampling_params.output_kind, finish_reason is not None
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    if kind is RequestOutputKind.DELTA:
        text, token_ids = state.detokenizer.get_delta(finished), list(output.new_token_ids)
        logprobs = None if state.logprobs is None else list(output.new_logprobs or [])
    else:
        text, token_ids = state.detokenizer.get_text(finished), list(state.token_ids)
        logprobs = None if state.logprobs is None else list(state.logprobs)
    return CompletionOutput(0, text, token_ids, state.cumulative_logprob, logprobs, finish_reason, stop_reason)


def _request_output(state: RequestState, completion: CompletionOutput, error: str | None,
                    prompt_logprobs: PromptLogprobs | None = None, error_param: str | None = None
                    ) -> RequestOutput:
    request = state.request
    metrics = RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        last_token_time=state.last_token_time,
        finish_time=(request.finish_time or time.time()) if completion.finished() else None,
        num_preemptions=request.num_preemptions,
    )
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion],
        finished=completion.finished(),
        metrics=metrics,
        num_cached_tokens=request.num_cached_prefix_tokens,
        error=error,
        error_param=error_param,
        prompt_logprobs=prompt_logprobs,
    )
