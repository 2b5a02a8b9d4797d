"""``kvgen serve``'s vLLM front-end options: CORS (any origin by default, as vLLM; ``--allowed-origins`` narrows it)
and ``--chat-template`` (a file or inline Jinja replacing the model's), refused in one line before the model loads."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from helpers import PARTS_TEMPLATE

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_any_origin_may_call_the_api_by_default(server):
    origin = {"Origin": "http://localhost:3000"}
    pre = httpx.options(f"{server.v1}/chat/completions", headers=origin | PREFLIGHT, timeout=30)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    models = httpx.get(f"{server.v1}/models", headers=origin, timeout=30)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_and_a_chat_template_file(tiny_model_dir, tiny_tokenizer, tmp_path, launch_server):
    from kvgen.tokenizer import Tokenizer

    (template := tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE)
    live = launch_server(tiny_model_dir, tmp_path / "server.log", "--chat-template", str(template),
                         "--allowed-origins", '["http://ok.example"]')
    try:
        for origin, allowed in (("http://ok.example", True), ("http://elsewhere.example", False)):
            pre = httpx.options(f"{live.v1}/chat/completions", headers={"Origin": origin} | PREFLIGHT, timeout=30)
            assert (pre.status_code == 200) is allowed
            assert pre.headers.get("access-control-allow-origin") == (origin if allowed else None)
        custom = Tokenizer.from_pretrained(tiny_model_dir)
        custom.chat_template = PLAIN_TEMPLATE
        want = custom.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        assert want != tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
        tokens = httpx.post(f"{live.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
        chat = httpx.post(f"{live.v1}/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
        assert tokens == want and chat.json()["usage"]["prompt_tokens"] == len(want)
    finally:
        assert live.stop() == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--chat-template", "/no/such/template.jinja"], "chat_template: '/no/such/template.jinja' is neither a file nor"),
        (["--chat-template", "{% for %}"], "chat template does not compile (line 1)"),
        (["--allowed-origins", '["a", 1]'], "--allowed-origins must be a JSON list of strings"),
    ],
)
def test_bad_front_end_options_are_one_line_and_exit_code_2(tiny_model_dir, flags, message):
    r = subprocess.run([sys.executable, "-m", "kvgen.cli", "serve", "--model", str(tiny_model_dir), *flags],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert message in r.stderr


CALLS_TEMPLATE = (
    "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>{% endfor %}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}"
    "\n{% endfor %}[assistant]")


def _reference(tiny_model_dir, template: str, messages: list[dict]):
    """transformers' tokenizer of the tiny model with ``template``, and its prompt ids of ``messages`` (vLLM's form)."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_model_dir)
    ref.chat_template = template
    return ref, ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def test_messages_reach_the_template_as_vllm_hands_them_over(tiny_model_dir, tmp_path, launch_server):
    """vLLM's parse_chat_messages joins text parts with newlines, parses tool-call arguments into objects ({} for
    text that is no JSON) and gives reasoning as reasoning_content too; kvgen joined the parts with nothing and kept
    the arguments as JSON text, so ``arguments | tojson`` (Llama 3.1, Mistral) quoted them a second time."""
    (template := tmp_path / "calls.jinja").write_text(CALLS_TEMPLATE)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "reasoning": "Look it up.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    parsed = [{**c, "function": {**c["function"], "arguments": args}} for c, args in zip(calls, [{"city": "Paris"}, {}])]
    as_vllm = [{"role": "user", "content": "Weather in\nParis?"},
               {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": parsed},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    ref, want = _reference(tiny_model_dir, CALLS_TEMPLATE, as_vllm)
    live = launch_server(tiny_model_dir, tmp_path / "server.log", "--chat-template", str(template))
    try:
        tokens = httpx.post(f"{live.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        assert tokens == want
        assert '<call>get_weather {"city": "Paris"}</call><call>get_time {}</call>' in ref.decode(tokens)
        documents = [{"title": "Weather", "text": "Paris is at 21 C."}]
        chat = httpx.post(f"{live.v1}/chat/completions", json={"messages": messages, "documents": documents,
                                                                "max_tokens": 1}, timeout=60).json()
        want_rag = ref.apply_chat_template(as_vllm, documents=documents, add_generation_prompt=True, tokenize=True)
        assert chat["usage"]["prompt_tokens"] == len(want_rag) > len(want)  # vLLM's documents field
        refused = httpx.post(f"{live.v1}/chat/completions", json={"messages": [
            {"role": "system", "content": "Be brief."}, *messages]}, timeout=30)  # the template's own error: a 400
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "messages"
        assert error["message"].endswith("failed on these messages: System role not supported")
    finally:
        assert live.stop() == 0


def test_a_template_that_loops_over_content_gets_the_parts_as_vllm_hands_them_over(tiny_model_dir, tmp_path,
                                                                                    launch_server):
    """vLLM detects a template that loops over ``message['content']`` (Llama 3.2 Vision's, Qwen2-VL's, Pixtral's:
    its "openai" content format) and hands it each content as a list of ``{"type": "text", "text": ...}`` parts (a
    string as one part, None as none; a tool message's texts joined); kvgen joined the parts with newlines."""
    (template := tmp_path / "parts.jinja").write_text(PARTS_TEMPLATE)
    call = {"id": "call_123456789", "type": "function", "function": {"name": "paint", "arguments": '{"colour": "red"}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Paint it"}, {"type": "text", "text": " red."}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_123456789", "content": [{"type": "text", "text": "done"},
                                                                      {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "Again."},
    ]
    as_vllm = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": messages[1]["content"]},
        {"role": "assistant", "content": [], "tool_calls": [{**call, "function": {"name": "paint",
                                                                                   "arguments": {"colour": "red"}}}]},
        {"role": "tool", "tool_call_id": "call_123456789", "content": "done\nok"},
        {"role": "user", "content": [{"type": "text", "text": "Again."}]},
    ]
    ref, want = _reference(tiny_model_dir, PARTS_TEMPLATE, as_vllm)
    live = launch_server(tiny_model_dir, tmp_path / "server.log", "--chat-template", str(template))
    try:
        tokens = httpx.post(f"{live.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        assert tokens == want and "Paint itred." in ref.decode(tokens)
        chat = httpx.post(f"{live.v1}/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60)
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(want)
    finally:
        assert live.stop() == 0


def test_enable_request_id_headers_echoes_or_makes_an_id(tiny_model_dir, tmp_path, launch_server, server):
    """vLLM's ``--enable-request-id-headers``: every reply carries ``X-Request-Id``, the client's own (which also names
    a chat reply) or a new random hex id; streamed replies keep their whole stream. Off by default."""
    import re

    live = launch_server(tiny_model_dir, tmp_path / "server.log", "--enable-request-id-headers")
    chat = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    try:
        given = httpx.post(f"{live.v1}/chat/completions", json=chat, headers={"X-Request-Id": "gw-1"}, timeout=60)
        assert given.headers["x-request-id"] == "gw-1" and given.json()["id"] == "chatcmpl-gw-1"
        made = httpx.get(f"{live.url}/health", timeout=30).headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", made)
        with httpx.stream("POST", f"{live.v1}/chat/completions", json=chat | {"stream": True},
                          headers={"X-Request-Id": "gw-2"}, timeout=60) as r:
            assert r.headers["x-request-id"] == "gw-2"
            assert "data: [DONE]" in list(r.iter_lines())
    finally:
        live.stop()
    assert "x-request-id" not in httpx.get(f"{server.url}/health", timeout=30).headers


def test_request_id_header_middleware_also_marks_a_500(tiny_model_dir):
    """``kvgen serve`` wraps the whole app in ``RequestIdHeader``: Starlette answers an unexpected error (a 500) outside
    every ``add_middleware`` middleware, so a reply that way had no ``X-Request-Id``."""
    import asyncio

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.app import build_app
    from kvgen.server.launch import RequestIdHeader

    async def run() -> list[httpx.Response]:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), num_blocks=16))
        app = build_app(engine, "tiny")

        async def boom() -> None:
            raise RuntimeError("an internal error")

        app.add_api_route("/boom", boom)
        transport = httpx.ASGITransport(app=RequestIdHeader(app), raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://kvgen") as client:
                return [await client.get("/boom", headers={"X-Request-Id": "gw-5"}), await client.get("/health")]
        finally:
            await engine.shutdown()

    failed, healthy = asyncio.run(run())
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "gw-5"
    assert healthy.status_code == 200 and len(healthy.headers["x-request-id"]) == 32
