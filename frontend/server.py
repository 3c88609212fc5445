"""The aiohttp application: Host and Origin checks, auth, the body read against its size and time bounds, then
admission; errors in the dialect's shape; lifecycle (docs/design.md, Trust boundaries)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from common.errors import (BodyTooLarge, EngineUnavailable, FlareError, FrontendBusy, InvalidRequest, NotFound,
                            RequestTimeout, Unauthorized, UnsupportedMediaType)
from frontend.api.errors import dialect_of, error_response
from frontend.api.json_body import json_response
from frontend.heap import HeapTrim
from frontend.images.decode import ImageLimits
from frontend.limits import BODIES_IN_FLIGHT, BODY_TIMEOUT, OFFLOAD_JSON_BYTES, RETRY_AFTER_SECONDS, SMALL_BODY_BYTES
from frontend.model import ServedModel
from frontend.origins import OriginPolicy
from frontend.replicas import Replicas

log = logging.getLogger("flare.frontend")

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The chat page (chat_page.py) loads without a key and asks for one; its API calls carry it.
OPEN_PATHS = ("/health", "/metrics", "/")
OPEN_PREFIX = "/static/"


class Frontend:
    """State shared by the handlers of one frontend process."""

    def __init__(self, model: ServedModel, client: Replicas, workers: int, capacity: int,
                 api_key: str | None, image_limits: ImageLimits = ImageLimits(),
                 origins: OriginPolicy = OriginPolicy(loopback_only=True), body_timeout: float = BODY_TIMEOUT) -> None:
        self.model = model
        self.origins = origins
        self.body_timeout = body_timeout
        self.image_limits = image_limits
        self.client = client
        self.capacity = capacity
        self.api_key = api_key
        self.in_use = 0
        self.reading_bytes = 0  # Content-Length of the bodies being read now
        self.heap = HeapTrim()
        self.pool_busy = 0
        self.draining = False
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="frontend-worker")

    async def on_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work (template rendering, tokenization, images, grammar validation, large JSON bodies) on the bounded
        worker pool. Its queue is bounded by admission: an admitted request waits on one job at a time (one per image
        while its images are prepared), and a request past the capacity is a 429 with Retry-After before it queues
        anything."""
        self.pool_busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.pool_busy -= 1


FRONTEND_KEY = web.AppKey("frontend", Frontend)


def frontend_of(request: web.Request) -> Frontend:
    return request.app[FRONTEND_KEY]


async def read_body(request: web.Request, frontend: Frontend) -> bytes:
    """The whole body, within the size limit (413) and --body-timeout (408): a client that trickles its body holds a
    connection for that long at most, and no admission slot meanwhile. The large bodies being read at once are
    bounded in bytes (429 past BODIES_IN_FLIGHT largest ones)."""
    declared = request.content_length
    size = min(request.client_max_size if declared is None else declared, request.client_max_size)
    size = 0 if size <= SMALL_BODY_BYTES else size
    if size and frontend.reading_bytes + size > BODIES_IN_FLIGHT * request.client_max_size:
        raise FrontendBusy(f"the frontend is reading {frontend.reading_bytes} bytes of request bodies already",
                           "capacity_hint: add frontends")
    frontend.reading_bytes += size
    timeout = frontend.body_timeout
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"the request body is over the limit of {request.client_max_size} bytes",
                           "body_limit: raise --body-limit of flare-frontend") from None
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} seconds",
                             "body_timeout: raise --body-timeout of flare-frontend") from None
    finally:
        frontend.reading_bytes -= size
        if size:
            frontend.heap.after_large_body()


async def read_json(request: web.Request) -> dict:
    """The body (already read by the guard) as a JSON object; a large one is parsed on the worker pool."""
    raw = await request.read()
    if len(raw) > OFFLOAD_JSON_BYTES:
        return await frontend_of(request).on_pool(parse_json, raw)
    return parse_json(raw)


# msgspec's decoder: a third faster than json's on bodies of many small values, which hold the interpreter's lock
# (and so the event loop) for as long as they parse, even on the worker pool. Floats as json reads them (1e400 is
# inf, for the field's own check to name).
BODY_DECODER = msgspec.json.Decoder(float_hook=float)


def parse_json(raw: bytes) -> dict:
    try:
        body = BODY_DECODER.decode(raw)
    except msgspec.ValidationError as exc:  # an integer literal of thousands of digits
        raise InvalidRequest(f"the request body holds a number out of range: {str(exc)[:80]}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host, origin, auth, body, admission, and errors: every failure leaves as the dialect's JSON, never a
    traceback. Cheap checks come first; a request counts against admission only once its body is read."""
    frontend = frontend_of(request)
    dialect = dialect_of(request)
    admitted = False
    try:
        frontend.origins.check_host(request)
        if request.method == "OPTIONS":
            return frontend.origins.preflight(request)
        frontend.origins.check_origin(request)
        if frontend.api_key and request.path not in OPEN_PATHS and not request.path.startswith(OPEN_PREFIX):
            check_api_key(request, frontend.api_key)
        if request.method == "POST":
            if frontend.draining:
                raise EngineUnavailable("the server is draining and admits no new requests")
            if request.content_type != "application/json":
                # A browser page may send text/plain (or no type) to any server without asking first.
                raise UnsupportedMediaType(f"the request body must be JSON sent as Content-Type: application/json, "
                                           f"not {request.headers.get('Content-Type', 'none')[:60]!r}")
            await read_body(request, frontend)
            if frontend.in_use >= frontend.capacity:
                raise FrontendBusy(f"the frontend is at its admission capacity ({frontend.capacity} requests)",
                                   "capacity_hint: raise --capacity of flare-frontend or add frontends")
            frontend.in_use += 1
            admitted = True
        return await handler(request)
    except FlareError as exc:
        response = error_response(dialect, exc)
        if exc.status in (429, 503):
            response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        if exc.status == 408:
            response.force_close()  # the rest of the body may still come; the connection cannot be reused
        return response
    except web.HTTPNotFound:
        return error_response(dialect, NotFound(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return error_response(dialect, InvalidRequest(f"{request.method} is not allowed on {request.path}"))
    except web.HTTPException as exc:  # aiohttp's own refusals, rendered like ours
        if exc.status < 400:
            raise
        error = BodyTooLarge if exc.status == 413 else InvalidRequest
        return error_response(dialect, error(f"{exc.reason} on {request.method} {request.path}"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected failure on %s", request.path)
        return error_response(dialect, FlareError("internal error while handling the request"))
    finally:
        if admitted:
            frontend.in_use -= 1


def check_api_key(request: web.Request, api_key: str) -> None:
    header = request.headers.get("Authorization", "")
    token = header[7:] if header.startswith("Bearer ") else request.headers.get("x-api-key", "")
    # Header bytes that are not UTF-8 arrive as lone surrogates (aiohttp decodes with surrogateescape): compare the
    # original bytes, which never match a key given as text.
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode()):
        raise Unauthorized("missing or wrong API key")


async def health(request: web.Request) -> web.Response:
    frontend = frontend_of(request)
    if frontend.client.connected and not frontend.draining:
        replicas = [{"connected": r.client.connected, "load": r.load(), "routed": r.routed,
                     "cached_blocks": len(r.keys)} for r in frontend.client.replicas]
        return json_response({"status": "ok", "replicas": replicas})
    raise EngineUnavailable("the engine is unreachable" if not frontend.client.connected else "draining")
