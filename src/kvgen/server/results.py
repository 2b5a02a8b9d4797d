"""Turning engine outputs into OpenAI pieces: accumulated choices, logprobs, usage, SSE lines.

Choice ``index`` is ``prompt_index * n + completion index`` (OpenAI's order for several
prompts). Logprobs are the engine's raw-logit log-probabilities (vLLM's default).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request

from kvgen.engine.outputs import CompletionOutput, RequestOutput
from kvgen.engine.types import PositionLogprobs, PromptLogprobs, SampleLogprobs
from kvgen.server.errors import OpenAIError
from kvgen.server.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    FinishReason,
    PromptTokensDetails,
    StreamOptions,
    TopLogprob,
    Usage,
)
from kvgen.server.serving import ClientDisconnected, Generation, until_disconnect
from kvgen.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf
logger = logging.getLogger("kvgen.server")


@dataclass
class ChoiceResult:
    """One choice's text and tokens so far; ``finish_reason`` "stop" | "length" | "abort" once done."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's)
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs of its prompt
    num_cached_tokens: int = 0  # its prompt's tokens served by the prefix cache

    def add(self, completion: CompletionOutput) -> None:
        self.text += completion.text
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs or []
        self.finish_reason = completion.finish_reason
        self.stop_reason = completion.stop_reason


def openai_finish_reason(reason: str | None) -> FinishReason | None:
    """An engine ``finish_reason`` as OpenAI's: "stop", "length", or None while running.

    "abort" never reaches a choice (``collect`` raises 503, streams end with an error event
    first); any other value raises ``ValueError``.
    """
    if reason is None:
        return None
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise ValueError(f"finish_reason must be 'stop', 'length' or None, got {reason!r}")


async def collect(gen: Generation, n: int) -> list[ChoiceResult]:
    """Read a generation to its end; raises an ``OpenAIError`` if the engine aborted a choice: 400 naming the
    request's setting that left it nothing to generate, else 503."""
    choices: dict[int, ChoiceResult] = {}
    prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt index -> its prompt logprobs, if asked
    error: str | None = None
    error_param: str | None = None
    async for prompt_index, output in gen.outputs():
        if output.error and not error:
            error, error_param = output.error, output.error_param
        if output.prompt_logprobs is not None:
            prompt_logprobs[prompt_index] = output.prompt_logprobs
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            choices.setdefault(index, ChoiceResult(index)).add(completion)
            choices[index].num_cached_tokens = output.num_cached_tokens
    results = [choices[i] for i in sorted(choices)]
    for choice in results:
        choice.prompt_logprobs = prompt_logprobs.get(choice.index // n)
    if len(results) < gen.num_prompts * n or any(c.finish_reason not in ("stop", "length") for c in results):
        if error_param is not None:
            raise OpenAIError(400, error or "", error_param, "invalid_value")
        raise OpenAIError(503, f"the request was aborted by the server{': ' + error if error else ''}", None, "aborted")
    return results


def usage(num_prompt_tokens: int, choices: list[ChoiceResult] | int, num_cached_tokens: int = 0) -> Usage:
    """``choices`` (or their number of generated tokens) as OpenAI's usage; ``num_cached_tokens`` of the prompt tokens
    came from the prefix cache."""
    completion = choices if isinstance(choices, int) else sum(len(c.token_ids) for c in choices)
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                 total_tokens=num_prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


def num_cached_tokens(choices: list[ChoiceResult], n: int) -> int:
    """The prompts' tokens served by the prefix cache, each prompt counted once (by its first choice)."""
    return sum(c.num_cached_tokens for c in choices if c.index % n == 0)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character -> byte (Radford et al. 2019, encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_text_and_bytes(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text (decoded alone; a partial UTF-8 sequence shows as U+FFFD) and its raw bytes."""
    text = tokenizer.decode([token_id])
    piece, decoder = tokenizer.id_to_token(token_id), _byte_decoder()
    raw = bytes(decoder[ch] for ch in piece) if piece and all(ch in decoder for ch in piece) else text.encode()
    return text, list(raw)


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text, raw = token_text_and_bytes(tokenizer, token_id)
    return TopLogprob(token=text, logprob=max(logprob, MIN_LOGPROB), bytes=raw)


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: SampleLogprobs, num_top: int
) -> list[ChatTokenLogprob]:
    """OpenAI ``choices[].logprobs.content``: one entry per token, its ``num_top`` alternatives, best first."""
    out = []
    for token_id, position in zip(token_ids, logprobs, strict=False):  # a stop string may end the text early
        chosen = _top(tokenizer, token_id, position[token_id].logprob)
        top = [_top(tokenizer, t, v) for t, v in _best(position, num_top)]
        out.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return out


def _best(position: PositionLogprobs, num_top: int) -> list[tuple[int, float]]:
    """The ``num_top`` most likely (id, logprob) of a position's dict, best first (the chosen id counts only where it
    is among them: the dict holds the request's top ``num_top`` besides it)."""
    return sorted(((t, lp.logprob) for t, lp in position.items()), key=lambda kv: -kv[1])[:num_top]


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: SampleLogprobs | PromptLogprobs,
    num_top: int, text_offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI ``choices[].logprobs`` of ``/v1/completions``: per token its text, logprob and a dict of the ``num_top``
    best alternatives plus the chosen token (both None for an entry without logprobs: an echoed prompt's first
    token); ``text_offset`` counts token texts from ``text_offset`` (as vLLM)."""
    out = CompletionLogprobs()
    for token_id, position in zip(token_ids, logprobs, strict=False):  # a stop string may end the text early
        text = token_text_and_bytes(tokenizer, token_id)[0]
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        logprob = max(position[token_id].logprob, MIN_LOGPROB)
        top = {token_text_and_bytes(tokenizer, t)[0]: max(v, MIN_LOGPROB) for t, v in _best(position, num_top)}
        top.setdefault(text, logprob)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
    return out


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event line: ``data: {json}`` (or a literal such as ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


def sse_error(message: str, code: str = "aborted", param: str | None = None) -> str:
    """An error inside a stream that already sent its 200 headers (as vLLM): an error event; with ``param`` (the
    request's own setting failed), the body of the 400 it would have been before the headers."""
    kind = "server_error" if param is None else "invalid_request_error"
    return sse(ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump())


class StreamUsage:
    """The ``usage`` a stream's chunks carry (``stream_options``; vLLM ``serving_chat.py``): none; null on every chunk
    and a last usage chunk (``include_usage``); or, with ``continuous_usage_stats`` too, each choice chunk its prompt's
    tokens and its choice's tokens so far. Choice ``index`` ``i`` belongs to prompt ``i // n``."""

    def __init__(self, options: StreamOptions | None, num_prompt_tokens: list[int], n: int) -> None:
        self.include_usage = bool(options and options.include_usage)
        self.is_continuous = bool(self.include_usage and options and options.continuous_usage_stats)
        self.num_prompt_tokens, self.n = num_prompt_tokens, n
        self.num_generated_tokens = [0] * (len(num_prompt_tokens) * n)  # per choice index
        self.num_cached_tokens = [0] * len(num_prompt_tokens)  # per prompt, from its first choice

    def count(self, prompt_index: int, completion: CompletionOutput, output: RequestOutput) -> None:
        """Adds a streamed output's new tokens to its choice's count."""
        self.num_generated_tokens[prompt_index * self.n + completion.index] += len(completion.token_ids)
        if completion.index == 0:
            self.num_cached_tokens[prompt_index] = output.num_cached_tokens

    def usage(self, index: int | None = None) -> Usage:
        """Choice ``index``'s usage so far, or (None) the whole request's."""
        if index is None:
            return usage(sum(self.num_prompt_tokens), sum(self.num_generated_tokens), sum(self.num_cached_tokens))
        prompt_index = index // self.n
        return usage(self.num_prompt_tokens[prompt_index], self.num_generated_tokens[index],
                     self.num_cached_tokens[prompt_index])

    def chunk_dict(self, chunk: Any) -> dict[str, Any]:
        """A stream chunk as JSON: ``usage`` as the options ask; a delta's unset fields left out."""
        if self.is_continuous and chunk.usage is None and len(chunk.choices) == 1:
            chunk.usage = self.usage(chunk.choices[0].index)
        data = chunk.model_dump()
        if not self.include_usage:
            data.pop("usage", None)
        for choice in data.get("choices", []):
            if isinstance(choice.get("delta"), dict):
                choice["delta"] = _without_none(choice["delta"])
        return data

    def final_chunk(self, chunk: Callable[..., str]) -> Callable[[int], str] | None:
        """``stream_events``' usage chunk: ``chunk([], usage=...)`` with the request's usage, when asked."""
        return (lambda _: chunk([], usage=self.usage())) if self.include_usage else None


def _without_none(value: Any) -> Any:
    """Dicts (nested, in lists too) without their None entries: a delta carries only what it sets."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return [_without_none(v) for v in value] if isinstance(value, list) else value


async def respond(
    gen: Generation, raw: Request, n: int, stream: AsyncIterator[str] | None,
    response: Callable[[list[ChoiceResult]], BaseModel],
) -> Response:
    """The SSE ``stream`` (``gen`` closed after it), or every choice collected and answered once as
    ``response(choices)``; 499 when the client leaves first (the requests are aborted)."""
    if stream is not None:
        return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(gen.close))
    try:
        choices = await until_disconnect(raw, collect(gen, n))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await gen.close()
    return JSONResponse(response(choices).model_dump())


async def stream_events(
    gen: Generation, first: Iterable[str], events: Callable[[int, CompletionOutput, RequestOutput], Iterable[str]],
    usage_chunk: Callable[[int], str] | None, *, error_event: Callable[[str, str, str | None], str] = sse_error,
    done: str | None = sse("[DONE]"),
) -> AsyncIterator[str]:
    """SSE lines of a streamed request: ``first``, then ``events(prompt_index, completion, output)`` per completion of
    each engine output, the ``usage_chunk(num_completion_tokens)`` when asked, then ``done`` (unless None). An aborted
    request or an engine failure after the 200 ends the stream with ``error_event(message, code, param)`` (as vLLM;
    ``param``: the request's own setting that failed, as the 400 it is unstreamed)."""
    num_tokens, ending = 0, [] if done is None else [done]
    try:
        for line in first:
            yield line
        async for prompt_index, output in gen.outputs():
            for c in output.outputs:
                num_tokens += len(c.token_ids)
                if c.finish_reason == "abort":
                    if output.error_param is not None:
                        yield error_event(output.error or "", "invalid_value", output.error_param)
                    else:
                        why = f": {output.error}" if output.error else ""
                        yield error_event(f"the request was aborted by the server{why}", "aborted", None)
                    for line in ending:
                        yield line
                    return
                for line in events(prompt_index, c, output):
                    yield line
        if usage_chunk is not None:
            yield usage_chunk(num_tokens)
        for line in ending:
            yield line
    except OpenAIError as e:  # raised after the 200 (beam search adds a request per step: the shutdown's 503)
        yield error_event(e.message, e.code or "invalid_value", e.param)
        for line in ending:
            yield line
    except Exception as e:
        logger.exception("request %s failed", gen.request_id)
        yield error_event(f"internal server error ({type(e).__name__})", "internal_error", None)
        for line in ending:
            yield line
    finally:
        await gen.close()
