"""``LLMEngine``: continuous batching of requests over one model and one paged KV pool.

One ``step()``: ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` ->
``Scheduler.update_from_output()`` -> ``OutputProcessor.process_outputs()`` (text,
stop strings) -> requests stopped by a stop string are finished in the scheduler
-> children of ``n > 1`` requests merge into their parent's output.
Requests are validated in ``add_request``; a bad one raises there and never
reaches the scheduler, so it cannot disturb the others.
Source: vLLM v1 ``LLMEngine`` / ``EngineCore.step`` (names and step order).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvgen.config import ModelConfig
from kvgen.engine.block_manager import BlockManager
from kvgen.engine.engine_args import DEFAULT_KV_CACHE_MEMORY, EngineArgs
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.output_processor import IterationStats, OutputProcessor
from kvgen.engine.outputs import RequestOutput
from kvgen.engine.parallel_sampling import (
    ParentRequest,
    child_request_id,
    child_sampling_params,
)
from kvgen.engine.pooling import (
    EmbeddingJob,
    EmbeddingRequestOutput,
    PoolingParams,
    default_pooling_type,
)
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.sampling_params import SamplingParams, truncate_prompt
from kvgen.engine.scheduler import Scheduler, SchedulingPolicy
from kvgen.engine.spec_decode import SpeculativeConfig
from kvgen.engine.structured_outputs import GrammarCompiler, GrammarMatcher
from kvgen.kv_cache.paged import PagedKVCache, num_blocks_for_memory
from kvgen.kv_cache.pool import PoolMappingError
from kvgen.models import CausalLM, cache_dtype
from kvgen.tokenizer import Tokenizer


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked, tokenized and with its grammars built (:meth:`LLMEngine.prepare_request`), not yet queued:
    ``prompt_token_ids`` (truncated), ``params`` completed by the engine (``max_tokens`` filled in), one grammar
    matcher (or None) per completion, ``arrival_time`` in seconds since the epoch."""

    request_id: str
    text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    grammars: list[GrammarMatcher | None]
    arrival_time: float
    priority: int


@dataclass
class SchedulerStats:
    """A snapshot of the engine's queues and KV pool (vLLM ``SchedulerStats`` names)."""

    num_running_reqs: int
    num_waiting_reqs: int  # preempted requests included
    kv_cache_usage: float  # fraction of KV blocks held by requests, in [0, 1]
    num_free_blocks: int  # blocks no request holds (evictable prefix-cache blocks included)
    num_blocks: int
    num_draft_tokens: int | None = None  # speculative decoding only: drafts scheduled since the start
    num_accepted_tokens: int | None = None  # of them, kept


class LLMEngine:
    """Owns the scheduler, the KV pool, the model runner and the output processor.

    ``tokenizer`` None means token-id prompts only and empty ``text`` (stop strings then raise).
    Raises ``ValueError`` when ``max_model_len`` exceeds the model's context window or, given, the KV pool; left
    unset, it is the context window or, if fewer, the tokens the pool holds (one request must always fit); and, naming
    ``num_blocks`` or ``kv_cache_memory``, for a pool the system cannot map.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None, engine_args: EngineArgs | None = None) -> None:
        args = engine_args or EngineArgs()
        config = model.config
        self.engine_args, self.model, self.tokenizer = args, model, tokenizer
        # the largest logprobs / prompt_logprobs a request may ask for (max_logprobs -1: the vocabulary, as vLLM)
        self.max_logprobs = config.vocab_size if args.max_logprobs == -1 else args.max_logprobs
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be <= the model's context ({config.max_position_embeddings}), got {self.max_model_len}"
            )
        dtype = cache_dtype(model, args.kv_cache_dtype)
        num_blocks = args.num_blocks
        if num_blocks is None:
            memory = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            num_blocks = num_blocks_for_memory(config, memory, args.block_size, dtype)
        self.max_model_len = _fit_pool(self.max_model_len, args, num_blocks)
        self.cache = _make_pool(config, args, num_blocks, dtype)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        spec = args.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineArgs parses it
        self.scheduler = Scheduler(args.max_num_seqs, args.max_num_batched_tokens, self.block_manager,
                                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                                   policy=args.scheduling_policy, max_model_len=self.max_model_len,
                                   speculative_config=spec)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids if tokenizer is not None else config.eos_token_ids)
        self.runner = ModelRunner(model, self.cache, self.eos_token_ids, seed=args.seed)
        self.output_processor = OutputProcessor(tokenizer)
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, tuple[ParentRequest, int]] = {}
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first structured-output request
        self._grammar_lock = threading.Lock()
        # called after each step that had outputs, in the step's thread (vLLM's StatLoggerBase.record): the metrics
        self.stat_loggers: list[Callable[[IterationStats], None]] = []
        directory = Path(args.model).expanduser()
        if not directory.is_dir():  # a repo id in the Hugging Face cache: its snapshot holds 1_Pooling/config.json
            from kvgen.loader import cached_snapshot

            directory = cached_snapshot(str(args.model)) or directory
        self.pooling_type = args.pooling_type or default_pooling_type(model, directory if directory.is_dir() else None)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Load ``engine_args.model`` (see ``kvgen.load_model``) and build an engine on it."""
        from kvgen.loader import load_model

        model, tokenizer = load_model(engine_args.model, engine_args.dtype, engine_args.quantization)
        return cls(model, tokenizer, engine_args)

    def get_tokenizer(self) -> Tokenizer | None:
        """vLLM v1 ``LLMEngine.get_tokenizer``: the engine's tokenizer; None for an engine of token ids only (as
        ``LLM.get_tokenizer`` and ``AsyncLLMEngine.get_tokenizer`` answer; vLLM raises there)."""
        return self.tokenizer

    # ------------------------------------------------------------ requests

    def _truncated(self, token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` ids (-1: ``max_model_len``; None: all). Raises ``ValueError``
        for one above ``max_model_len`` whatever the prompt's length (vLLM's ``_validate_truncation_size``)."""
        k = truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or <= max_model_len ({self.max_model_len}), got {k}")
        return truncate_prompt(token_ids, k, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request: ``prompt`` text (or a list of token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt``
        dict), or ``prompt_token_ids`` (with ``prompt``, a string, as their text: ``RequestOutput.prompt``, as
        vLLM's ``TokensPrompt``).

        ``priority``: lower runs first under ``scheduling_policy="priority"`` (vLLM's rule); any other
        value than 0 is refused under "fcfs".
        Raises ``ValueError`` naming the field for a duplicate ``request_id``, a missing or
        empty prompt, ids outside the vocabulary, ``logprobs`` above ``max_logprobs``,
        ``truncate_prompt_tokens`` above ``max_model_len`` (as vLLM), a prompt that leaves no room for
        ``max_tokens`` within ``max_model_len``, or ``structured_outputs`` that do not compile.
        """
        if isinstance(request_id, str) and request_id:
            self._check_request_id(request_id, getattr(sampling_params, "n", 1))  # the duplicate named first
        self.add_prepared(self.prepare_request(request_id, prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                                               arrival_time=arrival_time, priority=priority))

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> PreparedRequest:
        """:meth:`add_request`'s work that changes nothing in the engine: checks, tokenization, structured-output
        grammars (a long regex compiles for seconds). Safe beside a step in another thread, so the async front runs
        it in a worker thread and only :meth:`add_prepared` between steps. Raises as :meth:`add_request`, except
        for a duplicate ``request_id`` (:meth:`add_prepared` checks that)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if prompt_token_ids is not None:
                raise ValueError("pass prompt_token_ids in the prompt dict or as prompt_token_ids, not both")
            prompt, prompt_token_ids = split_prompt(prompt)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.scheduler.policy is not SchedulingPolicy.PRIORITY:
            raise ValueError(f"priority must be 0 unless scheduling_policy is 'priority' (--scheduling-policy "
                             f"priority), got {priority}")
        text, token_ids = self._prompt_tokens(prompt, prompt_token_ids)
        token_ids = self._truncated(token_ids, params.truncate_prompt_tokens)
        params = self._check_request(params, len(token_ids))
        return PreparedRequest(request_id, text, token_ids, params, self._grammars(params),
                               time.time() if arrival_time is None else arrival_time, priority)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a request :meth:`prepare_request` made. Call between steps. Raises ``ValueError`` for a
        ``request_id`` in flight."""
        request_id, params, grammars = prepared.request_id, prepared.params, prepared.grammars
        self._check_request_id(request_id, params.n)

        def request(request_id: str, params: SamplingParams, grammar: GrammarMatcher | None) -> Request:
            return Request(request_id=request_id, prompt_token_ids=list(prepared.prompt_token_ids),
                           sampling_params=params, prompt=prepared.text, arrival_time=prepared.arrival_time,
                           priority=prepared.priority, eos_token_ids=self.eos_token_ids, grammar=grammar)

        if params.n == 1:
            self._add(request(request_id, params, grammars[0]))
            return
        parent = ParentRequest(request_id, params)
        for index, child_id in enumerate(parent.child_ids):  # the first child's errors (stop strings without a
            # tokenizer) raise before the parent is registered: a registered parent would hold its id forever
            self._add(request(child_id, child_sampling_params(params, index), grammars[index]))
        self._parents[request_id] = parent
        self._child_to_parent.update((child_id, (parent, index)) for index, child_id in enumerate(parent.child_ids))

    def _grammars(self, params: SamplingParams) -> list[GrammarMatcher | None]:
        """One structured-output matcher per completion (None without ``structured_outputs``).
        Raises ``ValueError`` for a bad schema, regex or grammar, or an engine without a tokenizer."""
        if params.structured_outputs is None:
            return [None] * params.n
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        with self._grammar_lock:  # prepare_request runs in worker threads: one compiler (and llguidance tokenizer)
            if self._grammar_compiler is None:
                compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
                compiler.prepare()  # kept only once built: a failed build is tried again, under the lock
                self._grammar_compiler = compiler
        return [self._grammar_compiler.matcher(params.structured_outputs) for _ in range(params.n)]

    def _check_request_id(self, request_id: str, n: int) -> None:
        """The one request-id uniqueness check (the scheduler and the async front rely on it).

        The id, and the child ids of a parallel-sampling request, must not be in flight.
        """
        ids = [request_id] if n == 1 else [request_id, *(child_request_id(i, request_id) for i in range(n))]
        if any(i in self._parents or i in self.scheduler.requests for i in ids):
            raise ValueError(f"request_id must be unique among unfinished requests, got {request_id!r}")

    def _add(self, request: Request) -> None:
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)

    def _prompt_tokens(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None) -> tuple[str | None, list[int]]:
        if prompt is None and prompt_token_ids is None:
            raise ValueError("pass prompt or prompt_token_ids")
        text: str | None = None
        ids: list[int] | None = prompt_token_ids if prompt is None else None
        if prompt_token_ids is not None and prompt is not None:  # vLLM TokensPrompt's "prompt": the ids' text
            if not isinstance(prompt, str):
                raise ValueError(f"with prompt_token_ids, prompt must be their text (a string), got {prompt!r}")
            text, ids = prompt, prompt_token_ids
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif prompt is not None:
            ids = prompt
        vocab = self.model.config.vocab_size
        if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {ids!r}")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad[0]}")
        return text, list(ids)

    def embed(self, request_id: str, prompt: str | list[int] | None = None, pooling_params: PoolingParams | None = None,
              *, prompt_token_ids: list[int] | None = None) -> EmbeddingRequestOutput:
        """The embedding of ``prompt`` (text or token ids) or ``prompt_token_ids``, computed now (every chunk of
        :meth:`embedding_job`). Call it between steps, from the thread that steps. Raises as that."""
        job = self.embedding_job(request_id, prompt, pooling_params, prompt_token_ids=prompt_token_ids)
        while not job.step():
            pass
        return job.output()

    def embedding_job(self, request_id: str, prompt: str | list[int] | None = None,
                      pooling_params: PoolingParams | None = None, *, prompt_token_ids: list[int] | None = None
                      ) -> EmbeddingJob:
        """A checked :class:`EmbeddingJob` for the prompt: pooled by ``self.pooling_type``, run in chunks of
        ``max_num_batched_tokens`` (:mod:`kvgen.engine.pooling`), after ``truncate_prompt_tokens`` (vLLM's). Raises
        ``ValueError`` for a bad prompt, one longer than ``max_model_len``, ``truncate_prompt_tokens`` above it, or
        ``dimensions`` over the hidden size."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        _, ids = self._prompt_tokens(prompt, prompt_token_ids)
        ids = self._truncated(ids, params.truncate_prompt_tokens)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_model_len ({self.max_model_len})")
        return EmbeddingJob(self.model, request_id, ids, self.pooling_type, params,
                            self.engine_args.max_num_batched_tokens)

    def _check_request(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Checks that need the engine; fills ``max_tokens`` None with the room left in the context and
        ``bad_words_token_ids`` from ``bad_words``."""
        vocab = self.model.config.vocab_size
        for what, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias keys", params.logit_bias)):
            if ids is not None and (bad := [t for t in ids if t >= vocab]):  # vLLM refuses both
                raise ValueError(f"{what} must be token ids in [0, {vocab}), got {bad[0]}")
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        if params.best_of is not None and params.best_of > params.n:
            raise ValueError(f"best_of > n is not supported by the engine, got best_of={params.best_of}, n={params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = asked = getattr(params, name)
            if value == -1:  # the whole vocabulary (as vLLM)
                value = vocab
            if value is not None and value > vocab:  # a step's top-k would fail past the vocabulary
                raise ValueError(f"{name} must be <= the vocabulary size ({vocab}), got {asked}")
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.engine_args.max_logprobs}), got {asked}")
            if value != asked:
                params = dataclasses.replace(params, **{name: value})
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens leaves no room to generate within max_model_len ({self.max_model_len})")
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens must be <= {room} (max_model_len {self.max_model_len} - prompt of {num_prompt_tokens} tokens), "
                f"got {params.max_tokens}"
            )
        return params

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word tokenized as is and, where that gives a new first token of the same length, after a space (a
        word inside text). Source: vLLM ``SamplingParams.update_from_tokenizer``. ``ValueError`` without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this engine has none")
        out: list[list[int]] = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return [ids for ids in out if ids]

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests (an ``n > 1`` id aborts every child); their blocks are freed at the next step.

        Unknown or finished ids are ignored. Safe to call while a step runs in another thread.
        """
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self._parents.get(rid)
            for child_id in parent.child_ids if parent is not None else [rid]:
                self.scheduler.abort_request(child_id)

    def forget_aborted(self, request_id: str) -> None:
        """If an abort of ``request_id`` (every child of an ``n > 1`` one) is pending, finish it now with no output
        and free its blocks, so a new request may take the id at once, as vLLM's (its ``OutputProcessor`` forgets an
        aborted request when asked). Call between steps; otherwise does nothing."""
        parent = self._parents.get(request_id)
        child_ids = parent.child_ids if parent is not None else [request_id]
        if not any(self.scheduler.is_abort_pending(i) for i in child_ids):
            return
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort_requests(child_ids)
        if parent is not None:
            del self._parents[request_id]
            for child_id in child_ids:
                self._child_to_parent.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every prefix-cached KV block, so no later request reuses them (as after new weights, or between
        benchmark runs). Returns False, changing nothing, while running requests hold blocks; with
        ``reset_running_requests`` they are preempted first (recomputed later, their outputs unchanged) and it returns
        True. Call between steps. Raises ``ValueError`` for a ``reset_running_requests`` that is no bool.
        Source: vLLM v1 ``LLMEngine.reset_prefix_cache`` / ``Scheduler.reset_prefix_cache``."""
        if not isinstance(reset_running_requests, bool):
            raise ValueError(f"reset_running_requests must be a bool, got {reset_running_requests!r}")
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def get_stats(self) -> SchedulerStats:
        """Queue lengths and KV pool use now; safe to call while a step runs in another thread."""
        bm = self.block_manager
        num_free = bm.num_free_blocks
        return SchedulerStats(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            kv_cache_usage=1.0 - num_free / bm.num_blocks,
            num_free_blocks=num_free,
            num_blocks=bm.num_blocks,
            num_draft_tokens=None if self.scheduler.proposer is None else self.scheduler.num_draft_tokens,
            num_accepted_tokens=None if self.scheduler.proposer is None else self.scheduler.num_accepted_tokens,
        )

    # ------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs due (per ``SamplingParams.output_kind``)."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.stopped_request_ids:
            self.scheduler.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)
        processed.iteration_stats.num_preempted_reqs = len(scheduler_output.preempted_request_ids)
        if (core_outputs or scheduler_output.preempted_request_ids) and self.stat_loggers:
            self._observe_finished(processed.iteration_stats)
            for stat_logger in self.stat_loggers:
                stat_logger(processed.iteration_stats)
        return self._merge_children(processed.request_outputs)

    def _observe_finished(self, stats: IterationStats) -> None:
        """``n`` and the longest completion of each user request done this step: an ``n > 1`` parent once its last
        child finished (vLLM ``ParentRequest.observe_finished_request``)."""
        for finished in stats.finished_requests:
            entry = self._child_to_parent.get(finished.request_id)
            if entry is None:
                stats.n_params.append(1)
                stats.max_num_generation_tokens.append(finished.num_generation_tokens)
                continue
            parent = entry[0]
            parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, finished.num_generation_tokens)
            parent.num_observed += 1
            if parent.num_observed == parent.n:
                stats.n_params.append(parent.n)
                stats.max_num_generation_tokens.append(parent.max_num_generation_tokens)

    def _merge_children(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace the outputs of ``n > 1`` children by one output per parent (after the others)."""
        if not self._parents:
            return outputs
        result: list[RequestOutput] = []
        groups: dict[str, list[tuple[int, RequestOutput]]] = {}
        for output in outputs:
            entry = self._child_to_parent.get(output.request_id)
            if entry is None:
                result.append(output)
            else:
                groups.setdefault(entry[0].request_id, []).append((entry[1], output))
        for parent_id, child_outputs in groups.items():
            parent = self._parents[parent_id]
            parent_output = parent.merge(child_outputs)
            if parent.is_finished:
                del self._parents[parent_id]
                for child_id in parent.child_ids:
                    self._child_to_parent.pop(child_id, None)
            if parent_output is not None:
                result.append(parent_output)
        return result


def _fit_pool(max_model_len: int, args: EngineArgs, num_blocks: int) -> int:
    """``max_model_len`` within the KV pool's ``num_blocks * block_size`` tokens: a request longer than the pool could
    never run (vLLM refuses such an engine). An explicit ``EngineArgs.max_model_len`` past it is a ``ValueError``
    naming the settings; the default (the model's context) shrinks to the pool."""
    pool_tokens = num_blocks * args.block_size
    if max_model_len <= pool_tokens:
        return max_model_len
    if args.max_model_len is not None:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the KV cache pool of {pool_tokens} tokens "
                         f"({num_blocks} blocks of {args.block_size}): lower max_model_len or raise num_blocks / "
                         "kv_cache_memory")
    return pool_tokens


def _make_pool(config: ModelConfig, args: EngineArgs, num_blocks: int, dtype: torch.dtype) -> PagedKVCache:
    """The paged KV pool. Raises ``ValueError`` naming ``num_blocks`` or ``kv_cache_memory`` and its value when the
    system cannot map the pool (``kv_cache.pool.PoolMappingError``: more bytes than the memory, or than an address
    holds)."""
    try:
        return PagedKVCache.from_config(config, args.block_size, num_blocks=num_blocks, dtype=dtype)
    except PoolMappingError as e:  # other errors of the pool stand as raised
        given = (f"num_blocks={args.num_blocks}" if args.num_blocks is not None
                 else f"kv_cache_memory={args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY}")
        raise ValueError(f"{given}: the KV cache pool of {num_blocks} blocks of {args.block_size} tokens does not fit "
                         f"in memory ({e}); lower num_blocks / kv_cache_memory") from None


def split_prompt(item: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt: text, token ids, or vLLM's ``TextPrompt`` / ``TokensPrompt`` dict (a
    ``TokensPrompt``'s optional ``prompt`` is its ids' text). Raises ``ValueError`` for a dict with neither key."""
    if isinstance(item, str):
        return item, None
    if isinstance(item, dict):
        if "prompt_token_ids" in item:
            return item.get("prompt"), item["prompt_token_ids"]
        if "prompt" in item:
            return item["prompt"], None
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(item)}")
    return None, item
