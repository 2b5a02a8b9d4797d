"""AsyncLLMEngine without a model: a failing step fails and aborts the requests in flight but
not later ones; a stream closed before (or without) being read aborts its request."""

from __future__ import annotations

import asyncio

import pytest

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.outputs import CompletionOutput, RequestOutput


class _StubEngine:
    """Stands in for LLMEngine: every request finishes after one step; ``fail_steps`` steps raise first."""

    def __init__(self, fail_steps: int = 0) -> None:
        self.unfinished: set[str] = set()
        self.aborted: list[str] = []
        self.fail_steps = fail_steps

    def add_request(self, request_id, prompt, sampling_params, prompt_token_ids=None, priority=0) -> None:
        self.unfinished.add(request_id)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted += ids
        self.unfinished -= set(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self) -> list[RequestOutput]:
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("step failed")
        done, self.unfinished = sorted(self.unfinished), set()
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, "x", [5], None, None, "length")], True) for rid in done]


async def _collect(engine: AsyncLLMEngine, request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate("hi", None, request_id)]


def test_a_failed_step_aborts_its_requests_and_the_next_request_is_served():
    async def scenario() -> tuple[_StubEngine, list[RequestOutput]]:
        stub = _StubEngine(fail_steps=1)
        engine = AsyncLLMEngine(stub, step_in_thread=False)
        with pytest.raises(RuntimeError, match="step failed"):
            await _collect(engine, "a")
        assert engine.is_failed and "a" in stub.aborted
        outputs = await _collect(engine, "b")  # the loop restarts with the next request
        await engine.shutdown()
        return stub, outputs

    stub, outputs = asyncio.run(scenario())
    assert [o.request_id for o in outputs] == ["b"] and outputs[0].finished
    assert "b" not in stub.aborted


def test_closing_a_stream_before_its_last_output_aborts_the_request():
    async def scenario() -> _StubEngine:
        stub = _StubEngine()
        engine = AsyncLLMEngine(stub, step_in_thread=False)
        never_read = await engine.add_request("unread", "hi", None)
        await never_read.aclose()
        await never_read.aclose()  # idempotent
        finished = await engine.add_request("read", "hi", None)
        assert [o.finished async for o in finished] == [True]
        await finished.aclose()
        await engine.shutdown()
        return stub

    stub = asyncio.run(scenario())
    assert stub.aborted == ["unread"]
