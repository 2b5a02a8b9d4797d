"""On the real default model: greedy server output equals ``kvgen generate --temperature 0``
for the same messages (``--chat``) and the same raw prompt, text and token counts (both
``--dtype float32``); then SIGTERM lets a short stream finish, aborts a long one after the
grace period (an error event, a 503 unstreamed), and the process exits 0. (6,000 tokens cannot finish in the 10 s of grace on
any CPU this runs on, ~400 tokens/s at best; 8 tokens finish in it even on a contended one.)"""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from kvgen.cli import main

MAX_TOKENS = 24
DTYPE = "float32"  # the same weights and KV-cache dtype on both sides: token parity, not near-ties
CHAT = "Write a haiku about the sea."
PROMPT = "The three primary colours are"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(tmp_path_factory, launch_server):
    live = launch_server("default", tmp_path_factory.mktemp("logs") / "default.log", "--dtype", DTYPE,
                         "--shutdown-timeout", "10", model_name="smollm2")
    yield live
    assert live.stop() == 0


def _cli_generate(capsys, prompt: str, chat: bool) -> dict:
    """``kvgen generate PROMPT --temperature 0 --json`` (in this process: no second interpreter start)."""
    argv = ["generate", prompt, "--temperature", "0", "--max-new-tokens", str(MAX_TOKENS), "--json", "--dtype", DTYPE]
    capsys.readouterr()
    assert main(argv + (["--chat"] if chat else [])) == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_chat_and_completion_equal_kvgen_generate(default_server, capsys):
    client = openai.OpenAI(base_url=default_server.v1, api_key="unused", max_retries=0, timeout=120)
    expected = _cli_generate(capsys, CHAT, chat=True)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": CHAT}],
                                       temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == expected["text"]
    assert r.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert r.usage.completion_tokens == len(expected["token_ids"])
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CHAT}], temperature=0, max_tokens=MAX_TOKENS,
        stream=True) if c.choices)
    assert streamed == expected["text"]
    expected = _cli_generate(capsys, PROMPT, chat=False)
    r = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].text == expected["text"] and r.usage.completion_tokens == len(expected["token_ids"])


def test_sigterm_finishes_short_streams_aborts_long_ones_and_exits_0(default_server):
    """Past --shutdown-timeout the engine aborts what is left: a long stream ends with an "aborted" error event and
    [DONE], a long non-streamed request is a 503 (uvicorn's cancellation gave a traceback each and a plain 500)."""
    import concurrent.futures

    messages = [{"role": "user", "content": "Tell me a long story."}]
    short = {"model": "smollm2", "messages": messages, "max_tokens": 8, "stream": True, "ignore_eos": True}
    long = {**short, "max_tokens": 6000}
    url = default_server.v1 + "/chat/completions"
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        httpx.Client(timeout=120) as http,
        http.stream("POST", url, json=long) as r_long,
    ):
        whole = pool.submit(httpx.post, url, json={**long, "stream": False}, timeout=120)
        # SIGTERM before it connects is a refused connection
        default_server.wait_metric("kvgen:num_requests_in_server", lambda n: n >= 2)
        with http.stream("POST", url, json=short) as r_short:
            lines_short = r_short.iter_lines()
            next(lines_short)
            default_server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            text_short = "\n".join(lines_short)
        text_long = "\n".join(r_long.iter_lines())
        unstreamed = whole.result()
    assert '"finish_reason":"length"' in text_short and text_short.strip().endswith("data: [DONE]")
    assert '"code":"aborted"' in text_long.replace(" ", "") and text_long.strip().endswith("data: [DONE]")
    assert unstreamed.status_code == 503 and unstreamed.json()["error"]["code"] == "aborted"
    assert default_server.proc.wait(timeout=60) == 0
    assert time.monotonic() - t0 < 45
    with pytest.raises(httpx.TransportError):
        httpx.get(default_server.url + "/health", timeout=2)
    assert "kvgen serve: stopped" in default_server.log() and "Traceback" not in default_server.log()
