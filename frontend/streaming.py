"""Server-sent events: framing, opening a stream, and waiting for the engine's first answer before opening it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TypeVar

from aiohttp import web

T = TypeVar("T")


def sse(payload: dict | str, event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (Anthropic and Responses streams name every event)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


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
