"""Server-sent events: framing, opening a stream, and waiting for the engine's first answer before opening it.

A stream writes what one generation event (frontend/generation.py) makes in one write, the headers with the first,
and what the last one makes with the end of the stream: one system call and one TCP segment where a write per
server-sent event took six for a short OpenAI chat and eight for an Anthropic one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

from aiohttp import web

from frontend.api.json_body import json_bytes

T = TypeVar("T")


def sse(payload: dict | str, event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (Anthropic and Responses streams name every event)."""
    data = payload.encode() if isinstance(payload, str) else json_bytes(payload)
    return (b"event: " + event.encode() + b"\n" if event else b"") + b"data: " + data + b"\n\n"


class _HeldHeadersResponse(web.StreamResponse):
    # aiohttp sends a StreamResponse's headers at prepare() (its Response holds them for the body); held, they
    # leave with the first events. An aiohttp without this attribute sends them at once, as before.
    _send_headers_immediately = False


class EventStream:
    """An open stream. Events added are held until `flush` (a dialect flushes after each generation event but the
    last, so nothing is held while it waits for the engine) or `close` (the end of the stream)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self._held: list[bytes] = []

    def add(self, event: bytes) -> None:
        self._held.append(event)

    async def flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            await self.response.write(data)

    async def close(self) -> web.StreamResponse:
        """Write what is held and end the stream, in one write."""
        data = b"".join(self._held)
        self._held.clear()
        await self.response.write_eof(data)
        return self.response


async def open_stream(request: web.Request, content_type: str = "text/event-stream") -> EventStream:
    """Server-sent events, or another framing of one event after another (Ollama's newline-delimited JSON)."""
    response = _HeldHeadersResponse(headers={"Content-Type": content_type, "Cache-Control": "no-cache",
                                             "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return EventStream(response)


async def primed(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first event before a stream's headers go out, so that a request the engine rejects (full,
    draining, too long) still gets its plain HTTP status instead of a 200 that carries an error event."""
    first = await anext(events)

    async def replay() -> AsyncIterator[T]:
        yield first
        async for event in events:
            yield event

    return replay()
