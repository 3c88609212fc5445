"""Errors in each API dialect's shape: as a JSON response, and as the event that ends a stream.

One FlareError (common/errors.py) carries the status, message, hint and field; only the envelope differs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Literal

from aiohttp import web

from common.errors import ExecutionFailed, FlareError
from frontend.api.json_body import json_response
from frontend.streaming import EventStream, sse

log = logging.getLogger("flare.frontend")

Dialect = Literal["openai", "anthropic", "ollama"]

# Anthropic's documented error types per status (the SDK maps 529 to OverloadedError; we keep docs/design.md's 503).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def dialect_of(request: web.Request) -> Dialect:
    """Anthropic clients share /v1/models with OpenAI ones; their headers tell them apart."""
    if request.path.startswith("/api/"):
        return "ollama"
    if request.path.startswith("/v1/messages") or "anthropic-version" in request.headers \
            or "x-api-key" in request.headers:
        return "anthropic"
    return "openai"


def openai_error_object(error: FlareError) -> dict:
    return {"message": error.display(), "type": error.kind, "param": error.param, "code": str(error.status)}


def anthropic_error_body(error: FlareError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "api_error"),
                                       "message": error.display()}}


def error_body(dialect: Dialect, error: FlareError) -> dict:
    if dialect == "anthropic":
        return anthropic_error_body(error)
    if dialect == "ollama":
        return {"error": error.display()}
    return {"error": openai_error_object(error)}


def error_response(dialect: Dialect, error: FlareError) -> web.Response:
    return json_response(error_body(dialect, error), status=error.status)


def anthropic_error_event(error: FlareError) -> bytes:
    return sse(anthropic_error_body(error), "error")


def openai_error_event(error: FlareError) -> bytes:
    """openai-python raises APIError on any data object with an `error` key; [DONE] then ends the stream."""
    return sse({"error": openai_error_object(error)})


def as_flare_error(exc: Exception) -> FlareError:
    """What a stream tells its client when it fails after the headers went out; a bug is logged, not shown."""
    if isinstance(exc, FlareError):
        return exc
    log.error("unexpected failure in a stream", exc_info=exc)
    return ExecutionFailed("internal error while streaming the response")


async def finish_openai_stream(stream: EventStream, body: Awaitable[None]) -> web.StreamResponse:
    """Run an OpenAI stream's body; a failure becomes the error event (the client's SDK raises on it); then
    `data: [DONE]` and the end of the stream, whatever happened (a gone client excepted)."""
    try:
        await body
    except ConnectionResetError:
        raise
    except Exception as exc:
        stream.add(openai_error_event(as_flare_error(exc)))
    stream.add(sse("[DONE]"))
    return await stream.close()
