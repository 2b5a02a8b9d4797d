"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Bad input is a 400 naming the parameter (FastAPI's 422 validation errors and malformed
JSON included), an unknown model 404, a missing or wrong API key 401, a full queue 429.
An unexpected exception is a 500 whose body names only the exception type: a traceback
never leaves the server (it goes to the log).
Source: OpenAI API reference "Error codes"; vLLM ``ErrorResponse``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgen.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("kvgen.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """An error answered as an OpenAI error body with HTTP ``status_code``."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status_code, self.message, self.param, self.code)


def error_response(status_code: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    info = ErrorInfo(message=message, type=_TYPES.get(status_code, "server_error"), param=param, code=code)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status_code)


def bad_request(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_value")


_BRANCH_TAGS = {"str", "int", "float", "bool", "dict", "list"}  # pydantic's tags of a union's scalar branches


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; ``("query", "limit")`` -> ``"limit"``."""
    parts = [p for i, p in enumerate(loc) if p != "body" and (i, p) != (0, "query")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif "[" in str(p) or "-" in str(p) or p in _BRANCH_TAGS:  # a union branch tag ("list[int]"), not a field
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None


def validation_error(errors: Sequence[Any], content_type: str | None = None) -> OpenAIError:
    """The 400 of a request's validation errors (FastAPI's, or a pydantic ``ValidationError.errors()``): the
    deepest one's field as ``param``. ``content_type``: the request's header, named when the body went unparsed."""
    # the deepest problem: for a union field (``input``: a string or a list of items) that is the branch that came
    # closest, not "should be a valid string"; at one depth a branch whose type fit (``stop``: 17 strings is a list
    # too long, not "should be a valid string")
    first = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type"))) \
        if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":  # FastAPI's: loc ("body", character), ctx {"error": json's message}
        loc, ctx = tuple(first.get("loc", ())), first.get("ctx") or {}
        why = ctx.get("error", first.get("msg")) if isinstance(ctx, dict) else first.get("msg")
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return OpenAIError(400, f"malformed JSON body: {why}{at}", None, "invalid_json")
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), bytes):
        # FastAPI parses a body as JSON only under a JSON Content-Type (curl -d sends x-www-form-urlencoded)
        return OpenAIError(400, "the request body must be sent with Content-Type: application/json, got "
                           + (repr(content_type) if content_type else "no Content-Type"), None, "invalid_json")
    if tuple(first.get("loc", ())) == ("body",):  # no body, or JSON that is no object: no field to name
        why = "is empty" if first.get("type") == "missing" else "is not a JSON object"
        return OpenAIError(400, f"the request body {why}: send the request's fields as a JSON object", None,
                           "invalid_json")
    param = _loc_param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return OpenAIError(400, f"unrecognized request argument supplied: {param}", param, "unknown_parameter")
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return OpenAIError(400, message, param, "invalid_value")


def body_parse_error(cause: BaseException, content_encoding: str | None) -> OpenAIError:
    """The 400 of a JSON body that failed to parse for a reason other than its syntax (FastAPI says only "There
    was an error parsing the body"): bytes that are no UTF-8 (a gzip body), nesting past Python's recursion
    limit (RecursionError), an integer of more than 4300 digits (ValueError)."""
    why = str(cause).split(";", 1)[0]  # the int limit's advice (sys.set_int_max_str_digits) is the server's
    if content_encoding and content_encoding.lower() != "identity":
        why = f"Content-Encoding {content_encoding!r} is not supported, send the body uncompressed ({why})"
    return OpenAIError(400, f"malformed JSON body: {why}", None, "invalid_json")


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise becomes an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors(), request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's body parsing, raised from its cause
            return body_parse_error(exc.__cause__, request.headers.get("content-encoding")).response()
        response = error_response(exc.status_code, str(exc.detail), None, None)
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 15.5.6: the server MUST send it)
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__})", None, "internal_error")
