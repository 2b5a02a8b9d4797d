"""``POST /v1/chat/completions``: messages through the model's chat template, then the engine.

Streaming sends, per choice, a first chunk with ``delta.role``, content chunks, and one
chunk with ``finish_reason``; then a usage chunk when ``stream_options.include_usage``;
then ``data: [DONE]``. Stop strings never reach the client (the engine holds back text
that could still become one). Source: OpenAI API reference, Chat Completions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.errors import KvgenError
from kvgen.server.errors import bad_request
from kvgen.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChoiceLogprobs,
    DeltaMessage,
    message_dicts,
)
from kvgen.server.results import (
    ChoiceResult,
    chat_logprobs,
    chunk_dict,
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
    new_request_id,
    resolve_max_tokens,
    sampling_params,
)


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the messages rendered by the chat template (by default with the generation prompt).

    Raises a 400 naming ``messages`` when the template fails or renders nothing.
    """
    try:
        ids = state.tokenizer.apply_chat_template(
            message_dicts(req.messages), add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except (KvgenError, ValueError) as e:
        raise bad_request(str(e).splitlines()[0], "messages") from None
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
    prompt_ids = chat_prompt_ids(state, req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(state, len(prompt_ids), requested, ("messages", field))
    params = sampling_params(req, state.tokenizer, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    gen = Generation(state, new_request_id("chatcmpl"))
    await gen.start([prompt_ids], params, "messages")

    def response(choices: list[ChoiceResult]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=gen.request_id, model=state.model_name, usage=usage(len(prompt_ids), choices),
            choices=[_choice(state, req, c) for c in choices],
        )

    return await respond(gen, raw, req.n, _stream(state, req, gen, len(prompt_ids)) if req.stream else None, response)


def _logprobs(state: ServerState, req: ChatCompletionRequest, token_ids: list[int], logprobs: list) -> ChoiceLogprobs | None:
    if not req.logprobs:
        return None
    return ChoiceLogprobs(content=chat_logprobs(state.tokenizer, token_ids, logprobs, req.top_logprobs or 0))


def _choice(state: ServerState, req: ChatCompletionRequest, c: ChoiceResult) -> ChatCompletionChoice:
    return ChatCompletionChoice(
        index=c.index, message=ChatCompletionMessage(content=c.text),
        logprobs=_logprobs(state, req, c.token_ids, c.logprobs), finish_reason=openai_finish_reason(c.finish_reason),
    )


def _stream(state: ServerState, req: ChatCompletionRequest, gen: Generation, num_prompt_tokens: int) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[ChatCompletionStreamChoice], **fields: Any) -> str:
        data = ChatCompletionChunk(id=gen.request_id, model=state.model_name, choices=choices, **fields)
        return sse(chunk_dict(data, include_usage))

    def events(_: int, c: CompletionOutput, __: RequestOutput) -> Iterator[str]:
        if c.text or (req.logprobs and c.token_ids):
            lp = _logprobs(state, req, c.token_ids, c.logprobs or [])
            yield chunk([ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text), logprobs=lp)])
        if c.finish_reason is not None:
            reason = openai_finish_reason(c.finish_reason)
            yield chunk([ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason)])

    first = (chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]) for i in range(req.n))
    final = (lambda num_tokens: chunk([], usage=usage(num_prompt_tokens, num_tokens))) if include_usage else None
    return stream_events(gen, first, events, final)
