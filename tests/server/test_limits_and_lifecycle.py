"""API key (401), the bounded queue (429), and ``kvgen serve`` user errors (one line on
stderr, exit code 2). SIGTERM is tested on the default model (test_default_model.py)."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from kvgen.cli import main

KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "hi"}]
LONG = {"messages": MESSAGES, "max_tokens": 1900, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory, launch_server):
    """One running sequence, one waiting, an API key."""
    live = launch_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "guarded.log", "--api-key", KEY,
                        "--max-num-seqs", "1", "--max-queue", "1")
    yield live
    live.stop()


def _client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=60)


def test_api_key_is_required_on_v1_but_not_on_health_metrics_or_page(guarded):
    with pytest.raises(openai.AuthenticationError) as e:
        _client(guarded, "wrong").chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    no_key = httpx.post(guarded.v1 + "/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(guarded.url + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.get(guarded.v1 + "/models", headers={"Authorization": "Basic " + KEY}).status_code == 401
    r = _client(guarded).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert r.usage.completion_tokens >= 1
    for path in ("/health", "/metrics", "/"):
        assert httpx.get(guarded.url + path).status_code == 200


def test_full_queue_is_429_and_leaving_clients_free_everything(guarded):
    client = _client(guarded)
    before = guarded.metrics().get('kvgen:request_success_total{finished_reason="abort",model_name="tiny"}', 0)
    running = client.chat.completions.create(model="tiny", stream=True, **LONG)
    waiting = client.chat.completions.create(model="tiny", stream=True, **LONG)
    next(iter(running))
    guarded.wait_metric("kvgen:num_requests_in_server", lambda value: value == 2, timeout=20)
    assert guarded.metrics()["kvgen:num_requests_waiting"] == 1
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 429 and e.value.type == "rate_limit_error"
    running.close()
    waiting.close()
    guarded.wait_metric("kvgen:num_requests_in_server", lambda value: value == 0, timeout=20)
    guarded.wait_metric("kvgen:num_requests_running", lambda value: value == 0, timeout=20)
    m = guarded.metrics()
    assert m["kvgen:num_requests_waiting"] == 0 and m["kvgen:kv_cache_usage_perc"] == 0
    assert m['kvgen:request_success_total{finished_reason="abort",model_name="tiny"}'] == before + 2
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices  # serves again


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be an int >= 1, got 0"),
        (["--model", "/nonexistent/model.gguf"], "model not found"),
        (["--log-level", "loud"], "--log-level must be one of"),
        (["--quantization", "q3_k"], "quantization must be one of q8_0, q5_1, q5_0, q4_1, q4_0"),
        (["--quantization", "q8_0", "--dtype", "float32"], "needs dtype 'auto'"),
        (["--max-model-len", "1.5K"], "decimals only with k/m/g/t"),  # vLLM refuses it too
        (["--max-model-len", "lots"], "--max-model-len: invalid int value: 'lots'"),
        (["/a/model", "--model", "/b/model"], "the model is given twice: '/a/model' and --model '/b/model'"),
    ],
)
def test_serve_user_errors_are_one_line_and_exit_2(capsys, args, message):
    assert main(["serve", "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_vllm_launch_flags_reach_the_configs(monkeypatch):
    """``vllm serve MODEL`` (the model positional), vLLM's ``--dtype half|float``, suffixed ints (``32k`` = 32,000,
    ``32K`` = 32,768, ``25.6k`` = 25,600, as vLLM's human_readable_int docstring) and ``--enable-prefix-caching`` /
    ``--no-enable-prefix-caching``: each was refused with exit 2. run_server is replaced: no model loads."""
    import kvgen.server.launch

    seen: list[tuple] = []
    monkeypatch.setattr(kvgen.server.launch, "run_server", lambda engine_args, server_args: seen.append(
        (engine_args, server_args)) or 0)
    for argv, want in (
        (["/m", "--dtype", "half", "--max-model-len", "32k", "--no-enable-prefix-caching"],
         {"model": "/m", "dtype": "float16", "max_model_len": 32_000, "enable_prefix_caching": False}),
        (["--model", "/m", "/m", "--dtype", "float", "--max-num-batched-tokens", "2K", "--kv-cache-memory", "25.6k",
          "--enable-prefix-caching"],
         {"model": "/m", "dtype": "float32", "max_num_batched_tokens": 2048, "kv_cache_memory": 25_600,
          "enable_prefix_caching": True}),
    ):
        assert main(["serve", *argv]) == 0
        engine_args, _ = seen.pop()
        assert {name: getattr(engine_args, name) for name in want} == want
    assert main(["serve", "--served-model-name", "a", "b", "--uvicorn-log-level", "debug"]) == 0
    _, server_args = seen.pop()
    assert (server_args.served_model_name, server_args.log_level) == (("a", "b"), "debug")
    assert main(["serve", "--served-model-name", ""]) == 2 and not seen  # was served as the name ""


def test_a_vllm_launch_line_with_several_served_names_and_a_suffixed_length(tiny_model_dir, tmp_path, launch_server):
    """vLLM's ``--served-model-name A B`` (every name is accepted as ``model`` and listed, the first is the one
    reported), with ``--max-model-len 1K`` (1,024 tokens): "unrecognized arguments: B" and "invalid int value" before."""
    live = launch_server(tiny_model_dir, tmp_path / "server.log", "--served-model-name", "first", "second",
                         "--max-model-len", "1K", model_name="first")
    try:
        models = httpx.get(f"{live.v1}/models", timeout=30).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("first", 1024), ("second", 1024)]
        reply = httpx.post(f"{live.v1}/completions", json={"model": "second", "prompt": "hi", "max_tokens": 1},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == "first"
        other = httpx.post(f"{live.v1}/completions", json={"model": "third", "prompt": "hi", "max_tokens": 1},
                           timeout=60)
        assert other.status_code == 404
    finally:
        assert live.stop() == 0


def test_serve_on_a_busy_port_is_one_line_and_exit_2(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_run_server_freezes_what_start_up_built(tiny_model_dir, monkeypatch):
    """Before it serves, ``run_server`` takes everything start-up built (torch, the model, the app) out of the
    garbage collector's sight, so a full collection under load does not walk them (~140 ms a collection on the
    default model). uvicorn's run is replaced: the test stops where serving would begin."""
    import gc
    import signal

    import uvicorn

    from kvgen.engine.engine_args import EngineArgs
    from kvgen.server.launch import ServerArgs, run_server

    seen: list[int] = []
    def run(self, sockets=None):  # where uvicorn would serve: note the freeze, close the bound socket
        seen.append(gc.get_freeze_count())
        for sock in sockets or ():
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}  # run_server sets its own
    gc.unfreeze()
    try:
        assert run_server(EngineArgs(model=str(tiny_model_dir), num_blocks=64), ServerArgs(port=0)) == 0
    finally:
        gc.unfreeze()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert len(seen) == 1 and seen[0] > 10_000, seen
