"""The frontend's side of the wire: a DEALER socket, one queue per in-flight request, heartbeats both ways."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from common import protocol as wire
from common.errors import EngineUnavailable, FlareError, error_for_status

log = logging.getLogger("flare.frontend")

MISSED_HEARTBEATS = 5  # an engine silent this many intervals is unreachable


@dataclass(frozen=True)
class Update:
    """One engine step's news for one request."""

    token_ids: list[int]
    finish_reason: str | None
    error: FlareError | None
    prompt_tokens: int
    cached_tokens: int


class EngineClient:
    def __init__(self, address: str, frontend_id: str | None = None) -> None:
        self.address = address
        self.frontend_id = frontend_id or f"frontend-{uuid.uuid4().hex[:8]}"
        self.welcome: wire.Welcome | None = None
        self.draining = False
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.frontend_id.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._queues: dict[str, asyncio.Queue[Update]] = {}
        self._last_heard = 0.0
        self._welcomed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def connected(self) -> bool:
        return self.welcome is not None and self._alive()

    def _alive(self) -> bool:
        interval = self.welcome.heartbeat_interval if self.welcome else 1.0
        return time.monotonic() - self._last_heard < MISSED_HEARTBEATS * interval

    async def start(self, timeout: float = 600.0) -> wire.Welcome:
        self._socket.connect(self.address)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._keepalive())]
        await self._send(wire.Hello(wire.PROTOCOL_VERSION, self.frontend_id))
        await asyncio.wait_for(self._welcomed.wait(), timeout)
        assert self.welcome is not None
        return self.welcome

    async def close(self) -> None:
        await self._send(wire.Goodbye(self.frontend_id))
        for task in self._tasks:
            task.cancel()
        self._socket.close()
        self._context.term()

    async def submit(self, submit: wire.Submit) -> asyncio.Queue[Update]:
        if not self.connected:
            raise EngineUnavailable("the engine is unreachable")
        if self.draining:
            raise EngineUnavailable("the engine is draining and admits no new requests")
        queue: asyncio.Queue[Update] = asyncio.Queue()
        self._queues[submit.request_id] = queue
        await self._send(submit)
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel a request. Synchronous, so it also works from a generator being closed or cancelled."""
        if self._queues.pop(request_id, None) is not None:
            self._socket.send(wire.encode(wire.Abort([request_id])))

    def release(self, request_id: str) -> None:
        """The request finished: forget its queue."""
        self._queues.pop(request_id, None)

    async def _send(self, message: wire.FrontendMessage) -> None:
        await self._socket.send(wire.encode(message))

    async def _read(self) -> None:
        while True:
            data = await self._socket.recv()
            try:
                message = wire.decode_engine_message(data)
            except Exception as exc:
                log.warning("undecodable message from the engine: %s", exc)
                continue
            self._last_heard = time.monotonic()
            if isinstance(message, wire.Outputs):
                self._dispatch(message)
            elif isinstance(message, wire.Rejected):
                queue = self._queues.pop(message.request_id, None)
                if queue is not None:
                    error = error_for_status(message.status, message.message, message.hint)
                    queue.put_nowait(Update([], "error", error, 0, 0))
            elif isinstance(message, wire.Heartbeat):
                self.draining = message.draining
            elif isinstance(message, wire.Welcome):
                self.welcome = message
                self._welcomed.set()

    def _dispatch(self, outputs: wire.Outputs) -> None:
        for i, request_id in enumerate(outputs.request_ids):
            queue = self._queues.get(request_id)
            if queue is None:
                continue
            reason = outputs.finish_reasons[i]
            message = outputs.errors[i]
            error = error_for_status(500, message) if message else None
            queue.put_nowait(Update(outputs.token_ids[i], reason, error, outputs.prompt_tokens[i],
                                    outputs.cached_tokens[i]))

    async def _keepalive(self) -> None:
        """Say hello every interval (the engine's liveness check of us); fail requests if the engine went quiet."""
        while True:
            interval = self.welcome.heartbeat_interval if self.welcome else 1.0
            await asyncio.sleep(interval)
            await self._send(wire.Hello(wire.PROTOCOL_VERSION, self.frontend_id))
            if self.welcome is not None and not self._alive() and self._queues:
                log.warning("the engine stopped answering; failing %d requests", len(self._queues))
                for queue in self._queues.values():
                    queue.put_nowait(Update([], "error", EngineUnavailable("the engine is unreachable"), 0, 0))
                self._queues.clear()
