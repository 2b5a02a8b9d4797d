"""kvgen.server.metrics in process (the app over an engine through httpx's ASGI transport): what each request adds to
/metrics, against vLLM v1's meanings (``vllm/v1/metrics/stats.py``: every child of an ``n > 1`` request is a request of
its own, with its own TTFT, inter-token latencies and E2E latency)."""

from __future__ import annotations

import asyncio

import httpx

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.engine_args import EngineArgs
from kvgen.server.app import build_app


def _samples(text: str) -> dict[str, float]:
    """``/metrics`` samples by series name without the model_name label (finish reasons kept)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgen:"):
            series, value = line.rsplit(" ", 1)
            out[series.replace('model_name="tiny"', "").replace(",}", "}").replace("{}", "")] = float(value)
    return out


def _deltas(tiny_model_dir, body: dict) -> dict[str, float]:
    """What one POST /v1/completions adds to each series of /metrics, on a fresh in-process server."""

    async def run() -> dict[str, float]:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                         base_url="http://kvgen") as client:
                before = _samples((await client.get("/metrics")).text)
                response = await client.post("/v1/completions", json={"model": "tiny"} | body, timeout=60)
                assert response.status_code == 200, response.text
                after = _samples((await client.get("/metrics")).text)
        finally:
            await engine.shutdown()
        return {name: after[name] - before.get(name, 0.0) for name in after}

    return asyncio.run(run())


def test_each_of_n_completions_has_its_own_ttft_itl_and_e2e(tiny_model_dir):
    """As vLLM's n > 1 children: n TTFTs, n * (max_tokens - 1) inter-token latencies and n E2E latencies, as many as
    the n successes counted (one TTFT and one E2E per request before, and one ITL per step, divided by n)."""
    n, max_tokens = 3, 5
    for stream in (False, True):
        deltas = _deltas(tiny_model_dir, {"prompt": "Hello there", "max_tokens": max_tokens, "n": n,
                                          "temperature": 1.0, "ignore_eos": True, "stream": stream})
        assert deltas['kvgen:request_success_total{finished_reason="length"}'] == n
        assert deltas["kvgen:generation_tokens_total"] == n * max_tokens
        assert deltas["kvgen:time_to_first_token_seconds_count"] == n
        assert deltas["kvgen:inter_token_latency_seconds_count"] == n * (max_tokens - 1)
        assert deltas["kvgen:e2e_request_latency_seconds_count"] == n
