"""``AsyncLLMEngine``: asyncio streaming on top of ``LLMEngine``.

One background task runs the step loop; each blocking ``step()`` runs in one
dedicated worker thread so the event loop keeps serving while the model computes
(always the same thread: the kernels' OpenMP team is per calling thread, and
``asyncio.to_thread``'s pool alternated between two teams, 2-3 % slower per
token at concurrency 1). Requests are added only between steps (an ``asyncio.Lock`` held around
each step), so the scheduler is never touched by two threads at once. A consumer
that stops iterating (``break``, cancellation, a disconnect) aborts its request;
the scheduler frees its blocks at the next step.
Source: vLLM ``AsyncLLMEngine`` / v1 ``AsyncLLM`` (``generate`` as an async generator).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Awaitable, Generator
from typing import Any

from kvgen.engine.engine_args import EngineArgs
from kvgen.engine.llm_engine import LLMEngine, split_prompt
from kvgen.engine.outputs import RequestOutput
from kvgen.engine.pooling import EmbeddingRequestOutput, PoolingParams
from kvgen.engine.sampling_params import SamplingParams
from kvgen.tokenizer import Tokenizer


class EngineStoppedError(RuntimeError):
    """The engine was told to stop (:meth:`AsyncLLMEngine.abort_all`) while an embedding was being computed or a
    request was being added."""


class AsyncLLMEngine:
    """Streams ``RequestOutput``s per request. ``step_in_thread=False`` runs steps on the event loop."""

    def __init__(self, engine: LLMEngine, step_in_thread: bool = True) -> None:
        self.engine = engine
        self.step_in_thread = step_in_thread
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Made anew in _start for each event loop that runs the step loop.
        self._lock = asyncio.Lock()
        self._has_work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._step_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgen-step")
        self._is_stopping = False  # set by abort_all: embeddings stop at their next chunk

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, step_in_thread: bool = True) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(engine_args), step_in_thread)

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._lock, self._has_work = asyncio.Lock(), asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams | None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request now and return its output stream (iterate it, then ``aclose`` it).

        ``prompt``: text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``. Raises ``ValueError``
        here, before any output, for an invalid request (see ``LLMEngine.add_request``), and ``EngineStoppedError``
        once :meth:`abort_all` has run (a server shutting down).
        """
        self._start()
        text, ids = split_prompt(prompt)  # a {"prompt": ...} dict raised KeyError, a TokensPrompt's text was dropped
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # checked, tokenized and its grammars compiled in a worker thread, outside the lock: a slow one (a long
        # regex compiles for seconds) stalls neither the event loop nor the steps of other requests
        prepared = await asyncio.to_thread(self.engine.prepare_request, request_id, text, sampling_params,
                                           prompt_token_ids=ids, priority=priority)
        async with self._lock:
            if self._is_stopping:  # abort_all ran while it was prepared: it would run on past the shutdown
                raise EngineStoppedError(f"request {request_id!r} not added: the server is shutting down")
            # LLMEngine.add_prepared is the one uniqueness check; a finished request's stream may still be
            # open here, and is replaced (it holds its final output already, see _close_stream).
            if request_id not in self._streams:  # a closed stream's request, its abort pending: the id is free
                self.engine.forget_aborted(request_id)
            self.engine.add_prepared(prepared)
            self._streams[request_id] = queue
        self._has_work.set()
        return RequestStream(self, request_id, queue)

    async def generate(
        self,
        prompt: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come (per ``output_kind``), the last one ``finished``.

        Raises ``ValueError`` from ``LLMEngine.add_request`` before the first output for an
        invalid request. Leaving the loop early aborts the request.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def embed(self, request_id: str, prompt: str | list[int], pooling_params: PoolingParams | None
                    ) -> EmbeddingRequestOutput:
        """``LLMEngine.embedding_job``'s chunks, each between two steps in the step thread (the model never runs in
        two threads at once; generation goes on between the chunks of a long prompt). Raises its ``ValueError``."""
        self._start()
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        # tokenized in a worker thread without the lock (it reads nothing a step changes): a long input stalls
        # neither the event loop nor the steps
        job = await asyncio.to_thread(self.engine.embedding_job, request_id, text, pooling_params,
                                      prompt_token_ids=ids)
        while True:
            async with self._lock:
                done = (await asyncio.get_running_loop().run_in_executor(self._step_thread, job.step)
                        if self.step_in_thread else job.step())
            if done:
                return job.output()
            if self._is_stopping:
                raise EngineStoppedError(f"embedding {request_id!r} stopped: the server is shutting down")
            await asyncio.sleep(0)  # the step loop, waiting on the lock, runs a step now

    def _close_stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException], is_finished: bool
    ) -> None:
        if self._streams.get(request_id) is not queue:
            return  # the engine finished it and a new request took the id: leave the new one alone
        del self._streams[request_id]
        if not is_finished:
            self.engine.abort_request(request_id)
            if self._has_work is not None:
                self._has_work.set()

    def abort_all(self) -> None:
        """Abort every request (their streams end with finish_reason "abort", as :meth:`abort`'s) and stop the
        embeddings in progress at their next chunk (``EngineStoppedError``): a server's shutdown past its grace."""
        self._is_stopping = True
        self.engine.abort_request(list(self._streams))
        self._has_work.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a finished output whose ``finish_reason`` is "abort"."""
        self.engine.abort_request(request_id)
        self._has_work.set()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """:meth:`LLMEngine.reset_prefix_cache` between two steps (vLLM ``AsyncLLM.reset_prefix_cache``); requests it
        preempts stream on unchanged."""
        self._start()  # this event loop's lock
        async with self._lock:
            return self.engine.reset_prefix_cache(reset_running_requests)

    async def _run_loop(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._has_work.clear()
                await self._has_work.wait()
            async with self._lock:
                try:
                    outputs = (await asyncio.get_running_loop().run_in_executor(self._step_thread, self.engine.step)
                               if self.step_in_thread else self.engine.step())
                except Exception as e:
                    # Fail every stream and abort its request, so the next step (the loop
                    # restarts with the next request) does not run into the same failure.
                    for queue in self._streams.values():
                        queue.put_nowait(e)
                    self.engine.abort_request(list(self._streams))
                    raise
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put_nowait(output)
            await asyncio.sleep(0)  # let consumers and add_request run between steps

    @property
    def is_failed(self) -> bool:
        """Whether the step loop died on an exception (it restarts with the next request)."""
        task = self._loop_task
        return task is not None and task.done() and not task.cancelled() and task.exception() is not None

    @property
    def is_running(self) -> bool:
        """vLLM ``AsyncLLM.is_running``: the step loop has not died (not started yet counts as running)."""
        return not self.is_failed

    @property
    def errored(self) -> bool:
        """vLLM ``AsyncLLM.errored``: the step loop died on an exception (:attr:`is_failed`)."""
        return self.is_failed

    @property
    def is_stopped(self) -> bool:
        """vLLM ``AsyncLLM.is_stopped``: :attr:`errored`."""
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        """vLLM ``AsyncLLM.dead_error``: the exception the step loop died on (a ``RuntimeError`` saying it has not
        died when :attr:`errored` is false)."""
        task = self._loop_task
        error = task.exception() if task is not None and self.is_failed else None
        return error if error is not None else RuntimeError("the engine's step loop has not died")

    async def check_health(self) -> None:
        """vLLM ``AsyncLLM.check_health``: raises :attr:`dead_error` if the step loop died, else returns."""
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self) -> Tokenizer | None:
        """vLLM ``AsyncLLM.get_tokenizer``: the engine's tokenizer (None for an engine of token ids only)."""
        return self.engine.get_tokenizer()

    def shutdown(self) -> Awaitable[Any]:
        """Stop the step loop now (unfinished requests stay in the engine): a plain call, as vLLM ``AsyncLLM``'s
        (an ``async def`` did nothing unless awaited); await what it returns to wait until the loop has ended."""
        task, self._loop_task = self._loop_task, None
        if task is None:
            return _Done()
        task.cancel()
        return asyncio.gather(task, return_exceptions=True)  # a future: no warning when the caller does not await it


class _Done:
    """An awaitable that is already done (``shutdown`` of an engine whose loop never started)."""

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield


class RequestStream:
    """One request's outputs, in order; ``aclose()`` before the last one aborts the request.

    Closing is idempotent and also works on a stream never iterated, so a caller that
    wraps the stream in ``try``/``finally: await stream.aclose()`` never leaks a request.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]):
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.is_finished = False
        self._is_closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished or self._is_closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        self.is_finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self.engine._close_stream(self.request_id, self._queue, self.is_finished)
