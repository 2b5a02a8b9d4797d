"""``POST /v1/embeddings`` (OpenAI's Embeddings API; vLLM's and llama.cpp's servers serve it too).

Each input is embedded by ``AsyncLLMEngine.embed`` between two engine steps (one forward without the KV cache,
pooled by the engine's ``pooling_type``: :mod:`kvgen.engine.pooling`), so generation requests keep running
between the inputs (and chunks) of a long embeddings request. Usage counts the inputs' tokens, and so do the
``kvgen:prompt_tokens`` and ``kvgen:request_success`` (finished_reason "stop") metrics.
Source: OpenAI openapi.yaml ``CreateEmbeddingRequest`` / ``CreateEmbeddingResponse``.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import time

from kvgen.engine.pooling import PoolingParams
from kvgen.engine.async_engine import EngineStoppedError
from kvgen.server.chat import messages_prompt_ids
from kvgen.server.errors import OpenAIError, bad_request
from kvgen.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from kvgen.server.serving import ServerState, new_request_id


def encode_embedding(values: list[float], encoding_format: str) -> list[float] | str:
    """``values`` as they are ("float") or as the base64 of their little-endian float32 bytes ("base64")."""
    if encoding_format == "float":
        return values
    packed = array.array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _param_of(error: ValueError) -> str:
    """The request field a refusal names: ``dimensions`` or ``truncate_prompt_tokens``, else ``input``."""
    return next((name for name in ("dimensions", "truncate_prompt_tokens") if str(error).startswith(name)), "input")


def _messages_ids(state: ServerState, body: EmbeddingRequest) -> list[int]:
    """``body.messages`` rendered as a chat request with the embedding request's chat fields would be (vLLM's
    ``EmbeddingChatRequest``: no generation prompt and no special tokens unless asked). Raises a 400."""
    chat_fields = body.model_dump(include={"add_generation_prompt", "continue_final_message", "chat_template_kwargs"})
    add_special_tokens = body.add_special_tokens and "add_special_tokens" in body.model_fields_set
    return messages_prompt_ids(state, body.messages or [], chat_fields, add_special_tokens)


async def create_embedding(state: ServerState, body: EmbeddingRequest) -> EmbeddingResponse:
    """The embeddings of ``body.input`` or ``body.messages`` (each cut to its last ``truncate_prompt_tokens``; input
    text tokenized with the special tokens unless ``add_special_tokens`` is false, messages without them unless it is
    set true: vLLM's extras), in input order. Raises a
    400 ``OpenAIError`` for neither or both of input and messages, an empty input, token ids outside the vocabulary,
    messages the template cannot render, an input over ``max_model_len``, ``truncate_prompt_tokens`` 0 or over it, or
    ``dimensions`` over the hidden size; 404 for another model's name."""
    state.check_model(body.model)
    if (body.input is None) == (body.messages is None):
        raise bad_request("pass exactly one of input and messages", "input")
    inputs = body.input if body.messages is None else [await asyncio.to_thread(_messages_ids, state, body)]
    if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]  # type: ignore[assignment]  # one string, or one list of token ids
    if not inputs:
        raise bad_request("input must be a string, a list of token ids, or a non-empty list of either", "input")
    if empty := [i for i, item in enumerate(inputs) if isinstance(item, (str, list)) and not item]:
        raise bad_request(f"input {empty[0]} is empty: every input needs a token" if len(inputs) > 1 else
                          "input is empty: it needs a token", "input")
    try:
        params = PoolingParams(dimensions=body.dimensions, truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ValueError as e:
        raise bad_request(str(e), _param_of(e)) from None
    data, num_tokens, request_id, start = [], 0, new_request_id("embd"), time.monotonic()
    for index, item in enumerate(inputs):
        if isinstance(item, str) and not body.add_special_tokens:  # the engine's tokenizing adds them
            item = await asyncio.to_thread(state.tokenizer.encode, item, add_special_tokens=False)
            if not item:  # text of no token (whitespace to a WordPiece vocabulary)
                raise bad_request(f"input {index} is empty: it holds no token" if len(inputs) > 1 else
                                  "input is empty: it holds no token", "input")
        try:
            out = await state.engine.embed(f"{request_id}-{index}", item, params)  # type: ignore[arg-type]
        except EngineStoppedError as e:
            raise OpenAIError(503, f"the request was aborted by the server: {e}", None, "aborted") from None
        except ValueError as e:
            raise bad_request(f"input {index}: {e}" if len(inputs) > 1 else str(e), _param_of(e)) from None
        num_tokens += len(out.prompt_token_ids)
        data.append(EmbeddingData(embedding=encode_embedding(out.outputs.embedding, body.encoding_format), index=index))
    state.metrics.record_embedding(request_id, num_tokens, time.monotonic() - start)
    return EmbeddingResponse(data=data, model=state.model_name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
