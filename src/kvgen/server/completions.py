"""``POST /v1/completions``: raw prompts (text, texts, token ids or lists of them) into the engine.

Each prompt is its own engine request; choice ``index`` is ``prompt_index * n + i``.
``logprobs: k`` (0-5) gives each generated token's logprob and the k best alternatives
(the legacy format, as vLLM); ``echo`` puts the prompt before each choice's text, and
with ``logprobs`` its tokens' logprobs before the generated ones (the first is null),
as evaluation harnesses ask (``echo``, ``logprobs: 1``, ``max_tokens: 1``); ``echo`` with
``max_tokens: 0`` answers the prompt alone (as OpenAI and vLLM). ``suffix``
and ``best_of != n`` are refused with a 400 naming the field. Streaming sends text chunks
(with their tokens' logprobs), one chunk per choice with ``finish_reason``, a usage chunk
when asked, then ``data: [DONE]``.
Source: OpenAI API reference, Completions; vLLM ``serving_completion.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

from fastapi.responses import Response
from starlette.requests import Request

from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.server.beam import new_generation
from kvgen.server.errors import bad_request
from kvgen.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvgen.server.results import (
    ChoiceResult,
    StreamUsage,
    completion_logprobs,
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

T = TypeVar("T", ChoiceResult, CompletionOutput)


def _refuse_unsupported(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone), got 0", "max_tokens")
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


def _prompt_texts(state: ServerState, prompt: str | list, prompts: list[list[int]]) -> list[str]:
    """The text ``echo`` puts before each completion: a text prompt as sent, token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    texts = [p if isinstance(p, str) else None for p in prompt] if len(prompt) == len(prompts) else [None] * len(prompts)
    return [t if t is not None else state.tokenizer.decode(ids) for t, ids in zip(texts, prompts, strict=True)]


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    """Validate, enqueue every prompt, then stream (SSE) or answer once. Raises ``OpenAIError``."""
    state.check_model(req.model)
    check_stream_options(req)
    _refuse_unsupported(req)
    prompts = [truncated(state, p, req.truncate_prompt_tokens)  # tokenized in a worker thread, as chat's
               for p in await asyncio.to_thread(completion_prompt_ids, state, req.prompt)]
    # max_tokens None: all the room the longest prompt leaves
    # echo with max_tokens 0: the prompt alone, as OpenAI and vLLM (which draw one token and drop it)
    is_echo_only = req.echo and req.max_tokens == 0
    requested = 1 if is_echo_only else req.max_tokens
    max_tokens = min(resolve_max_tokens(state, len(p), requested, ("prompt", "max_tokens")) for p in prompts)
    params = sampling_params(req, state, max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    # a truncated prompt is echoed as its kept tokens decoded
    texts = _prompt_texts(state, req.prompt if req.truncate_prompt_tokens is None else [None] * len(prompts), prompts)
    echo = _Echo(state, req, prompts, texts if req.echo else None)
    gen = new_generation(state, req, "cmpl", raw)
    await gen.start(prompts, params, "prompt", req.priority)
    num_prompt_tokens = sum(len(p) for p in prompts)

    def response(choices: list[ChoiceResult]) -> CompletionResponse:
        choices = [_echo_only(c) for c in choices] if is_echo_only else choices
        return CompletionResponse(
            id=gen.request_id, created=gen.created, model=state.model_name,
            usage=usage(num_prompt_tokens, choices, num_cached_tokens(choices, req.n)),
            choices=[CompletionChoice(index=c.index, finish_reason=openai_finish_reason(c.finish_reason),
                                      stop_reason=c.stop_reason,
                                      **echo.first_piece(c.index // req.n, c.text, c.token_ids, c.logprobs, c.prompt_logprobs))
                     for c in choices],
        )

    return await respond(gen, raw, req.n, _stream(state, req, gen, echo, is_echo_only) if req.stream else None, response)


def _echo_only(c: T) -> T:
    """A choice (or streamed completion) without its generated token: echo with ``max_tokens: 0`` answers the prompt
    alone, finished by that length limit."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if isinstance(c, ChoiceResult) else None,
                               finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)


class _Echo:
    """A choice's text and logprobs, with its prompt's (text, and token logprobs from the second token) put first
    when ``echo`` asks; ``text_offset`` runs on from the choice's earlier pieces when streamed."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[list[int]], texts: list[str] | None):
        self.state, self.req, self.prompts, self.texts = state, req, prompts, texts
        self.text_offsets: dict[int, int] = {}  # choice index -> characters of token text sent so far (streaming)
        # prompt index -> its prompt logprobs (streaming: an n > 1 choice may start in an output without them)
        self.prompt_logprobs: dict[int, list] = {}

    def first_piece(self, prompt_index: int, text: str, token_ids: list[int], logprobs: list | None,
                    prompt_logprobs: list | None) -> dict[str, Any]:
        """``text`` and ``logprobs`` (CompletionChoice fields) of a choice's first (or only) piece."""
        if self.texts is None:
            return {"text": text, "logprobs": self.logprobs(token_ids, logprobs)}
        ids = self.prompts[prompt_index]
        entries = list(prompt_logprobs or [None] * len(ids)) + list(logprobs or [])
        return {"text": self.texts[prompt_index] + text, "logprobs": self.logprobs(ids + token_ids, entries)}

    def logprobs(self, token_ids: list[int], logprobs: list | None, text_offset: int = 0) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        return completion_logprobs(self.state.tokenizer, token_ids, logprobs or [], self.req.logprobs, text_offset)

    def piece(self, index: int, prompt_index: int, c: CompletionOutput, output: RequestOutput) -> CompletionChoice:
        """A streamed chunk's choice: the first one of a choice carries the echo."""
        if index in self.text_offsets:
            choice = CompletionChoice(index=index, text=c.text, finish_reason=None,
                                      logprobs=self.logprobs(c.token_ids, c.logprobs, self.text_offsets[index]))
        else:
            if output.prompt_logprobs is not None:
                self.prompt_logprobs[prompt_index] = output.prompt_logprobs
            choice = CompletionChoice(index=index, finish_reason=None, **self.first_piece(
                prompt_index, c.text, c.token_ids, c.logprobs, self.prompt_logprobs.get(prompt_index)))
        lp = choice.logprobs
        self.text_offsets[index] = lp.text_offset[-1] + len(lp.tokens[-1]) if lp is not None and lp.tokens else 0
        return choice


def _stream(state: ServerState, req: CompletionRequest, gen: Generation, echo: _Echo, is_echo_only: bool
            ) -> AsyncIterator[str]:
    stream_usage = StreamUsage(req.stream_options, [len(p) for p in echo.prompts], req.n)

    def chunk(choices: list[CompletionChoice], **fields: Any) -> str:
        data = CompletionChunk(id=gen.request_id, created=gen.created, model=state.model_name, choices=choices,
                               **fields)
        return sse(stream_usage.chunk_dict(data))

    def events(prompt_index: int, c: CompletionOutput, output: RequestOutput) -> Iterator[str]:
        index = prompt_index * req.n + c.index
        c = _echo_only(c) if is_echo_only else c
        stream_usage.count(prompt_index, c, output)
        if c.text or c.token_ids or index not in echo.text_offsets:
            choice = echo.piece(index, prompt_index, c, output)
            if choice.text or choice.logprobs is not None:
                yield chunk([choice])
        if c.finish_reason is not None:
            yield chunk([CompletionChoice(index=index, text="", finish_reason=openai_finish_reason(c.finish_reason),
                                          stop_reason=c.stop_reason)])

    final = stream_usage.final_chunk(chunk)
    return stream_events(gen, (), events, final)
