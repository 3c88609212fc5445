"""Server-sent events: framing, opening a stream, and waiting for the engine's first answer before opening it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

from aiohttp import web

from frontend.json_body import json_bytes

T = TypeVar("T")


def sse(payload: dict | str, event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (Anthropic and Responses streams name every event)."""
    data = payload.encode() if isinstance(payload, str) else json_bytes(payload)
    return (b"event: " + event.encode() + b"\n" if event else b"") + b"data: " + data + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response


async def primed(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first event before a stream's headers go out, so that a request the engine rejects (full,
    draining, too long) still gets its plain HTTP status instead of a 200 that carries an error event."""
    first = await anext(events)

    async def replay() -> AsyncIterator[T]:
        yield first
        async for event in events:
            yield event

    return replay()
