"""What the chat and completion endpoints share: request checks, ``SamplingParams``, admission
(the bounded queue), and ``Generation``: the engine requests of one HTTP request.

Handlers only enqueue into ``AsyncLLMEngine`` and read its streams; the engine's step loop
runs on its own. A ``Generation`` always ends in ``close()``, which aborts whatever is
unfinished (so a client that leaves frees its KV blocks at the next engine step).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from kvgen.engine.async_engine import AsyncLLMEngine, EngineStoppedError, RequestStream
from kvgen.engine.outputs import RequestOutput
from kvgen.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    truncate_prompt,
)
from kvgen.server.errors import OpenAIError, bad_request
from kvgen.server.metrics import RequestTracker, ServerMetrics
from kvgen.server.protocol import SamplingFields
from kvgen.server.response_store import ResponseStore
from kvgen.tokenizer import Tokenizer

T = TypeVar("T")

_SAMPLING_FIELDS = set(SamplingFields.model_fields) | {"max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}


@dataclass
class ServerState:
    """Everything a handler needs; built once by ``build_app``."""

    engine: AsyncLLMEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int  # tokens, prompt + output
    max_num_seqs: int  # sequences the engine runs at once
    max_queue: int  # sequences allowed to wait beyond max_num_seqs before 429
    metrics: ServerMetrics
    api_key: str | None = None
    tool_call_parser: str | None = None  # "hermes": tool_choice "auto" allowed, calls parsed from the text
    reasoning_parser: str | None = None  # "deepseek_r1" | "qwen3": <think> text goes to the reasoning fields
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored /v1/responses results
    # sampling defaults for unset request fields (the model's generation_config.json; SamplingParams names)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # every name requests may use (vLLM's several --served-model-name); model_name, the first, is the one reported
    model_names: tuple[str, ...] = ()

    def check_model(self, name: str | None) -> None:
        """Raises a 404 ``OpenAIError`` unless ``name`` is a name of the served model (None = any)."""
        if name is not None and name != self.model_name and name not in self.model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


def client_request_id(raw: Request | None) -> str:
    """The client's ``X-Request-Id`` header ("" without one)."""
    return raw.headers.get("x-request-id", "").strip() if raw is not None else ""


def new_request_id(prefix: str, raw: Request | None = None) -> str:
    """``prefix-<the client's X-Request-Id header>`` when it sent one, else ``prefix-<random hex>`` (vLLM's
    ``_base_request_id``: a gateway's id names the response and the server's log lines)."""
    return f"{prefix}-{client_request_id(raw) or uuid.uuid4().hex}"


def sampling_params(req: SamplingFields, state: ServerState, max_tokens: int | None, logprobs: int | None,
                    constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """OpenAI fields -> ``SamplingParams`` (DELTA outputs); a field the request leaves unset takes the model's
    default (``state.default_sampling``), else vLLM's; ``constraint`` (a tool call's) replaces the request's own
    structured outputs. Raises a 400 naming the field."""
    tokenizer, defaults = state.tokenizer, state.default_sampling

    def pick(value: Any, name: str, fallback: Any) -> Any:
        return value if value is not None else defaults.get(name, fallback)

    bias = None
    if req.logit_bias:
        if bad_keys := [k for k in req.logit_bias if not (k.isascii() and k.isdigit())]:  # int() takes " 1", "1_0"
            raise bad_request(f"logit_bias keys must be token ids in decimal digits, got {bad_keys[0]!r}", "logit_bias")
        num_digits = len(str(tokenizer.vocab_size))  # a longer key is out of range, and int() refuses > 4300 digits
        if long_keys := [k for k in req.logit_bias if len(k.lstrip("0")) > num_digits]:
            raise bad_request(f"logit_bias token ids must be in [0, {tokenizer.vocab_size}), got one of "
                              f"{len(long_keys[0].lstrip('0'))} digits", "logit_bias")
        bias = {int(k.lstrip("0") or "0"): v for k, v in req.logit_bias.items()}
        bad = [t for t in bias if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"logit_bias token ids must be in [0, {tokenizer.vocab_size}), got {bad[0]}", "logit_bias")
    if bad := [t for t in req.stop_token_ids or () if not 0 <= t < tokenizer.vocab_size]:
        raise bad_request(f"stop_token_ids must be in [0, {tokenizer.vocab_size}), got {bad[0]}", "stop_token_ids")
    try:
        return SamplingParams(
            n=req.n, temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
            top_k=pick(req.top_k, "top_k", 0), min_p=pick(req.min_p, "min_p", 0.0),
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, stop=req.stop, max_tokens=max_tokens, min_tokens=req.min_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            ignore_eos=req.ignore_eos, logprobs=logprobs, logit_bias=bias, output_kind=RequestOutputKind.DELTA,
            stop_token_ids=req.stop_token_ids, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            structured_outputs=constraint or structured_outputs(req),
        )
    except ValueError as e:
        raise value_error(e, None) from None


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as the engine's constraint; 400 for both, or a
    ``json_schema`` format without its schema."""
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise bad_request("pass response_format or structured_outputs, not both", "structured_outputs")
    if extra is not None:
        return StructuredOutputsParams(json=extra.json_, regex=extra.regex, choice=extra.choice, grammar=extra.grammar,
                                       json_object=extra.json_object)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema is required when type is 'json_schema'", "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)


def value_error(e: ValueError, default_param: str | None) -> OpenAIError:
    """A 400 from an engine ``ValueError``, whose message starts with the field it names (or a part of it:
    ``structured_outputs.regex`` names structured_outputs)."""
    first = str(e).split(" ", 1)[0].split(".", 1)[0]
    return bad_request(str(e), first if first in _SAMPLING_FIELDS else default_param)


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def truncated(state: ServerState, prompt_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
    """The prompt ids a request's ``truncate_prompt_tokens`` keeps (vLLM's extra), before any length check."""
    return truncate_prompt(prompt_ids, truncate_prompt_tokens, state.max_model_len)


def resolve_max_tokens(state: ServerState, num_prompt_tokens: int, max_tokens: int | None, params: tuple[str, str]) -> int:
    """``max_tokens`` checked against the context and the KV pool; None -> all the room left; then capped at the
    model's ``max_new_tokens`` default where it has one (as vLLM).

    ``params``: (the prompt's field name, the max-tokens field name) for error messages.
    """
    engine = state.engine.engine
    pool_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    limit = min(state.max_model_len, pool_tokens)
    room = limit - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for a completion.", params[0])
    cap = state.default_sampling.get("max_tokens") or room
    if max_tokens is None:
        return min(room, cap)
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or {params[1]}.", params[1])
    return min(max_tokens, cap)


class Generation:
    """The engine requests (one per prompt) of one HTTP request, read as one stream.

    ``start`` admits and queues them (400 for an invalid request, 429 when the queue is
    full); ``outputs`` yields ``(prompt index, RequestOutput)`` in arrival order;
    ``close`` aborts anything unfinished and records metrics. Always ``close``.
    """

    def __init__(self, state: ServerState, request_id: str, is_client_id: bool = False) -> None:
        self.state, self.request_id = state, request_id
        # the engine's ids: the response id, made unique when it holds the client's X-Request-Id (sent twice at once)
        self.engine_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if is_client_id else request_id
        self.created = int(time.time())  # the response's and every chunk's "created" (OpenAI: the same in a stream)
        self.streams: list[RequestStream] = []
        self.trackers: list[RequestTracker] = []
        self.num_prompts = 0
        self._num_admitted = 0
        self._is_closed = False

    def admit(self, num_seqs: int) -> None:
        """Take ``num_seqs`` admission slots: a 400 beyond the server's capacity, a 429 when the queue is full."""
        state = self.state
        capacity = state.max_num_seqs + state.max_queue
        if num_seqs > capacity:
            raise bad_request(f"this request needs {num_seqs} sequences (prompts x n); the server takes {capacity}", "n")
        if state.metrics.num_in_server + num_seqs > capacity:
            raise OpenAIError(429, f"the server's queue is full ({state.max_queue} waiting); retry later",
                              None, "rate_limit_exceeded")
        state.metrics.num_in_server += num_seqs
        self._num_admitted = num_seqs

    async def start(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str, priority: int = 0
                    ) -> None:
        state = self.state
        self.admit(len(prompts) * params.n)
        self.num_prompts = len(prompts)
        for i, ids in enumerate(prompts):
            engine_id = self.engine_request_id if len(prompts) == 1 else f"{self.engine_request_id}-{i}"
            try:
                stream = await state.engine.add_request(engine_id, {"prompt_token_ids": ids}, params, priority)
            except ValueError as e:
                await self.close()
                raise value_error(e, prompt_param) from None
            except EngineStoppedError as e:  # the shutdown's abort_all came while it was being added
                await self.close()
                raise OpenAIError(503, f"the request was aborted by the server: {e}", None, "aborted") from None
            except BaseException:  # the admission and the requests added so far go back whatever failed
                await self.close()
                raise
            self.streams.append(stream)
            self.trackers.append(RequestTracker(state.metrics, engine_id))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:
            async for output in self.streams[0]:
                self.trackers[0].on_output(output)
                yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.streams))]
        try:
            num_done = 0
            while num_done < len(tasks):
                index, item = await queue.get()
                if item is None:
                    num_done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        try:
            async for output in self.streams[index]:
                self.trackers[index].on_output(output)
                queue.put_nowait((index, output))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    async def close(self) -> None:
        """Abort what is unfinished, free the admission slots, log each request. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self.state.metrics.num_in_server -= self._num_admitted
        for stream, tracker in zip(self.streams, self.trackers, strict=True):
            is_aborted = not stream.is_finished
            await stream.aclose()
            tracker.finish(is_aborted)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
