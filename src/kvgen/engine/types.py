"""Typed hand-offs between the scheduler, the model runner and the output processor.

One engine step: ``Scheduler.schedule() -> SchedulerOutput``;
``ModelRunner.execute(SchedulerOutput) -> ModelRunnerOutput``;
``Scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput) -> list[EngineCoreOutput]``;
``OutputProcessor.process_outputs(list[EngineCoreOutput])`` -> ``RequestOutput``s.
No tensors cross these boundaries. Source: vLLM v1 ``sched/output.py``, ``v1/outputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.structured_outputs import GrammarMatcher


# The sampled "token" of a row whose masks (structured outputs, allowed_token_ids, bad_words, min_tokens) leave no
# token to draw: never a vocabulary id; the scheduler ends that request alone (Sampler, Scheduler._append_tokens).
NO_TOKEN = -1


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``vllm.logprobs.Logprob``).

    ``logprob``: natural log of the softmax of the RAW logits (before any logits processor; vLLM's default
    ``raw_logprobs``); ``rank``: 1-based place of the token in the vocabulary by logprob (the number of ids whose
    logprob is >= its own, as vLLM's ``batched_count_greater_than``); ``decoded_token``: the id decoded alone
    (``tokenizer.decode([id])``, as vLLM), None when the request does not detokenize.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs, vLLM's shape: the chosen (sampled or prompt) token's entry first, then the
# SamplingParams.logprobs / prompt_logprobs most likely ids with ranks 1..k (one entry when the chosen id is among
# them).
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]  # one per generated token (vLLM ``SampleLogprobs``)
PromptLogprobs = list[PositionLogprobs | None]  # one per prompt token, None for the first (vLLM ``PromptLogprobs``)


@dataclass
class ScheduledRequest:
    """One request's share of a step: feed ``token_ids`` at positions ``start_position + i``."""

    request_id: str
    token_ids: list[int]  # all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled]
    start_position: int  # position of token_ids[0] (= num_computed_tokens before this step)
    block_table: list[int]  # physical block ids covering positions [0, start_position + len(token_ids))
    needs_sample: bool  # this chunk reaches the last known token: sample the next one
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties, min_tokens); a snapshot
    # The runner has never seen this request: create its state (seeded generator). False after a
    # preemption, so the generator continues instead of being reseeded.
    is_new: bool
    grammar: GrammarMatcher | None = None  # the request's structured-output matcher (the sampler masks with it)
    # speculative decoding: n-gram drafts, the last len(spec_token_ids) of token_ids (needs_sample is then True); the
    # runner samples at each of the 1 + k last positions and returns the drafts it keeps plus one token
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int  # sum of len(token_ids), <= max_num_batched_tokens
    preempted_request_ids: list[str]  # blocks freed; they come back with start_position 0, is_new False
    # Finished or aborted since the last step, among requests the runner has seen: drop their
    # state (generators included) before handling `scheduled`, where an id may come back as new.
    finished_request_ids: list[str]


@dataclass
class ModelRunnerOutput:
    # request_id -> new tokens (only for needs_sample): one, or with drafts the kept drafts and one more
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, SampleLogprobs] | None = None  # request_id -> one per new token (requests that asked)
    # request_id -> logprobs of the prompt tokens after this step's chunk (prompt positions start + 1 ..), for
    # requests with SamplingParams.prompt_logprobs
    prompt_logprobs: dict[str, SampleLogprobs] | None = None


@dataclass
class EngineCoreOutput:
    """What one step did to one request; ``finish_reason`` is set on its last output only."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: SampleLogprobs | None = None
    # on a request's first output when it asked for prompt_logprobs: one entry per prompt token, None for the first
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id (or, after detokenizing, stop string)
    is_stop_token: bool = False  # the last new token is EOS or a stop token id: not part of the text
    error: str | None = None  # why the engine aborted the request, if it did
    error_param: str | None = None  # the request's own setting that left it nothing to do (a 400), if one did

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
