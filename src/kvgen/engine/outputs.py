"""What the engine returns per request per step (vLLM ``RequestOutput`` names).

Times are ``time.time()`` seconds. Source: vLLM ``vllm/outputs.py`` and
``vllm/sequence.py::RequestMetrics``; finish reasons as OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgen.engine.types import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    ``text`` is cut before a matched stop string (after it with ``include_stop_str_in_output``);
    ``token_ids`` keep every generated id, EOS / stop token included. With
    ``RequestOutputKind.DELTA`` text, ids and logprobs are only what is new in this output.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs asked
    # one dict per token_ids entry, vLLM's: token id -> Logprob(logprob, rank, decoded_token), the generated id
    # first, then the SamplingParams.logprobs most likely ids; None unless logprobs asked
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS

    def finished(self) -> bool:
        """Whether this completion has ended (a method, as vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The state of one request after a step; ``outputs`` holds one entry per completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None  # why the engine aborted the request, if it did
    error_param: str | None = None  # the request's own setting that made the engine abort it (a 400), if one did
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), from the first output on
    # (with RequestOutputKind.DELTA on the first output only)
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one, in place (vLLM ``RequestOutput.add``):
        ``finished`` if either is; each completion of ``next_output`` goes to this one's completion of the same
        ``index`` (appended when there is none); its ``error`` (kvgen's) unless this one has one. ``aggregate`` (DELTA
        outputs): its text, token ids and logprobs are appended and its cumulative logprob, finish and stop reasons
        taken; else it replaces the completion."""
        self.finished |= next_output.finished
        if self.error is None and next_output.error is not None:  # the first error stands, as ParentRequest's
            self.error, self.error_param = next_output.error, next_output.error_param
        for completion in next_output.outputs:
            i = next((i for i, c in enumerate(self.outputs) if c.index == completion.index), None)
            if i is None:
                self.outputs.append(completion)
            elif not aggregate:
                self.outputs[i] = completion
            else:
                _append_delta(self.outputs[i], completion)


def _append_delta(completion: CompletionOutput, delta: CompletionOutput) -> None:
    """``delta``'s new text, ids and logprobs after ``completion``'s; its running totals and reasons replace them."""
    completion.text += delta.text
    completion.token_ids = [*completion.token_ids, *delta.token_ids]
    if delta.logprobs:
        completion.logprobs = [*(completion.logprobs or []), *delta.logprobs]
    completion.cumulative_logprob = delta.cumulative_logprob
    completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
