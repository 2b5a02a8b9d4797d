"""``build_app``: the FastAPI application of ``kvgen serve`` over one ``AsyncLLMEngine``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``, ``POST /v1/responses``
(with ``GET`` and ``DELETE /v1/responses/{response_id}``, ``GET .../input_items``; ``POST .../cancel`` a 400, no
response running in the background), ``GET /v1/models`` (and ``/v1/models/{model}``),
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics`` (Prometheus
text) and the chat page at ``GET /`` (static files shipped in ``kvgen/server/static``).
With an API key, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
``Authorization: Bearer <key>``; the page, ``/health`` and ``/metrics`` stay open (as vLLM).
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

import kvgen
from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.server.chat import create_chat_completion, messages_prompt_ids
from kvgen.server.completions import create_completion
from kvgen.server.embeddings import create_embedding
from kvgen.server.errors import OpenAIError, bad_request, install_error_handlers
from kvgen.server.metrics import ServerMetrics
from kvgen.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvgen.server.reasoning_parsers import REASONING_PARSERS
from kvgen.server.responses import create_response, list_input_items
from kvgen.server.responses_protocol import (
    DeletedResponse,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
)
from kvgen.server.serving import ClientDisconnected, ServerState, until_disconnect

STATIC_DIR = Path(__file__).parent / "static"
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}
# With "stream": true, each server-sent event is `data: <chunk JSON>`, the last `data: [DONE]`.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}, "required": ["data"]}
_STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def _state(request: Request) -> ServerState:
    return request.app.state.kvgen


async def check_api_key(request: Request) -> None:
    """Raises a 401 ``OpenAIError`` unless the request carries the server's API key (if it has one)."""
    key = _state(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise OpenAIError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'.", None, "invalid_api_key")


def _api_router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(check_api_key)], responses=_ERRORS)

    @router.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> ModelList:
        state = _state(request)
        names = state.model_names or (state.model_name,)
        return ModelList(data=[ModelCard(id=name, max_model_len=state.max_model_len) for name in names])

    @router.get("/v1/models/{model:path}", response_model=ModelCard)
    async def retrieve_model(model: str, request: Request) -> ModelCard:  # OpenAI's "Retrieve model"; 404 for others
        state = _state(request)
        state.check_model(model)
        return ModelCard(id=model, max_model_len=state.max_model_len)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(_state(request), body, request)

    @router.post("/v1/completions", response_model=CompletionResponse, responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(_state(request), body, request)

    @router.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        try:  # a client that leaves stops the inputs still to embed (499, as generations)
            response = await until_disconnect(request, create_embedding(_state(request), body))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(response.model_dump())

    @router.post("/v1/responses", response_model=ResponseObject, responses=_STREAMED)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(_state(request), body, request)

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve_response(response_id: str, request: Request) -> ResponseObject:
        return _state(request).responses.get(response_id).response

    @router.get("/v1/responses/{response_id}/input_items", response_model=ResponseItemList)
    async def response_input_items(response_id: str, request: Request, after: str | None = None,
                                   limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                                   include: list[str] | None = Query(None)) -> ResponseItemList:
        """OpenAI's "List input items"; ``include`` also as ``include[]`` (the SDK's form). ``before``, gone from
        OpenAI's API, is a 400 rather than ignored."""
        if "before" in request.query_params:
            raise bad_request("before is not supported (OpenAI's API no longer has it); page with after", "before")
        include = [*(include or []), *request.query_params.getlist("include[]")]
        return list_input_items(_state(request), response_id, after, limit, order, include)

    @router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject)
    async def cancel_response(response_id: str, request: Request) -> ResponseObject:
        """404 for an unknown id, else 400: only background responses can be cancelled (OpenAI), and kvgen runs none
        (vLLM: "Cannot cancel a synchronous response.")."""
        _state(request).responses.get(response_id)
        raise bad_request(f"response '{response_id}' is not a background response; only those can be cancelled", None)

    @router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
    async def delete_response(response_id: str, request: Request) -> DeletedResponse:
        _state(request).responses.delete(response_id)
        return DeletedResponse(id=response_id)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        return await asyncio.to_thread(_tokenize, _state(request), body)  # in a worker thread, as chat's

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = _state(request)
        state.check_model(body.model)
        try:
            return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
        except ValueError as e:
            raise bad_request(str(e), "tokens") from None

    return router


def _tokenize(state: ServerState, body: TokenizeRequest) -> TokenizeResponse:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("pass exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        chat_fields = body.model_dump(include={"add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                                               "tools"}, exclude_unset=True)
        ids = messages_prompt_ids(state, body.messages or [], chat_fields)
    token_strs = [state.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.max_model_len, token_strs=token_strs)


def _open_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        if _state(request).engine.is_failed:
            raise OpenAIError(503, "the engine loop failed; see the server log", None, "engine_dead")
        return JSONResponse(HealthResponse().model_dump())

    # vLLM's (SageMaker's) name for /health; one route per method, so each has its own OpenAPI operation id
    @router.get("/ping", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def ping(request: Request) -> Response:
        return await health(request)

    @router.post("/ping", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def ping_post(request: Request) -> Response:
        return await health(request)

    @router.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=kvgen.__version__).model_dump())

    @router.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    return router


def _drop_422(app: FastAPI) -> None:
    """Validation errors answer 400 (OpenAI), so the schema must not promise FastAPI's 422. The schema is built on
    its first request (``/openapi.json``, ``/docs``), as FastAPI does: built at start-up it took 0.10 s of it."""
    build = app.openapi  # FastAPI's: builds the schema once, then returns the one it built

    def openapi() -> dict[str, Any]:
        is_new = app.openapi_schema is None
        schema = build()
        for path in schema.get("paths", {}).values() if is_new else ():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(engine: AsyncLLMEngine, model_name: str | tuple[str, ...], api_key: str | None = None,
              max_queue: int = 256,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              default_sampling: dict[str, Any] | None = None) -> FastAPI:
    """The app over a built engine; ``model_name`` is what requests' ``model`` must say (several names, as vLLM's
    ``--served-model-name A B``: any of them, the first reported in responses and metrics; all in ``/v1/models``).

    ``default_sampling``: ``SamplingParams`` fields a request that leaves them unset gets (the model's generation
    config, ``kvgen.engine.generation_defaults.default_sampling_params``); ``max_tokens`` also caps every request.

    ``max_queue``: sequences allowed to wait beyond the engine's ``max_num_seqs`` (then 429).
    ``tool_call_parser`` ("hermes"): tool_choice "auto" is served, calls parsed from the text; None refuses it.
    ``reasoning_parser`` ("deepseek_r1", "qwen3"): replies' ``<think>`` text goes to ``reasoning``.
    Raises ``ValueError`` for ``max_queue`` < 0 or an engine without a tokenizer.
    """
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
    if reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    if not names:
        raise ValueError("model_name must not be empty")
    model_name = names[0]
    llm = engine.engine
    if llm.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer")
    state = ServerState(
        engine=engine, tokenizer=llm.tokenizer, model_name=model_name, max_model_len=llm.max_model_len,
        max_num_seqs=llm.engine_args.max_num_seqs, max_queue=max_queue, metrics=ServerMetrics(llm, model_name),
        api_key=api_key, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
        default_sampling=dict(default_sampling or {}), model_names=names,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="kvgen", summary="OpenAI-compatible API on the kvgen engine", version="0.1.0", lifespan=lifespan)
    app.state.kvgen = state
    install_error_handlers(app)
    app.include_router(_api_router())
    app.include_router(_open_router())
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _drop_422(app)
    return app
