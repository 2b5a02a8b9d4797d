"""``Request``: one sequence's scheduling state, owned by the ``Scheduler``.

Source: vLLM v1 ``vllm/v1/request.py`` (names: ``num_computed_tokens``, ``status``,
``RequestStatus``); ``block_ids`` is the request's block table, kept here as in nano-vllm.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvgen.engine.sampling_params import SamplingParams
from kvgen.engine.structured_outputs import GrammarMatcher
from kvgen.engine.types import PromptLogprobs, SampleLogprobs
from kvgen.sampling.stopping import FinishReason


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its blocks were freed and will be recomputed
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context length
    FINISHED_ABORTED = "finished_aborted"  # aborted by the caller, or it can never fit the KV cache

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason``: "stop", "length", "abort", or None while unfinished."""
        reason = _FINISH_REASONS.get(self)
        return None if reason is None else reason.to_openai()


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(kw_only=True, eq=False)
class Request:
    """A prompt and what has been generated for it; times are ``time.time()`` seconds.

    ``num_computed_tokens`` counts the tokens of ``all_token_ids`` whose KV is in the cache
    (vLLM v1); ``block_ids`` are the physical KV blocks covering positions ``[0, len * block_size)``.
    ``eos_token_ids`` come from the tokenizer (the engine fills them).
    Raises ``ValueError`` for an empty prompt or a negative token id.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower runs first under the priority policy
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None  # SamplingParams.structured_outputs, compiled by the engine
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)  # prompt + output
    num_computed_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)  # full blocks, by BlockManager
    num_cached_prefix_tokens: int = field(default=0, init=False)  # prefix-cache hit at first admission
    num_preemptions: int = field(default=0, init=False)
    # speculative decoding: drafts allowed next step (0 = the config's num_speculative_tokens), adapted by the scheduler
    num_spec_tokens_allowed: int = field(default=0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)
    stop_reason: int | str | None = field(default=None, init=False)  # the stop token id or stop string
    error: str | None = field(default=None, init=False)  # why the engine aborted it
    # SamplingParams.prompt_logprobs: per prompt token so far (None for the first), filled chunk by chunk
    prompt_logprobs: PromptLogprobs = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"prompt_token_ids must be a non-empty list, got {ids!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"prompt_token_ids must hold ints >= 0, got {ids!r}")
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.all_token_ids = list(ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs.append(None)  # the first token has no context (a one-token prompt has only it)

    def add_prompt_logprobs(self, start_position: int, logprobs: SampleLogprobs) -> None:
        """Record the logprobs of prompt tokens ``start_position + 1 ..`` (a chunk computed from ``start_position``);
        a chunk recomputed after a preemption adds only the tokens not recorded yet."""
        if not logprobs:
            return
        num_known = len(self.prompt_logprobs) - (start_position + 1)  # this chunk's tokens recorded before
        assert num_known >= 0, f"prompt logprobs of {self.request_id} skip tokens"
        self.prompt_logprobs.extend(logprobs[num_known:])

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        new = [token_ids] if isinstance(token_ids, int) else token_ids
        self.output_token_ids.extend(new)
        self.all_token_ids.extend(new)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
