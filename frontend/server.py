"""The aiohttp application: admission before the body is read, auth, errors in the dialect's shape, lifecycle."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from common.errors import (BodyTooLarge, EngineUnavailable, FlareError, FrontendBusy, InvalidRequest, NotFound,
                            Unauthorized)
from frontend.api.errors import dialect_of, error_response
from frontend.api.json_body import json_response
from frontend.images.decode import ImageLimits
from frontend.model import ServedModel
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
                 api_key: str | None, image_limits: ImageLimits = ImageLimits()) -> None:
        self.model = model
        self.image_limits = image_limits
        self.client = client
        self.capacity = capacity
        self.api_key = api_key
        self.in_use = 0
        self.pool_busy = 0
        self.draining = False
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="frontend-worker")

    async def on_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work (template rendering, tokenization, images) on the bounded worker pool."""
        self.pool_busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.pool_busy -= 1


FRONTEND_KEY = web.AppKey("frontend", Frontend)


def frontend_of(request: web.Request) -> Frontend:
    return request.app[FRONTEND_KEY]


async def read_json(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(f"the request body is over the limit of {request.client_max_size} bytes",
                           "body_limit: raise --body-limit of flare-frontend") from None
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                             f"{exc.colno}") from None
    except ValueError as exc:  # an integer literal of thousands of digits
        raise InvalidRequest(f"the request body holds a number out of range: {str(exc)[:80]}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Auth, admission, and errors: every failure leaves as the dialect's JSON, never a traceback."""
    frontend = frontend_of(request)
    dialect = dialect_of(request)
    admitted = False
    try:
        if frontend.api_key and request.path not in OPEN_PATHS and not request.path.startswith(OPEN_PREFIX):
            check_api_key(request, frontend.api_key)
        if request.method == "POST":
            if frontend.draining:
                raise EngineUnavailable("the server is draining and admits no new requests")
            if frontend.in_use >= frontend.capacity:
                raise FrontendBusy(f"the frontend is at its admission capacity ({frontend.capacity} requests)",
                                   "capacity_hint: raise --capacity of flare-frontend or add frontends")
            frontend.in_use += 1
            admitted = True
        return await handler(request)
    except FlareError as exc:
        return error_response(dialect, exc)
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
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise Unauthorized("missing or wrong API key")


async def health(request: web.Request) -> web.Response:
    frontend = frontend_of(request)
    if frontend.client.connected and not frontend.draining:
        replicas = [{"connected": r.client.connected, "load": r.load(), "routed": r.routed, "cached_blocks": len(r.keys)}
                    for r in frontend.client.replicas]
        return json_response({"status": "ok", "replicas": replicas})
    raise EngineUnavailable("the engine is unreachable" if not frontend.client.connected else "draining")
