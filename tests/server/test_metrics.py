"""kvgen.server.metrics in process (the app over an engine through httpx's ASGI transport): what each request adds to
/metrics, against vLLM v1's meanings (``vllm/v1/metrics/stats.py``: every child of an ``n > 1`` request is a request of
its own, with its own TTFT, inter-token latencies and E2E latency)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

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


def _bucket_bounds(text: str, histogram: str) -> list[float]:
    """The finite ``le`` bounds of one histogram in a /metrics text, in order."""
    prefix = f"{histogram}_bucket{{le=\""
    return [float(line[len(prefix):].split('"', 1)[0]) for line in text.splitlines()
            if line.startswith(prefix) and not line.startswith(prefix + "+Inf")]


def test_latency_buckets_are_vllms(tiny_model_dir):
    """vLLM v1's ``PrometheusStatLogger`` bounds (``vllm/v1/metrics/loggers.py``; copied, vLLM is not installed here):
    TTFT up to 2560 s, E2E (and the per-request phase times that share its buckets) up to 7680 s. Before, both lists
    stopped two bounds short (160 s, 960 s), so long requests fell into +Inf where vLLM's dashboards see 640 / 1920 s."""
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0]
    request_latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                       480.0, 960.0, 1920.0, 7680.0]

    async def run() -> str:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir)))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                         base_url="http://kvgen") as client:
                return (await client.get("/metrics")).text
        finally:
            await engine.shutdown()

    text = asyncio.run(run())
    assert _bucket_bounds(text, "kvgen:time_to_first_token_seconds") == ttft
    assert _bucket_bounds(text, "kvgen:e2e_request_latency_seconds") == request_latency


def _histogram(deltas: dict[str, float], name: str) -> tuple[float, float]:
    """(count, sum) a request added to one histogram."""
    return deltas[f"kvgen:{name}_count"], deltas[f"kvgen:{name}_sum"]


def test_per_request_histograms_follow_what_the_request_did(tiny_model_dir):
    """vLLM v1's per-request series (``vllm/v1/metrics/stats.py``): one observation per finished child of an ``n``
    request (queue, prefill, decode, inference and E2E times, prompt and generated tokens, max_tokens, time per output
    token = decode time / (tokens - 1)), one ``n`` and one longest completion per request, and the prompt counted once
    per child in the token counters (it was counted once per request for n > 1); iteration_tokens sums what the steps
    did. The series were missing before."""
    n, max_tokens = 3, 5
    deltas = _deltas(tiny_model_dir, {"prompt": "Hello there", "max_tokens": max_tokens, "n": n, "temperature": 1.0,
                                      "ignore_eos": True})
    num_prompt_tokens = deltas["kvgen:request_prompt_tokens_sum"] / n
    assert num_prompt_tokens == int(num_prompt_tokens) > 0
    assert deltas["kvgen:prompt_tokens_total"] == deltas["kvgen:prefix_cache_queries_total"] == n * num_prompt_tokens
    assert _histogram(deltas, "request_prompt_tokens") == (n, n * num_prompt_tokens)
    assert _histogram(deltas, "request_generation_tokens") == (n, n * max_tokens)
    assert _histogram(deltas, "request_params_max_tokens") == (n, n * max_tokens)
    assert _histogram(deltas, "request_params_n") == (1, n)
    assert _histogram(deltas, "request_max_num_generation_tokens") == (1, max_tokens)
    iteration_tokens = _histogram(deltas, "iteration_tokens_total")
    assert iteration_tokens[1] == deltas["kvgen:prompt_tokens_total"] + deltas["kvgen:generation_tokens_total"]
    assert max_tokens <= iteration_tokens[0] <= n * max_tokens  # one per step that had outputs
    times = {name: _histogram(deltas, name) for name in (
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_inference_time_seconds", "request_time_per_output_token_seconds")}
    assert all(count == n and total >= 0 for count, total in times.values())
    queue, prefill, decode, inference = (times[name][1] for name in (
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds"))
    assert inference == pytest.approx(prefill + decode) and decode > 0
    assert queue + inference <= times["e2e_request_latency_seconds"][1]
    # every child made max_tokens tokens: the sum of the per-request means is the decode time / (max_tokens - 1)
    assert times["request_time_per_output_token_seconds"][1] == pytest.approx(decode / (max_tokens - 1))


def test_num_preemptions_counts_every_preemption_of_every_child(tiny_model_dir):
    """Four children of one ``n=4`` request on a pool too small for all of them preempt each other; the counter must
    equal the scheduler's preemptions, counted here by wrapping ``Scheduler._preempt`` (it is fed per step through
    ``LLMEngine.stat_loggers``, as vLLM's ``IterationStats.num_preempted_reqs``). Before, it was read from the
    merged output when the request finished, which carries one child's count (2 of 5 here)."""
    calls: list[str] = []

    async def run() -> dict[str, float]:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_blocks=12, block_size=4))
        scheduler = engine.engine.scheduler
        preempt = scheduler._preempt

        def counting_preempt(request):
            calls.append(request.request_id)
            preempt(request)

        scheduler._preempt = counting_preempt
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "tiny")),
                                         base_url="http://kvgen") as client:
                before = _samples((await client.get("/metrics")).text)
                response = await client.post("/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "Hello there, how are you", "max_tokens": 24, "n": 4,
                    "temperature": 1.0, "seed": 0, "ignore_eos": True})
                assert response.status_code == 200, response.text
                after = _samples((await client.get("/metrics")).text)
        finally:
            await engine.shutdown()
        return {name: after[name] - before.get(name, 0.0) for name in after}

    deltas = asyncio.run(run())
    assert len(set(calls)) > 1  # more than one child was preempted
    assert deltas["kvgen:num_preemptions_total"] == len(calls)
