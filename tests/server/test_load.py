"""64 concurrent streaming requests, a third of them disconnecting mid-stream: afterwards the
server answers, nothing runs or waits, every KV block is free (read from /metrics), the
leavers were aborted (not run to the end), and resident memory grew less than RSS_BOUND."""

from __future__ import annotations

import asyncio
import time

import openai

NUM_REQUESTS = 64
NUM_TOKENS = 40  # for the clients that stay
LEAVER_TOKENS = 1000  # for the clients that leave after LEAVE_AFTER chunks: far more than they read
LEAVE_AFTER = 3
RSS_BOUND = 100 * 2**20  # bytes of resident-memory growth allowed over the 64 requests
NUM_LEAVERS = len(range(0, NUM_REQUESTS, 3))  # 22
ABORT = 'kvgen:request_success_total{finished_reason="abort",model_name="tiny"}'


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[bool, str | None, int]:
    """(left early, finish_reason, content chunks read) for request i; every third one leaves."""
    leaves = i % 3 == 0
    stream = await client.chat.completions.create(
        model="tiny", stream=True, temperature=1.0, seed=i, max_tokens=LEAVER_TOKENS if leaves else NUM_TOKENS,
        messages=[{"role": "user", "content": f"Request {i}: tell me a story."}], extra_body={"ignore_eos": True},
    )
    finish, num_chunks = None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        num_chunks += 1
        if leaves and num_chunks == LEAVE_AFTER:
            await stream.close()  # disconnect mid-stream
            break
    return leaves, finish, num_chunks


async def _run_all(base_url: str) -> list[tuple[bool, str | None, int]]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(NUM_REQUESTS)))


def _settled(server, timeout: float) -> dict[str, float]:
    """Metrics once nothing is in flight (fails after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = m["kvgen:num_requests_running"] + m["kvgen:num_requests_waiting"] + m["kvgen:num_requests_in_server"]
        if busy == 0 and m["kvgen:kv_cache_free_blocks"] == m["kvgen:kv_cache_total_blocks"]:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
        time.sleep(0.1)


def test_64_streams_with_a_third_disconnecting_leave_nothing_behind(server, client):
    asyncio.run(_run_all(server.v1))  # warm-up round: allocator pools, first-request paths
    before = _settled(server, timeout=60)
    results = asyncio.run(_run_all(server.v1))
    after = _settled(server, timeout=30)
    stayed = [r for r in results if not r[0]]
    assert len(stayed) == NUM_REQUESTS - NUM_LEAVERS
    assert all(finish == "length" for _, finish, _ in stayed)
    assert after["kvgen:kv_cache_usage_perc"] == 0
    assert after[ABORT] - before[ABORT] == NUM_LEAVERS  # every leaver was aborted
    generated = after["kvgen:generation_tokens_total"] - before["kvgen:generation_tokens_total"]
    assert generated < len(stayed) * NUM_TOKENS + NUM_LEAVERS * LEAVER_TOKENS // 2  # leavers stopped well short of 1000
    growth = after["process_resident_memory_bytes"] - before["process_resident_memory_bytes"]
    assert growth < RSS_BOUND, f"resident memory grew {growth / 2**20:.1f} MiB"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_non_streaming_client_that_times_out_aborts_its_request(server):
    import httpx

    before = _settled(server, timeout=30)[ABORT]
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True}
    try:
        httpx.post(server.v1 + "/completions", json=body, timeout=0.5)  # 1900 tokens take ~9 s here
        raise AssertionError("the request finished within 0.5 s; it cannot test a disconnect")
    except httpx.ReadTimeout:
        pass
    after = _settled(server, timeout=30)  # long before the 1900 tokens could have been generated
    assert after[ABORT] == before + 1
