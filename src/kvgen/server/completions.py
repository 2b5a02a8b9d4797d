"""``POST /v1/completions``: raw prompts (text, texts, token ids or lists of them) into the engine.

Each prompt is its own engine request; choice ``index`` is ``prompt_index * n + i``.
``echo``, ``logprobs``, ``suffix`` and ``best_of != n`` are refused with a 400 naming
the field. Streaming sends text chunks, one chunk per choice with ``finish_reason``, a
usage chunk when asked, then ``data: [DONE]``. Source: OpenAI API reference, Completions.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import Request

from kvgen.server.errors import bad_request
from kvgen.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)
from kvgen.server.results import (
    chunk_dict,
    collect,
    openai_finish_reason,
    sse,
    sse_error,
    usage,
)
from kvgen.server.serving import (
    ClientDisconnected,
    Generation,
    ServerState,
    check_stream_options,
    new_request_id,
    resolve_max_tokens,
    sampling_params,
    until_disconnect,
)

logger = logging.getLogger("kvgen.server")


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.logprobs is not None:
        raise bad_request("logprobs is not supported on /v1/completions (use /v1/chat/completions)", "logprobs")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) or be null, got {req.best_of}", "best_of")


def completion_prompt_ids(state: ServerState, prompt: str | list) -> list[list[int]]:
    """One token-id list per prompt. Raises a 400 naming ``prompt`` for empty or out-of-vocabulary input."""
    tok = state.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    vocab = state.engine.engine.model.config.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt")
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    """Validate, enqueue every prompt, then stream (SSE) or answer once. Raises ``OpenAIError``."""
    state.check_model(req.model)
    check_stream_options(req)
    _refuse_unsupported(req)
    prompts = completion_prompt_ids(state, req.prompt)
    # max_tokens None: all the room the longest prompt leaves
    max_tokens = min(resolve_max_tokens(state, len(p), req.max_tokens, ("prompt", "max_tokens")) for p in prompts)
    params = sampling_params(req, state.tokenizer, max_tokens, None)
    gen = Generation(state, new_request_id("cmpl"))
    await gen.start(prompts, params, "prompt")
    num_prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        body = _stream(state, req, gen, num_prompt_tokens)
        return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(gen.close))
    try:
        choices = await until_disconnect(raw, collect(gen, req.n))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await gen.close()
    response = CompletionResponse(
        id=gen.request_id, model=state.model_name, usage=usage(num_prompt_tokens, choices),
        choices=[CompletionChoice(index=c.index, text=c.text, finish_reason=openai_finish_reason(c.finish_reason)) for c in choices],
    )
    return JSONResponse(response.model_dump())


async def _stream(state: ServerState, req: CompletionRequest, gen: Generation, num_prompt_tokens: int) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(index: int, text: str, finish_reason: str | None) -> str:
        choice = CompletionChoice(index=index, text=text, finish_reason=openai_finish_reason(finish_reason))
        return sse(chunk_dict(CompletionChunk(id=gen.request_id, model=state.model_name, choices=[choice]), include_usage))

    num_tokens = 0
    try:
        async for prompt_index, output in gen.outputs():
            for c in output.outputs:
                num_tokens += len(c.token_ids)
                index = prompt_index * req.n + c.index
                if c.finish_reason == "abort":
                    yield sse_error(f"the request was aborted by the server{': ' + output.error if output.error else ''}")
                    yield sse("[DONE]")
                    return
                if c.text:
                    yield chunk(index, c.text, None)
                if c.finish_reason is not None:
                    yield chunk(index, "", c.finish_reason)
        if include_usage:
            final = CompletionChunk(id=gen.request_id, model=state.model_name, choices=[],
                                    usage=usage(num_prompt_tokens, num_tokens))
            yield sse(chunk_dict(final, True))
        yield sse("[DONE]")
    except Exception as e:  # the engine failed mid-stream: the 200 is sent, so an error event
        logger.exception("request %s failed", gen.request_id)
        yield sse_error(f"internal server error ({type(e).__name__})", "internal_error")
        yield sse("[DONE]")
    finally:
        await gen.close()
