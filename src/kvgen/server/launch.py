"""``run_server``: load the model, build the app, serve it with uvicorn until SIGTERM / SIGINT.

The socket is bound before the model loads, so a busy port fails at once.
On SIGTERM uvicorn stops accepting and lets in-flight responses finish for up to
``shutdown_timeout`` seconds; then the engine aborts what is left, so each answers as an aborted
request does (a 503, or an error event and ``[DONE]`` on a stream) before the connections close. uvicorn's
own cancellation (a traceback per request and a plain-text 500) stays a last resort, a few seconds later.
The process then exits 0 instead of re-raising the signal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from kvgen.chat_template import compile_chat_template, read_chat_template
from kvgen.engine.engine_args import EngineArgs
from kvgen.engine.generation_defaults import default_sampling_params
from kvgen.fields import config_field as _f
from kvgen.heap import freeze_startup_objects
from kvgen.server.reasoning_parsers import REASONING_PARSERS
from kvgen.server.tool_parsers import TOOL_CALL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServerArgs:
    """HTTP-side settings of ``kvgen serve``. Raises ``ValueError`` naming the field."""

    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "TCP port (0 = any free port, printed at start)")
    served_model_name: tuple[str, ...] | None = _f(None, "the names requests may use in 'model', the first reported "
                                                         "in responses (default: --model)")
    api_key: str | None = _f(None, "require 'Authorization: Bearer KEY' on /v1 (default: $KVGEN_API_KEY, else none)")
    max_queue: int = _f(256, "sequences allowed to wait beyond max_num_seqs (then 429)")
    log_level: str = _f("info", f"uvicorn log level: {', '.join(LOG_LEVELS)}",
                        flags=("--log-level", "--uvicorn-log-level"))  # the second: vLLM's name
    shutdown_timeout: float = _f(10.0, "seconds in-flight requests get after SIGTERM")
    enable_auto_tool_choice: bool = _f(False, "let tool_choice 'auto' (the default with tools) through; needs "
                                              "--tool-call-parser")
    tool_call_parser: str | None = _f(None, "how tool calls are found in generated text: 'hermes' "
                                            "(<tool_call>{...}</tool_call>: Qwen2.5, Hermes), 'llama3_json' (a JSON "
                                            "object reply: Llama 3.1/3.2), 'mistral' ([TOOL_CALLS] [...])")
    reasoning_parser: str | None = _f(None, "put replies' <think>...</think> text in 'reasoning': 'deepseek_r1' "
                                            "(the reply starts inside it) or 'qwen3' (a reply that opens with "
                                            "<think>, or whose prompt ends inside an open <think>)")
    chat_template: str | None = _f(None, "a Jinja chat template, or a file holding one, replacing the model's")
    allowed_origins: tuple[str, ...] = _f(("*",), "origins a browser may call the API from (CORS)")
    allowed_methods: tuple[str, ...] = _f(("*",), "HTTP methods allowed from other origins (CORS)")
    allowed_headers: tuple[str, ...] = _f(("*",), "request headers allowed from other origins (CORS)")
    allow_credentials: bool = _f(False, "let other origins send cookies and credentials (CORS)")
    enable_request_id_headers: bool = _f(False, "answer every request with an X-Request-Id header: the client's, else "
                                                "a new random id (vLLM's)")

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.served_model_name is not None:  # one name, or vLLM's several (a list from argparse)
            names = self.served_model_name
            self.served_model_name = (names,) if isinstance(names, str) else tuple(names)
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError(f"served_model_name must be non-empty names, got {list(self.served_model_name)!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            setattr(self, name, _string_list(name, getattr(self, name)))
        if self.chat_template is not None:  # refused before the model loads
            compile_chat_template(read_chat_template(self.chat_template))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser hermes|llama3_json|mistral)")


def _string_list(name: str, values: tuple[str, ...]) -> tuple[str, ...]:
    """CORS values as given (``--allowed-origins A B``) or as vLLM's one JSON list (``'["A", "B"]'``)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be strings or a JSON list of strings, got {values[0]!r} ({e.msg})") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{name} must be a JSON list of strings, got {values[0]!r}")
        return tuple(parsed)
    return tuple(values)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (port 0 = any free port). Raises ``OSError`` if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class RequestIdHeader:
    """ASGI middleware: every HTTP response carries ``X-Request-Id``, the request's own or else a new random hex id
    (vLLM's ``--enable-request-id-headers``). Plain ASGI, not Starlette's ``BaseHTTPMiddleware``, so streamed
    replies and disconnect detection pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for key, value in scope["headers"] if key == b"x-request-id" and value.strip()), None)
        request_id = given.strip() if given is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> int:
    """Serve until a signal arrives; returns the exit code (0).

    Raises ``ValueError`` when the address cannot be bound (a busy port), before the model loads.
    """
    import uvicorn
    from starlette.middleware.cors import CORSMiddleware

    from kvgen.engine.async_engine import AsyncLLMEngine
    from kvgen.loader import resolve_model_path
    from kvgen.server.app import build_app

    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(server_args.host, server_args.port)
    except OSError as e:
        raise ValueError(f"kvgen serve: cannot listen on {server_args.host}:{server_args.port}: {e.strerror or e}") from None
    try:
        defaults = default_sampling_params(resolve_model_path(engine_args.model), engine_args.generation_config,
                                           engine_args.override_generation_config)
        engine = AsyncLLMEngine.from_engine_args(engine_args)
        if server_args.chat_template is not None and engine.engine.tokenizer is not None:
            engine.engine.tokenizer.chat_template = read_chat_template(server_args.chat_template)
    except BaseException:
        sock.close()
        raise
    names = server_args.served_model_name or (engine_args.model,)
    name = names[0]
    parser = server_args.tool_call_parser if server_args.enable_auto_tool_choice else None
    if defaults:
        print(f"kvgen serve: sampling defaults from the model's generation config: {defaults} (--generation-config "
              "vllm for vLLM's own)", file=sys.stderr, flush=True)
    app = build_app(engine, names, server_args.api_key, server_args.max_queue, parser, server_args.reasoning_parser,
                    defaults)
    app.add_middleware(CORSMiddleware, allow_origins=list(server_args.allowed_origins),  # vLLM's defaults: any
                       allow_methods=list(server_args.allowed_methods), allow_headers=list(server_args.allowed_headers),
                       allow_credentials=server_args.allow_credentials)
    # around the whole app: Starlette answers a 500 outside every add_middleware one
    served = RequestIdHeader(app) if server_args.enable_request_id_headers else app
    # uvicorn annotates timeout_graceful_shutdown as int but hands it to asyncio.wait_for (float seconds).
    config = uvicorn.Config(
        served, log_level=server_args.log_level, access_log=False,
        timeout_graceful_shutdown=server_args.shutdown_timeout + _ABORT_GRACE_S,  # type: ignore[arg-type]
        log_config=None,
    )
    server = uvicorn.Server(config)
    _abort_after(server, engine, server_args.shutdown_timeout)
    freeze_startup_objects()
    host, port = sock.getsockname()[:2]
    print(f"kvgen serve: model {name!r} on http://{host}:{port} (chat page at /, OpenAI API at /v1)", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes that exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    print("kvgen serve: stopped", file=sys.stderr, flush=True)
    return 0


# Seconds uvicorn waits past shutdown_timeout before cancelling handlers: the aborted ones answer well within it.
_ABORT_GRACE_S = 5.0


def _abort_after(server: Any, engine: Any, grace_s: float) -> None:
    """Make ``server``'s (a ``uvicorn.Server``) first exit signal also run ``engine.abort_all()`` ``grace_s``
    seconds later, on the event loop (armed from the signal handler through ``call_soon_threadsafe``)."""
    handle_exit = server.handle_exit
    is_armed = False

    def handle(sig: int, frame: Any) -> None:
        nonlocal is_armed
        handle_exit(sig, frame)
        if not is_armed:
            is_armed = True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(loop.call_later, grace_s, engine.abort_all)

    server.handle_exit = handle
