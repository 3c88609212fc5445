"""The frontend's side of the wire: a DEALER socket, one queue per in-flight request, heartbeats both ways."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common import protocol as wire
from common.errors import EngineUnavailable, FlareError, error_for_status
from common.links import FIXED_FRAME_BYTES, Drops, LinkKeys, bound

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
    logprobs: wire.Logprobs | None = None
    prompt_logprobs: wire.Logprobs | None = None
    label_logits: list[list[float]] | None = None  # a scored prefill's, with its finish
    embedding: bytes | None = None  # an embedding's vector (little-endian float32), with its finish


def failure(error: FlareError) -> Update:
    return Update([], "error", error, 0, 0)


class EngineClient:
    def __init__(self, address: str, frontend_id: str | None = None, keys: LinkKeys | None = None,
                 frame_limit: int = FIXED_FRAME_BYTES) -> None:
        self.address = address
        self.frontend_id = frontend_id or f"frontend-{uuid.uuid4().hex[:8]}"
        self.keys, self.frame_limit = keys, frame_limit  # the telemetry subscription uses them too
        self.welcome: wire.Welcome | None = None
        self.draining = False
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.frontend_id.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        bound(self._socket, frame_limit)  # an engine that sends more is cut off (and reconnected)
        if keys:
            keys.join(self._socket)
        self._drops = Drops(log, f"engine {address}")
        # Queue nothing for an engine that is not there: a Submit held back while the engine was down would reach
        # its successor, which would then run a request nobody waits for.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
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

    @property
    def in_flight(self) -> int:
        """Requests of this frontend that the engine is running."""
        return len(self._queues)

    def connect(self) -> None:
        """Start talking to the engine; ZMQ keeps reconnecting while it is away, and each (re)start welcomes us."""
        self._socket.connect(self.address)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._keepalive()),
                       asyncio.create_task(self._watch())]

    async def welcomed(self) -> wire.Welcome:
        await self._welcomed.wait()
        assert self.welcome is not None
        return self.welcome

    async def start(self, timeout: float = 600.0) -> wire.Welcome:
        self.connect()
        return await asyncio.wait_for(self.welcomed(), timeout)

    async def close(self) -> None:
        self._send(wire.Goodbye(self.frontend_id))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()
        self._context.term()

    async def submit(self, submit: wire.Submit) -> asyncio.Queue[Update]:
        if not self.connected:
            raise EngineUnavailable("the engine is unreachable")
        if self.draining:
            raise EngineUnavailable("the engine is draining and admits no new requests")
        if not self._send(submit):
            raise EngineUnavailable("the engine is unreachable (its socket is not accepting messages)")
        queue: asyncio.Queue[Update] = asyncio.Queue()
        self._queues[submit.request_id] = queue
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel a request. Synchronous, so it also works from a generator being closed or cancelled."""
        if self._queues.pop(request_id, None) is not None:
            self._send(wire.Abort([request_id]))

    def release(self, request_id: str) -> None:
        """The request finished: forget its queue."""
        self._queues.pop(request_id, None)

    def _send(self, message: wire.FrontendMessage) -> bool:
        """Never waits (it runs in request handlers and generator finalizers): False when no engine is connected
        or its pipe is full, and the message is dropped. With NOBLOCK the asyncio socket settles the future at
        once; sending through it, not a plain shadow socket, keeps its edge-triggered read wakeups right."""
        sent = self._socket.send(wire.encode(message), zmq.NOBLOCK)
        if not sent.done():
            sent.cancel()
            return False
        return sent.exception() is None

    def _fail_all(self, error: FlareError) -> None:
        if self._queues:
            log.warning("failing %d in-flight requests: %s", len(self._queues), error.message)
        for queue in self._queues.values():
            queue.put_nowait(failure(error))
        self._queues.clear()

    def _lose_engine(self, why: str) -> None:
        """Until the engine (or its successor) welcomes us again, requests get 503; open ones end now."""
        self.welcome = None
        self._fail_all(EngineUnavailable(f"the engine is unreachable: {why}"))

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 1:
                self._drops.drop(self.address, f"{len(frames)} frames where a message has one")
                continue
            try:
                message = wire.decode_engine_message(frames[0])
            except Exception as exc:
                self._drops.drop(self.address, f"undecodable: {exc}")
                continue
            self._last_heard = time.monotonic()
            if isinstance(message, wire.Outputs):
                self._dispatch(message)
            elif isinstance(message, wire.Rejected):
                queue = self._queues.pop(message.request_id, None)
                if queue is not None:
                    queue.put_nowait(failure(error_for_status(message.status, message.message, message.hint)))
            elif isinstance(message, wire.Heartbeat):
                self.draining = message.draining
            elif isinstance(message, wire.Welcome):
                self._welcome(message)

    def _welcome(self, welcome: wire.Welcome) -> None:
        previous = self.welcome
        if previous is not None and previous.engine_id != welcome.engine_id:
            # A restarted engine knows nothing of what its predecessor was running.
            self._fail_all(EngineUnavailable(f"the engine restarted (now {welcome.engine_id})"))
        if previous is None or previous.engine_id != welcome.engine_id:
            log.info("connected to engine %s", welcome.engine_id)
        self.welcome = welcome
        self.draining = False
        self._welcomed.set()

    def _dispatch(self, outputs: wire.Outputs) -> None:
        for i, request_id in enumerate(outputs.request_ids):
            queue = self._queues.get(request_id)
            if queue is None:
                continue
            message = outputs.errors[i]
            queue.put_nowait(Update(
                outputs.token_ids[i], outputs.finish_reasons[i], error_for_status(500, message) if message else None,
                outputs.prompt_tokens[i], outputs.cached_tokens[i],
                outputs.logprobs[i] if i < len(outputs.logprobs) else None,
                outputs.prompt_logprobs[i] if i < len(outputs.prompt_logprobs) else None,
                outputs.label_logits[i] if i < len(outputs.label_logits) else None,
                outputs.embeddings[i] if i < len(outputs.embeddings) else None))

    async def _keepalive(self) -> None:
        """Say hello every interval: the engine's liveness check of us, and how a restarted engine learns of us.
        An engine silent for several intervals is treated as gone."""
        while True:
            self._send(wire.Hello(wire.PROTOCOL_VERSION, self.frontend_id))
            await asyncio.sleep(self.welcome.heartbeat_interval if self.welcome else 1.0)
            if self.welcome is not None and not self._alive():
                self._lose_engine("no heartbeat")

    def _confirm_loss(self, disconnected_at: float) -> None:
        if self.welcome is not None and self._last_heard < disconnected_at:
            self._lose_engine("the connection closed")

    async def _watch(self) -> None:
        """The socket's own events: a dead engine is noticed within an interval, a new one is greeted at once."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and self.welcome is not None:
                # Confirmed by silence: a live engine heartbeats every interval on whatever connection is left.
                asyncio.get_running_loop().call_later(self.welcome.heartbeat_interval * 1.5, self._confirm_loss,
                                                      time.monotonic())
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._send(wire.Hello(wire.PROTOCOL_VERSION, self.frontend_id))
