"""The frontend's output path (frontend/streaming.py, frontend/api/json_body.py) in a real aiohttp server: events held
until a flush reach the client before the stream waits again, close writes what is held and ends the stream, and
JSON bodies parse back to what was sent."""

from __future__ import annotations

import asyncio
import json

import numpy as np
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from frontend.api.json_body import json_bytes, json_response
from frontend.streaming import open_stream, sse

PAYLOAD = {"text": "Grüße, 世界 🙂", "none": None, "flag": True, "count": 1 << 62, "ratio": 1e-05,
           "nested": [{"a": [1, 2.5]}], "quote": 'say "hi"\n'}


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_json_bytes_parse_back_to_the_value() -> None:
    assert json.loads(json_bytes(PAYLOAD)) == PAYLOAD
    # A lone surrogate (a client's "\ud800" escape, echoed in an error) has no UTF-8 form: it stays escaped.
    lone = {"model": "x\ud800"}
    assert json.loads(json_bytes(lone)) == lone
    # msgspec refuses float subclasses; json.dumps writes them as floats.
    assert json.loads(json_bytes({"p": np.float64(0.25)})) == {"p": 0.25}


def test_a_flushed_event_reaches_the_client_while_the_stream_waits() -> None:
    async def scenario() -> None:
        engine_step = asyncio.Event()  # what a stream waits for between generation events

        async def handler(request: web.Request) -> web.StreamResponse:
            stream = await open_stream(request)
            stream.add(sse({"n": 1}))
            stream.add(sse({"n": 2}, "named"))
            await stream.flush()
            await engine_step.wait()
            stream.add(sse({"n": 3}))
            stream.add(sse("[DONE]"))
            return await stream.close()

        app = web.Application()
        app.router.add_get("/", handler)
        async with TestServer(app) as server, ClientSession() as session:
            async with session.get(server.make_url("/")) as response:
                assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
                first = b'data: {"n":1}\n\nevent: named\ndata: {"n":2}\n\n'
                received = b""
                while len(received) < len(first):
                    received += await response.content.readany()
                assert received == first
                engine_step.set()
                assert await response.content.read() == b'data: {"n":3}\n\ndata: [DONE]\n\n'

    run(scenario)


def test_json_response_status_and_type() -> None:
    async def scenario() -> None:
        async def handler(_request: web.Request) -> web.Response:
            return json_response(PAYLOAD, status=418)

        app = web.Application()
        app.router.add_get("/", handler)
        async with TestServer(app) as server, ClientSession() as session:
            async with session.get(server.make_url("/")) as response:
                assert response.status == 418
                assert response.headers["Content-Type"] == "application/json; charset=utf-8"
                assert await response.json() == PAYLOAD

    run(scenario)
