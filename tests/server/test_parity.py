"""On the real default model, greedy server output equals ``kvgen generate --temperature 0``
for the same messages (``--chat``) and the same raw prompt: text and token counts (both
``--dtype float32``)."""

from __future__ import annotations

import json

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
    live = launch_server("default", tmp_path_factory.mktemp("logs") / "default.log", "--dtype", DTYPE, model_name="smollm2")
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
