"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{response_id}``, ``GET .../input_items``: OpenAI's
Responses API.

A request becomes a chat completion (instructions as the system message, a previous response's
conversation, then the input items, through the chat template) and shares its sampling, tool calls,
structured outputs and streaming deltas (:class:`kvgen.server.chat.ChatDeltas`); only the shapes
differ: output items (``message`` with ``output_text``, ``function_call``) instead of choices, and
named, numbered stream events (``response.created`` ... ``response.completed``, no ``[DONE]``).
A stored response (``store``, the default) is kept in memory, the oldest dropped past
``ResponseStore.capacity``, and can be read, deleted, or continued with ``previous_response_id``
(its instructions are not carried over, as OpenAI); its input items (the kept conversation before its output,
a previous response's included, as OpenAI lists the items a response was generated from) are listed in pages.
Source: OpenAI API reference, Responses and "Streaming events"; vLLM ``serving_responses.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import Request

from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.server.chat import ChatDeltas, chat_prompt_ids, reasoning_prompt_tail, reply_parts, split_reasoning
from kvgen.server.errors import OpenAIError, bad_request
from kvgen.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextContentPart,
    ToolCall,
)
from kvgen.server.reasoning_parsers import num_reasoning_tokens
from kvgen.server.response_store import StoredResponse
from kvgen.server.responses_protocol import (
    INCLUDABLE,
    LOGPROBS_INCLUDE,
    FunctionCallItem,
    FunctionCallOutputResource,
    FunctionToolChoice,
    IncompleteDetails,
    InputMessageResource,
    InputText,
    InputTextPart,
    InputTokensDetails,
    ItemStatus,
    ListedItem,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from kvgen.server.results import ChoiceResult, chat_logprobs, respond, stream_events
from kvgen.server.serving import (
    Generation,
    ServerState,
    resolve_max_tokens,
    sampling_params,
)
from kvgen.server.tools import ToolPlan, tool_plan

# chat-side parameter names as the Responses API calls them, for error bodies
_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field kvgen cannot honour."""
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning is not supported with this model", "reasoning")
    if req.conversation is not None:
        raise bad_request("conversations are not supported; pass previous_response_id", "conversation")
    if req.prompt is not None:
        raise bad_request("prompt templates are not supported", "prompt")
    unknown = [v for v in req.include or [] if v != LOGPROBS_INCLUDE]
    if unknown:
        raise bad_request(f"include supports only {LOGPROBS_INCLUDE!r}, got {unknown[0]!r}", "include")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _content(content: str | list[InputTextPart]) -> str | list[TextContentPart]:
    """An item's text, or its parts as chat's text parts: the template takes them as chat's (joined with newlines, or
    a list), as vLLM's Responses API hands them to ``parse_chat_messages``."""
    return content if isinstance(content, str) else [TextContentPart(type="text", text=p.text) for p in content]


def _input_messages(items: str | list[Any]) -> tuple[list[ChatMessage], list[list[ListedItem]]]:
    """Input items as chat messages, and for each message the items it came from (listed, with ids): function calls
    join the assistant turn before them, their outputs are tool turns, a reasoning item's text goes to the assistant
    turn after it (a reasoning item is listed with the turn after it, or the last)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)], [[_listed_item(MessageItem(role="user", content=items))]]
    out: list[ChatMessage] = []
    turns: list[list[ListedItem]] = []
    reasoning: str | None = None
    pending: list[ListedItem] = []  # reasoning items, listed with the turn after them
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or [])
            pending.append(_listed_item(item))
            continue
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=_content(item.content),
                                   reasoning=reasoning if item.role == "assistant" else None))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and reasoning is None:
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call], reasoning=reasoning))
        else:
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_content(item.output)))
        if len(turns) < len(out):
            turns.append(pending)
        turns[-1].append(_listed_item(item))
        reasoning, pending = None, []
    if turns:
        turns[-1] += pending  # reasoning items after the last turn
    return out, turns


def _refuse_duplicate_ids(turns: list[list[ListedItem]]) -> None:
    """A 400 naming ``input`` for an item id given twice (a previous response's output items sent back with its
    ``previous_response_id``, or one id on two input items), in OpenAI's words (its 400 quoted in
    openai/openai-agents-python#1789); ``input_items`` pages by id."""
    seen: set[str] = set()
    for item in (item for turn in turns for item in turn):
        if item.id in seen:
            raise bad_request(f"Duplicate item found with id {item.id}. Remove duplicate items from your input and "
                              f"try again.", "input")
        seen.add(item.id)


def _listed_item(item: Any) -> ListedItem:
    """An input item as ``input_items`` lists it: its id (a new one if it has none) and status (completed unless it
    says otherwise); an assistant message, a function call or a reasoning item in its output item's shape."""
    status: ItemStatus = item.status if item.status in ("in_progress", "completed", "incomplete") else "completed"
    if isinstance(item, MessageItem):
        texts = [item.content] if isinstance(item.content, str) else [part.text for part in item.content]
        if item.role == "assistant":
            return OutputMessage(id=item.id or _new_id("msg"), status=status,
                                 content=[OutputText(text=text) for text in texts])
        return InputMessageResource(id=item.id or _new_id("msg"), role=item.role, status=status,
                                    content=[InputText(text=text) for text in texts])
    if isinstance(item, FunctionCallItem):
        return OutputFunctionCall(id=item.id or _new_id("fc"), call_id=item.call_id, name=item.name,
                                  arguments=item.arguments, status=status)
    if isinstance(item, ReasoningItem):
        return OutputReasoning(id=item.id or _new_id("rs"), summary=item.summary, content=item.content or [],
                               status=status)
    output = item.output if isinstance(item.output, str) else [InputText(text=part.text) for part in item.output]
    return FunctionCallOutputResource(id=item.id or _new_id("fco"), call_id=item.call_id, output=output, status=status)


def list_input_items(state: ServerState, response_id: str, after: str | None, limit: int, order: str,
                     include: list[str]) -> ResponseItemList:
    """A page of a stored response's input items: ``limit`` of them, in ``order`` ("asc": oldest first), after the
    item whose id is ``after`` in that order. Raises a 404 ``OpenAIError`` for an unknown (or unstored) response, a 400
    for an ``after`` that is none of its items' ids or an ``include`` value not of OpenAI's."""
    unknown = [value for value in include if value not in INCLUDABLE]
    if unknown:
        raise bad_request(f"include must be among {list(INCLUDABLE)}, got {unknown[0]!r}", "include")
    items = state.responses.get(response_id).input_items()
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise bad_request(f"after must be the id of an input item of response '{response_id}', got {after!r}",
                              "after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return ResponseItemList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                            has_more=start + limit < len(items))


def _chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat completion that serves ``req``; 400 for a ``json_schema`` format without its name and schema."""
    fmt, response_format = (req.text or TextConfig()).format, None
    if fmt.type == "json_schema" and fmt.as_json_schema() is None:
        raise bad_request("text.format needs name and schema when type is 'json_schema'", "text.format")
    if fmt.type != "text":
        response_format = ResponseFormat(type=fmt.type, json_schema=fmt.as_json_schema())
    choice = req.tool_choice if req.tools or req.tool_choice != "auto" else None  # "auto", the default, needs no tools
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in req.tools or []]
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    try:
        return ChatCompletionRequest(
            model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, logprobs=logprobs, top_logprobs=req.top_logprobs if logprobs else None, tools=tools or None,
            tool_choice=NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
            if isinstance(choice, FunctionToolChoice) else choice,
            parallel_tool_calls=req.parallel_tool_calls, response_format=response_format, user=req.user,
        )
    except ValidationError as e:
        error = e.errors()[0]  # fields checked again as chat fields: only the conversation itself can fail here
        where = ".".join(str(p) for p in error["loc"]).replace("messages", "input", 1)
        raise bad_request(f"{where}: {error['msg']}", "input") from None


def _prompt(state: ServerState, req: ResponsesRequest, chat: ChatCompletionRequest) -> list[int]:
    """The prompt's ids; with ``truncation: "auto"`` the fewest oldest turns after the system message are dropped
    (down to the last turn) for the prompt to leave room for ``max_output_tokens`` (at least one token).

    The number to drop is bisected: log2(turns) renderings of the conversation, on the event loop (dropping one turn
    at a time rendered it once per turn: 3.4 s for 1,000 short turns, every stream stalled meanwhile)."""
    ids = chat_prompt_ids(state, chat)
    limit = state.max_model_len - (req.max_output_tokens or 1)
    first = 1 if chat.messages[0].role == "system" else 0
    if req.truncation != "auto" or len(ids) <= limit or len(chat.messages) <= first + 1:
        return ids
    messages = list(chat.messages)
    lo, hi = 1, len(messages) - first - 1  # the answer is in [lo, hi]: hi, the last turn alone, if nothing fits
    while lo < hi:
        mid = (lo + hi) // 2
        chat.messages[:] = messages[:first] + messages[first + mid:]
        try:
            is_fitting = len(chat_prompt_ids(state, chat)) <= limit
        except OpenAIError:  # a template that refuses this cut (e.g. an assistant turn first): cut more
            is_fitting = False
        lo, hi = (lo, mid) if is_fitting else (mid + 1, hi)
    chat.messages[:] = messages[:first] + messages[first + lo:]
    return chat_prompt_ids(state, chat)


async def create_response(state: ServerState, req: ResponsesRequest, raw: Request) -> Response:
    """Validate, enqueue, then stream events or answer once. Raises ``OpenAIError`` (400/404/429/503)."""
    state.check_model(req.model)
    _refuse_unsupported(req)
    previous = (state.responses.get(req.previous_response_id, "previous_response_id")
                if req.previous_response_id is not None else None)  # "" is no id: a 404, as any unknown one
    messages, turns = _input_messages(req.input)
    _refuse_duplicate_ids([*(previous.items if previous else []), *turns])
    history = [*(previous.messages if previous else []), *messages]
    history_items = [*(previous.items if previous else []), *turns]  # the items of each message of history
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    try:
        chat = _chat_request(req, system + history)
        plan = tool_plan(chat, state.tool_call_parser)
        prompt_ids = await asyncio.to_thread(_prompt, state, req, chat)  # in a worker thread, as chat's
        # the turns the prompt kept, stored for a continuation: a chain under truncation "auto" stays within the
        # context (with the dropped turns kept, each link stored and re-tokenized the whole chain)
        history = chat.messages[len(system):]
        history_items = history_items[len(history_items) - len(history):]
        max_tokens = resolve_max_tokens(state, len(prompt_ids), req.max_output_tokens, ("input", "max_output_tokens"))
        params = sampling_params(chat, state, max_tokens, (chat.top_logprobs or 0) if chat.logprobs else None,
                                 plan.constraint if plan else None)
    except OpenAIError as e:
        e.param = _PARAMS.get(e.param or "", e.param)
        raise
    builder = _Builder(state, req, chat, plan, (history, history_items), prompt_ids)
    gen = Generation(state, builder.response.id)
    await gen.start([prompt_ids], params, "input")
    if req.stream:
        events = builder.events(gen, ChatDeltas(state, chat, plan, builder.prompt_tail))
        return await respond(gen, raw, 1, events, builder.from_choices)
    return await respond(gen, raw, 1, None, builder.from_choices)


class _Builder:
    """Builds one response: at once from the finished choice, or as stream events from its deltas; stores it."""

    def __init__(self, state: ServerState, req: ResponsesRequest, chat: ChatCompletionRequest, plan: ToolPlan | None,
                 history: tuple[list[ChatMessage], list[list[ListedItem]]], prompt_ids: list[int]) -> None:
        """``history``: the conversation's messages before the reply, and the items of each."""
        self.state, self.req, self.chat, self.plan = state, req, chat, plan
        self.history, self.history_items = history
        self.num_prompt_tokens, self.prompt_tail = len(prompt_ids), reasoning_prompt_tail(state, prompt_ids)
        self.response = ResponseObject(
            id=_new_id("resp"), status="in_progress", instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls, model=state.model_name,
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            store=req.store,
            temperature=req.temperature if req.temperature is not None else state.default_sampling.get("temperature", 1.0),
            text=req.text or TextConfig(), tool_choice=req.tool_choice or "auto",
            tools=req.tools or [], top_logprobs=req.top_logprobs, top_p=req.top_p if req.top_p is not None else state.default_sampling.get("top_p", 1.0),
            truncation=req.truncation or "disabled", user=req.user, metadata=req.metadata or {},
        )

    def finish(self, output: list[OutputItem], finish_reason: str | None, token_ids: list[int], num_cached: int
               ) -> ResponseObject:
        """The finished response (stored when asked): "incomplete" when cut by ``max_output_tokens``; ``token_ids``
        the reply's."""
        is_cut, num_tokens = finish_reason == "length", len(token_ids)
        reasoning = next((item.content[0].text for item in output if isinstance(item, OutputReasoning)), None)
        num_reasoning = num_reasoning_tokens(self.state.tokenizer, token_ids, reasoning)
        response = self.response.model_copy(update={
            "status": "incomplete" if is_cut else "completed", "output": output,
            "completed_at": None if is_cut else int(time.time()),
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if is_cut else None,
            "usage": ResponseUsage(input_tokens=self.num_prompt_tokens, output_tokens=num_tokens,
                                   input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
                                   output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning),
                                   total_tokens=self.num_prompt_tokens + num_tokens)})
        if self.req.store:
            self.state.responses.put(StoredResponse(response, [*self.history, _as_message(output)],
                                                    [*self.history_items, list(output)]))
        return response

    def from_choices(self, choices: list[ChoiceResult]) -> ResponseObject:
        c = choices[0]
        reasoning, text = split_reasoning(self.state, c.text, self.prompt_tail)
        content, calls = reply_parts(self.plan, text)
        status: ItemStatus = "incomplete" if c.finish_reason == "length" else "completed"
        output: list[OutputItem] = []
        if reasoning is not None:
            output.append(OutputReasoning(id=_new_id("rs"), content=[ReasoningText(text=reasoning)], status=status))
        if content or not calls:
            logprobs = chat_logprobs(self.state.tokenizer, c.token_ids, c.logprobs, self.chat.top_logprobs or 0) \
                if self.chat.logprobs else []
            output.append(OutputMessage(id=_new_id("msg"), status=status,
                                        content=[OutputText(text=content or "", logprobs=logprobs)]))
        output += [OutputFunctionCall(id=_new_id("fc"), call_id=call.id, name=call.function.name,
                                      arguments=call.function.arguments, status=status)
                   for call in (calls or [])[: self.req.max_tool_calls]]
        return self.finish(output, c.finish_reason, c.token_ids, c.num_cached_tokens)

    def events(self, gen: Generation, deltas: ChatDeltas) -> AsyncIterator[str]:
        """The SSE events of a streamed response (each ``event: <type>`` with its JSON, numbered from 0)."""
        writer = _EventWriter(self.req.max_tool_calls)
        num_cached = 0
        token_ids: list[int] = []  # the reply's, for its usage

        def first() -> Iterator[str]:
            yield writer.event("response.created", response=self.response)
            yield writer.event("response.in_progress", response=self.response)
            yield from writer.delta(deltas.opening(0))

        def on_output(_: int, c: CompletionOutput, output: RequestOutput) -> Iterator[str]:
            nonlocal num_cached
            num_cached = output.num_cached_tokens
            token_ids.extend(c.token_ids)
            for choice in deltas(c):
                yield from writer.delta(choice)

        def last(_: int) -> str:  # the tokens counted are token_ids'
            response = self.finish(writer.items, writer.finish_reason, token_ids, num_cached)
            kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
            return writer.event(kind, response=response)

        def failed(message: str, _: str, param: str | None) -> str:
            # OpenAI's error codes of a response are an enum: the request's own setting that failed (a 400 unstreamed)
            # is an "invalid_prompt", anything else (an abort, an engine failure) a "server_error"
            error = ResponseError(code="invalid_prompt" if param is not None else "server_error", message=message)
            response = self.response.model_copy(update={"status": "failed", "output": writer.items, "error": error})
            return writer.event("response.failed", response=response)

        return stream_events(gen, first(), on_output, last, error_event=failed, done=None)


def _as_message(output: list[OutputItem]) -> ChatMessage:
    """A response's output as the assistant turn a continuation sees."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
             for item in output if isinstance(item, OutputFunctionCall)]
    thoughts = [part.text for item in output if isinstance(item, OutputReasoning) for part in item.content]
    return ChatMessage(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None,
                       reasoning="".join(thoughts) if thoughts else None)


class _EventWriter:
    """Chat stream deltas of one choice as Responses events; ``items`` holds the output items so far."""

    def __init__(self, max_tool_calls: int | None) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.finish_reason: str | None = None
        self.max_tool_calls = max_tool_calls

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number}
        data |= {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in fields.items()}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def delta(self, choice: ChatCompletionStreamChoice) -> Iterator[str]:
        d, logprobs = choice.delta, choice.logprobs.content if choice.logprobs and choice.logprobs.content else None
        if d.reasoning:
            yield from self._reasoning(d.reasoning)
        if d.tool_calls is None and (d.content or logprobs):
            yield from self._text(d.content or "", logprobs or [])
        for call in d.tool_calls or []:
            if call.id is not None:
                yield from self._close("completed")
                if self.max_tool_calls is not None and self._num_calls() >= self.max_tool_calls:
                    continue
                yield from self._add(OutputFunctionCall(id=_new_id("fc"), call_id=call.id, name=call.function.name or "",
                                                        arguments="", status="in_progress"))
            item = self.open
            if call.function.arguments and isinstance(item, OutputFunctionCall):
                item.arguments += call.function.arguments
                yield self.event("response.function_call_arguments.delta", item_id=item.id,
                                 output_index=len(self.items) - 1, delta=call.function.arguments)
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason  # OpenAI's: "length" as the engine's
            status: ItemStatus = "incomplete" if choice.finish_reason == "length" else "completed"
            if not any(isinstance(item, (OutputMessage, OutputFunctionCall)) for item in self.items):
                yield from self._text("", [])  # a reply without text or calls is an empty message, as answered at once
            yield from self._close(status)

    def _num_calls(self) -> int:
        return sum(isinstance(item, OutputFunctionCall) for item in self.items)

    def _add(self, item: OutputItem) -> Iterator[str]:
        self.items.append(item)
        self.open = item
        yield self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _add_part(self, item: OutputMessage | OutputReasoning, part: OutputText | ReasoningText) -> str:
        """The event that adds an item's first content part (OpenAI, vLLM: an item is added without content)."""
        return self.event("response.content_part.added", item_id=item.id, output_index=len(self.items) - 1,
                          content_index=0, part=part)

    def _reasoning(self, text: str) -> Iterator[str]:
        if not isinstance(self.open, OutputReasoning):
            yield from self._close("completed")
            reasoning, thought = OutputReasoning(id=_new_id("rs"), content=[], status="in_progress"), ReasoningText(text="")
            yield from self._add(reasoning)
            yield self._add_part(reasoning, thought)
            reasoning.content.append(thought)
        item = self.open
        assert isinstance(item, OutputReasoning)
        item.content[0].text += text
        yield self.event("response.reasoning_text.delta", item_id=item.id, output_index=len(self.items) - 1,
                         content_index=0, delta=text)

    def _text(self, text: str, logprobs: list) -> Iterator[str]:
        if not isinstance(self.open, OutputMessage):
            yield from self._close("completed")
            message, part = OutputMessage(id=_new_id("msg"), status="in_progress", content=[]), OutputText(text="")
            yield from self._add(message)
            yield self._add_part(message, part)
            message.content.append(part)
        item = self.open
        assert isinstance(item, OutputMessage)
        part = item.content[0]
        part.text += text
        part.logprobs += logprobs
        yield self.event("response.output_text.delta", item_id=item.id, output_index=len(self.items) - 1,
                         content_index=0, delta=text, logprobs=[lp.model_dump() for lp in logprobs])

    def _close(self, status: ItemStatus) -> Iterator[str]:
        item, self.open, index = self.open, None, len(self.items) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0]
            yield self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                             text=part.text, logprobs=[lp.model_dump() for lp in part.logprobs])
            yield self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                             part=part)
        elif isinstance(item, OutputFunctionCall):
            yield self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                             name=item.name, arguments=item.arguments)
        elif isinstance(item, OutputReasoning):
            yield self.event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                             text=item.content[0].text)
            yield self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                             part=item.content[0])
        if item is not None:
            item.status = status
            yield self.event("response.output_item.done", output_index=index, item=item)
