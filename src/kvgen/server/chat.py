"""``POST /v1/chat/completions``: messages through the model's chat template, then the engine.

Streaming sends, per choice, a first chunk with ``delta.role``, content chunks, and one
chunk with ``finish_reason``; then a usage chunk when ``stream_options.include_usage`` (with vLLM's
``continuous_usage_stats`` too, every chunk carries its choice's usage so far);
then ``data: [DONE]``. Stop strings never reach the client (the engine holds back text
that could still become one). Source: OpenAI API reference, Chat Completions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import Request

from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.errors import KvgenError
from kvgen.server.beam import new_generation
from kvgen.server.errors import bad_request, validation_error
from kvgen.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChoiceLogprobs,
    DeltaMessage,
    FinishReason,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    message_dicts,
)
from kvgen.server.reasoning_parsers import ReasoningSplitter, new_splitter
from kvgen.server.results import (
    ChoiceResult,
    StreamUsage,
    chat_logprobs,
    num_cached_tokens,
    openai_finish_reason,
    respond,
    sse,
    stream_events,
    usage,
)
from kvgen.server.serving import (
    Generation,
    ServerState,
    check_stream_options,
    resolve_max_tokens,
    sampling_params,
    truncated,
)
from kvgen.server.tool_parsers import TOOL_CALL_PARSERS, new_call_id
from kvgen.server.tools import (
    ToolPlan,
    tool_calls,
    tool_dicts,
    tool_plan,
)


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest, add_generation_prompt: bool | None = None,
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of the messages rendered by the chat template (with the generation prompt unless
    ``add_generation_prompt`` or the request says otherwise; vLLM's ``continue_final_message`` and
    ``chat_template_kwargs`` and ``documents`` as asked), and the tokenizer's special tokens on top where
    ``add_special_tokens`` (vLLM's, default false: the template writes them).

    Raises a 400 naming ``messages`` when the template fails or renders nothing.
    """
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true", "continue_final_message")
    if add_generation_prompt is None:
        add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
    tools = tool_dicts(req)
    content_format = state.tokenizer.chat_template_content_format(tools)  # vLLM's "auto"
    try:
        ids = state.tokenizer.apply_chat_template(
            message_dicts(req.messages, content_format), add_generation_prompt=add_generation_prompt,
            tokenize=not add_special_tokens, tools=tools, continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs, documents=req.documents,
        )
    except (KvgenError, ValueError) as e:
        raise bad_request(str(e).splitlines()[0], "messages") from None
    if isinstance(ids, str):  # the rendered text: tokenized with the special tokens
        ids = state.tokenizer.encode(ids, add_special_tokens=True)
    assert isinstance(ids, list)  # tokenize=True returns the ids
    if not ids:
        raise bad_request("the messages render to an empty prompt", "messages")
    return ids


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    """Validate, enqueue, then stream (SSE) or answer once. Raises ``OpenAIError`` (400/404/429/503)."""
    state.check_model(req.model)
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    plan = tool_plan(req, state.tool_call_parser)
    # rendered and tokenized in a worker thread, as vLLM's: a huge prompt must not stall the event loop (other streams)
    prompt_ids = truncated(state, await asyncio.to_thread(chat_prompt_ids, state, req), req.truncate_prompt_tokens)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(state, len(prompt_ids), requested, ("messages", field))
    params = sampling_params(req, state, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                             plan.constraint if plan else None)
    gen = new_generation(state, req, "chatcmpl", raw)
    await gen.start([prompt_ids], params, "messages", req.priority)

    def response(choices: list[ChoiceResult]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=gen.request_id, created=gen.created, model=state.model_name,
            usage=usage(len(prompt_ids), choices, num_cached_tokens(choices, req.n)),
            choices=[_choice(state, req, c, plan, prompt_tail) for c in choices],
        )

    prompt_tail = reasoning_prompt_tail(state, prompt_ids)
    deltas = ChatDeltas(state, req, plan, prompt_tail)
    stream = _stream(state, req, gen, len(prompt_ids), deltas) if req.stream else None
    return await respond(gen, raw, req.n, stream, response)


def _logprobs(state: ServerState, req: ChatCompletionRequest, token_ids: list[int], logprobs: list) -> ChoiceLogprobs | None:
    if not req.logprobs:
        return None
    return ChoiceLogprobs(content=chat_logprobs(state.tokenizer, token_ids, logprobs, req.top_logprobs or 0))


def _finish_reason(reason: str | None, plan: ToolPlan | None, calls: list[ToolCall] | None) -> FinishReason | None:
    """OpenAI's finish reason; "tool_calls" when a ``"required"`` or ``"auto"`` reply completed with calls (a named
    call stays "stop")."""
    if calls and plan is not None and plan.function is None and reason == "stop":
        return "tool_calls"
    return openai_finish_reason(reason)


def messages_prompt_ids(state: ServerState, messages: list[Any], chat_fields: dict[str, Any],
                        add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``messages`` as a chat request with ``chat_fields`` would render them (vLLM's ``/tokenize`` and
    ``EmbeddingChatRequest`` messages). Raises a 400 naming a field a chat request refuses, or as
    :func:`chat_prompt_ids`."""
    try:
        request = ChatCompletionRequest(model=state.model_name, messages=messages, **chat_fields)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    return chat_prompt_ids(state, request, add_special_tokens=add_special_tokens)


def reply_parts(plan: ToolPlan | None, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool calls) of a finished reply: the text alone without calls; with calls, ``"auto"`` keeps the text
    before them, forced calls have none."""
    if plan is not None and plan.parser is not None:
        content, found = TOOL_CALL_PARSERS[plan.parser].extract(text)
        return content, found or None
    calls = tool_calls(plan, text) if plan is not None else None
    return (None, calls) if calls else (text, None)


def reasoning_prompt_tail(state: ServerState, prompt_ids: list[int]) -> str:
    """The text of the prompt's last tokens, where a template that opens the reasoning writes ``<think>``; "" without
    a reasoning parser."""
    return state.tokenizer.decode(prompt_ids[-_NUM_TAIL_TOKENS:]) if state.reasoning_parser else ""


_NUM_TAIL_TOKENS = 32  # "<think>\n\n</think>\n\n" (thinking disabled) fits, even in byte-level tokens


def split_reasoning(state: ServerState, text: str, prompt_tail: str = "") -> tuple[str | None, str]:
    """(reasoning, the rest) of a finished reply under the server's reasoning parser; (None, text) without one."""
    return new_splitter(state.reasoning_parser, prompt_tail).split(text) if state.reasoning_parser else (None, text)


def _choice(state: ServerState, req: ChatCompletionRequest, c: ChoiceResult, plan: ToolPlan | None,
            prompt_tail: str) -> ChatCompletionChoice:
    reasoning, text = split_reasoning(state, c.text, prompt_tail)
    content, calls = reply_parts(plan, text)
    if reasoning is not None and not content:  # all reasoning: null content, as vLLM's parsers (``content or None``)
        content = None
    return ChatCompletionChoice(
        index=c.index, message=ChatCompletionMessage(content=content, tool_calls=calls, reasoning=reasoning),
        logprobs=_logprobs(state, req, c.token_ids, c.logprobs), finish_reason=_finish_reason(c.finish_reason, plan, calls),
        stop_reason=c.stop_reason,
    )


class ChatDeltas:
    """The stream deltas of a chat completion's choices, what ``_stream`` sends as chunks (and ``/v1/responses`` as
    events). A named tool call streams its arguments as ``delta.tool_calls[0].function.arguments``; the calls of
    ``"required"`` and ``"auto"`` come whole in the deltas before the finish (the text must be complete to parse);
    ``"auto"`` streams its content as written, holding back only what may start a call."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, plan: ToolPlan | None,
                 prompt_tail: str = "") -> None:
        self.state, self.req, self.plan, self.prompt_tail = state, req, plan, prompt_tail
        self.pending: dict[int, str] = {}  # "required" / "auto": each choice's text so far
        self.pending_logprobs: dict[int, tuple[list[int], list]] = {}  # and its token ids and logprobs
        self.num_sent: dict[int, int] = {}  # "auto": characters of it already streamed as content
        self.is_buffered = plan is not None and plan.function is None
        self.parser = TOOL_CALL_PARSERS[plan.parser] if plan is not None and plan.parser is not None else None
        self.splitters: dict[int, ReasoningSplitter] = {}  # each choice's reasoning split (--reasoning-parser)

    def opening(self, index: int) -> ChatCompletionStreamChoice:
        """A choice's first delta: the role, and a named call's id and name (its arguments follow)."""
        if self.plan is not None and self.plan.function is not None:
            call = ToolCallDelta(index=0, id=new_call_id(), type="function",
                                 function=FunctionCallDelta(name=self.plan.function, arguments=""))
            return ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", tool_calls=[call]))
        return ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))

    def __call__(self, c: CompletionOutput) -> Iterator[ChatCompletionStreamChoice]:
        """The deltas of one engine output of choice ``c.index``; the last carries the finish reason. With a reasoning
        parser, the reasoning comes as ``delta.reasoning`` and only the rest goes on as the text below."""
        parser = self.state.reasoning_parser
        if parser:
            splitter = self.splitters.setdefault(c.index, new_splitter(parser, self.prompt_tail))
            reasoning, rest = splitter.feed(c.text)
            if c.finish_reason is not None:
                more_reasoning, more_rest = splitter.finish()
                reasoning, rest = reasoning + more_reasoning, rest + more_rest
            if reasoning:
                yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(reasoning=reasoning))
            c = dataclasses.replace(c, text=rest)
        req, plan = self.req, self.plan
        if self.is_buffered:
            text = self.pending[c.index] = self.pending.get(c.index, "") + c.text
            if req.logprobs:  # sent with the finish chunk (the text is held back until then)
                ids, lps = self.pending_logprobs.setdefault(c.index, ([], []))
                ids += c.token_ids
                lps += c.logprobs or []
            sent = self.num_sent.get(c.index, 0)
            ready = self.parser.num_streamable(text) if self.parser is not None else 0
            if c.finish_reason is None and ready > sent:
                self.num_sent[c.index] = ready
                yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=text[sent:ready]))
        elif c.text or (req.logprobs and c.token_ids):
            lp = _logprobs(self.state, req, c.token_ids, c.logprobs or [])
            delta = DeltaMessage(content=c.text) if plan is None else DeltaMessage(
                tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=c.text))])
            yield ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=lp)
        if c.finish_reason is None:
            return
        calls = None
        if self.is_buffered:
            content, calls = reply_parts(plan, self.pending.pop(c.index, ""))
            content = (content or "")[self.num_sent.pop(c.index, 0) :]  # streamed content is a start of the final one
            if content:
                yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=content))
            if calls:
                yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(tool_calls=[
                    ToolCallDelta(index=i, id=call.id, type="function",
                                  function=FunctionCallDelta(name=call.function.name, arguments=call.function.arguments))
                    for i, call in enumerate(calls)]))
        reason = _finish_reason(c.finish_reason, plan, calls)
        held = self.pending_logprobs.pop(c.index, None)
        lp = None if held is None else _logprobs(self.state, req, *held)
        yield ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(), logprobs=lp, finish_reason=reason,
                                         stop_reason=c.stop_reason)


def _stream(state: ServerState, req: ChatCompletionRequest, gen: Generation, num_prompt_tokens: int,
            deltas: ChatDeltas) -> AsyncIterator[str]:
    """SSE chunks: each choice's opening, its deltas (:class:`ChatDeltas`), the usage chunk when asked."""
    stream_usage = StreamUsage(req.stream_options, [num_prompt_tokens], req.n)

    def chunk(choices: list[ChatCompletionStreamChoice], **fields: Any) -> str:
        data = ChatCompletionChunk(id=gen.request_id, created=gen.created, model=state.model_name, choices=choices,
                                   **fields)
        return sse(stream_usage.chunk_dict(data))

    def events(prompt_index: int, c: CompletionOutput, output: RequestOutput) -> Iterator[str]:
        stream_usage.count(prompt_index, c, output)
        return (chunk([choice]) for choice in deltas(c))

    first = (chunk([deltas.opening(i)]) for i in range(req.n))
    final = stream_usage.final_chunk(chunk)
    return stream_events(gen, first, events, final)
