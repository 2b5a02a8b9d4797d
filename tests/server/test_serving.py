"""kvgen.server.serving in process (the app over an engine through httpx's ASGI transport): admission bookkeeping."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.engine_args import EngineArgs
from kvgen.server.app import build_app

T = TypeVar("T")


def test_admission_slots_come_back_when_adding_a_request_fails_unexpectedly(tiny_model_dir):
    """An engine error other than a ValueError while a request is added (a 500) still frees its admission: with room
    for 4 sequences, three failed requests of n=4 leave the fourth request room (it leaked to a 429 before)."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_num_seqs=2))
    app = build_app(engine, "tiny", max_queue=2)
    add_request, failures = engine.add_request, [TypeError("boom")] * 3

    async def add_or_fail(*args, **kwargs):
        if failures:
            raise failures.pop()
        return await add_request(*args, **kwargs)

    engine.add_request = add_or_fail  # type: ignore[method-assign]
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "n": 4, "temperature": 1.0}

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgen") as client:
            codes = [(await client.post("/v1/completions", json=body, timeout=60)).status_code for _ in range(4)]
        await engine.shutdown()
        return codes

    assert asyncio.run(run()) == [500, 500, 500, 200]


async def _talk(tiny_model_dir, talk: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """``talk(client)`` against the app over a fresh engine on the tiny model, in process; its result."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                     base_url="http://kvgen") as client:
            return await talk(client)
    finally:
        await engine.shutdown()


def _chunks(sse_text: str) -> list[dict]:
    """The JSON chunks of an SSE body ([DONE] and blank lines left out)."""
    return [json.loads(line[6:]) for line in sse_text.splitlines() if line.startswith("data: {")]


def test_every_chunk_of_a_stream_has_the_requests_created(tiny_model_dir, monkeypatch):
    """OpenAI: each chunk of a stream has the same ``created`` timestamp, taken once per request (each chunk took the
    clock when it was built: with a clock ticking a second per read, every chunk had its own)."""
    ticks = itertools.count(1_800_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(ticks)))  # every reader of the clock sees it move

    async def talk(client: httpx.AsyncClient) -> list[set[int]]:
        created = []
        for path, body in (("/v1/completions", {"prompt": "Hello"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            body |= {"max_tokens": 6, "n": 2, "stream": True, "ignore_eos": True}
            chunks = _chunks((await client.post(path, json=body, timeout=60)).text)
            assert len(chunks) > 4
            created.append({c["created"] for c in chunks})
        return created

    assert [len(values) for values in asyncio.run(_talk(tiny_model_dir, talk))] == [1, 1]


def test_a_streamed_required_tool_call_carries_the_logprobs_of_the_unstreamed_one(tiny_model_dir):
    """tool_choice "required" holds its text back until it parses; its logprobs came nowhere (0 entries streamed
    against one per token unstreamed) and now come with the finish chunk."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool], "tool_choice": "required",
            "logprobs": True, "top_logprobs": 2, "temperature": 0, "max_tokens": 24}

    async def talk(client: httpx.AsyncClient) -> tuple[dict, list[dict]]:
        whole = (await client.post("/v1/chat/completions", json=body, timeout=60)).json()
        text = (await client.post("/v1/chat/completions", json=body | {"stream": True}, timeout=60)).text
        return whole, _chunks(text)

    whole, chunks = asyncio.run(_talk(tiny_model_dir, talk))
    expected = whole["choices"][0]["logprobs"]["content"]
    assert len(expected) == whole["usage"]["completion_tokens"] > 0
    streamed = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert streamed == expected


def test_metrics_series_exist_at_zero_before_the_first_request(tiny_model_dir):
    """As vLLM's: a scraper sees every counter and histogram of the model from the start (they appeared only once a
    request had touched them, so a before/after difference raised KeyError on a fresh server)."""

    async def talk(client: httpx.AsyncClient) -> str:
        return (await client.get("/metrics")).text

    lines = asyncio.run(_talk(tiny_model_dir, talk)).splitlines()
    for series in ('kvgen:prompt_tokens_total{model_name="tiny"} 0.0', 'kvgen:generation_tokens_total{model_name="tiny"} 0.0',
                   'kvgen:request_success_total{finished_reason="stop",model_name="tiny"} 0.0',
                   'kvgen:e2e_request_latency_seconds_count{model_name="tiny"} 0.0'):
        assert series in lines
