"""The step channel: rank 0 tells the other ranks which step to run next, and hears back from them.

Per step: Prepare (rank 0 sends the fence and the Plan) -> Ready (each rank has validated it) -> Commit (rank 0
releases it once every rank is ready) -> every rank runs it, collectives inside the forward -> Done (each rank's
sampled tokens, which rank 0 checks against its own before it publishes); a step with disk work, later, DiskWorkDone
once its files are written and read. No rank enters a step's collectives unless every rank has accepted the step, so
a rank that cannot run it fails the group with a reason instead of leaving the others blocked in a collective.

ZeroMQ over TCP rather than torch.distributed: the descriptor is Python data, which NCCL can carry only through GPU
buffers and host syncs; ZeroMQ sends never block rank 0's loop; every wait has a timeout; and a heartbeat runs while
no step does, when no collective would notice a dead peer. Rank 0 binds a ROUTER, every other rank connects a DEALER
named by its rank; the address travels through the group's TCPStore. Messages are msgspec MessagePack, so a
malformed one fails to decode instead of running. With the deployment's link keys the channel runs CURVE (rank 0
is the server, the other ranks are its peers), and every frame is bounded (docs/design.md, Trust boundaries): a
message of another shape or from another identity is dropped, never decoded.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace

import msgspec
import zmq

from common.links import Drops, LinkKeys, bound
from engine.parallel.group import TensorParallel
from engine.scheduler.plan import Plan

log = logging.getLogger("flare.engine")

BEAT_INTERVAL = 0.5  # seconds: each side sends something at least this often
SILENCE_LIMIT = 5.0  # seconds: a peer silent this long is dead or unreachable; an answer late this long failed
ENDPOINT_KEY = "flare/step-channel"
# Seconds for every rank to load its shard, then to build its executor (graph capture is slow). No heartbeat runs
# before both are done: a rank that dies meanwhile is caught by the supervisor, or by this timeout.
SETUP_TIMEOUT = 600.0


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class Hello(_Message, tag="hello"):
    num_pages: int  # KV pages this rank's budget holds
    host_slots: int  # host-tier pages its host budget holds
    host_snapshots: int = 0  # and a hybrid model's host snapshot rows


class Setup(_Message, tag="setup"):
    num_pages: int
    max_active: int
    host_slots: int
    host_snapshots: int = 0


# After setup, Ready and Commit of fence 0 are the start barrier: every rank has built its executor.
START = 0


class Prepare(_Message, tag="prepare"):
    fence: int
    plan: Plan


class Ready(_Message, tag="ready"):
    fence: int


class Commit(_Message, tag="commit"):
    fence: int


class Done(_Message, tag="done"):
    fence: int
    tokens: tuple[int, ...]


class DiskWorkDone(_Message, tag="disk-done"):
    """A step's disk work ended on this rank (after the step's Done, whenever its files are written and read)."""

    fence: int
    unreadable: tuple[int, ...] = ()  # host slots of the step's disk reads whose files this rank could not serve
    seconds: float = 0.0  # what the work took on this rank's disk thread


class Beat(_Message, tag="beat"):
    pass


class Failed(_Message, tag="failed"):
    reason: str


class Stop(_Message, tag="stop"):
    reason: str | None = None  # None: a clean stop


Message = Hello | Setup | Prepare | Ready | Commit | Done | DiskWorkDone | Beat | Failed | Stop
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


class RankFailure(Exception):
    """A rank died, went silent, or could not run a step: the group cannot go on."""


def _decode(payload: bytes, sender: str) -> _Message:
    try:
        return _decoder.decode(payload)
    except msgspec.MsgspecError as exc:  # another version of Flare, or corruption: the ranks cannot agree
        raise RankFailure(f"{sender} sent an undecodable message ({exc})") from None


class Leader:
    """Rank 0's end: one ROUTER that every other rank's DEALER connects to."""

    def __init__(self, tp: TensorParallel, host: str, keys: LinkKeys | None, frame_limit: int) -> None:
        self.ranks = range(1, tp.world_size)
        self._context = zmq.Context()
        self._authenticator = keys.authenticate(self._context) if keys else None
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a rank whose connection closed raises
        self.socket.setsockopt(zmq.LINGER, 1000)
        bound(self.socket, frame_limit)
        if keys:
            keys.serve(self.socket)
        self._drops = Drops(log, "step channel")
        address = socket.gethostbyname(host)
        port = self.socket.bind_to_random_port(f"tcp://{address}")
        tp.store.set(ENDPOINT_KEY, f"tcp://{address}:{port}")
        self._heard = {rank: time.monotonic() for rank in self.ranks}
        self._live = False  # silence counts only once every rank has started
        self._sent = 0.0
        self._inbox: dict[tuple[type, int], dict[int, _Message]] = {}  # (kind, fence) -> rank -> message
        self._failed: dict[int, str] = {}

    def setup(self, num_pages: int, max_active: int, host_slots: int, host_snapshots: int = 0
              ) -> tuple[int, int, int, int]:
        """Wait for every rank's Hello; all ranks use the fewest KV and host-tier pages (and host snapshot rows) any
        of them holds (a rank's pages are its shard of the KV heads, which need not split evenly), and rank 0's
        slots."""
        hellos = self._gather(Hello, 0, SETUP_TIMEOUT)
        num_pages = min([num_pages] + [hello.num_pages for hello in hellos.values()])
        host_slots = min([host_slots] + [hello.host_slots for hello in hellos.values()])
        host_snapshots = min([host_snapshots] + [hello.host_snapshots for hello in hellos.values()])
        self._send_all(Setup(num_pages, max_active, host_slots, host_snapshots))
        return num_pages, max_active, host_slots, host_snapshots

    def start(self) -> None:
        """Wait until every rank has built its executor, then start the heartbeat."""
        self._gather(Ready, START, SETUP_TIMEOUT)
        self._send_all(Commit(START))
        self._heard = dict.fromkeys(self.ranks, time.monotonic())
        self._live = True

    def prepare(self, fence: int, plan: Plan) -> None:
        """Send the step and wait until every rank is ready to run it."""
        if type(plan.rows) is not tuple:  # a steady decode step's columns (DecodeRows) travel as Rows
            plan = replace(plan, rows=tuple(plan.rows))
        self._send_all(Prepare(fence, plan))
        self._gather(Ready, fence, SILENCE_LIMIT)

    def commit(self, fence: int) -> None:
        self._send_all(Commit(fence))

    def done(self, fence: int) -> dict[int, Done]:
        """Every other rank's report of a step that rank 0 has completed."""
        return self._gather(Done, fence, SILENCE_LIMIT)

    def disk_done(self, fence: int) -> dict[int, DiskWorkDone] | None:
        """Every other rank's report that the step's disk work ended, once all have sent it (None until then)."""
        if len(self._inbox.get((DiskWorkDone, fence), {})) < len(self.ranks):
            return None
        return self._inbox.pop((DiskWorkDone, fence))

    def tick(self) -> None:
        """Read what arrived, beat when due, and fail on a rank that went silent or gave up."""
        self._receive(0)
        if time.monotonic() - self._sent > BEAT_INTERVAL:
            self._send_all(Beat())
        self._check()

    def stop(self, reason: str | None = None) -> None:
        """Tell every rank to exit (cleanly when no reason is given); ranks already gone are skipped."""
        for rank in self.ranks:
            try:
                self._send(rank, Stop(reason))
            except RankFailure:
                pass

    def diagnose(self, failure: str) -> str:
        """After a failure, find its cause: listen for a moment for ranks that report their own failure, and probe
        for ranks whose connection closed. A dead rank is the likely cause (the others' collectives then fail), so
        it heads the answer; everything seen goes to the log."""
        gone: set[int] = set()
        deadline = time.monotonic() + 2 * BEAT_INTERVAL
        while time.monotonic() < deadline and len(gone | set(self._failed)) < len(self.ranks):
            self._receive(100)
            for rank in set(self.ranks) - gone - set(self._failed):
                try:
                    self._send(rank, Beat())
                except RankFailure:
                    gone.add(rank)
        dead = [f"rank {r} died (its connection closed)" for r in sorted(gone - set(self._failed))]
        reports = [f"rank {r} failed: {why}" for r, why in sorted(self._failed.items())]
        log.error("tensor-parallel group failure; first sign: %s; then: %s", failure, "; ".join(dead + reports))
        return "; ".join(dead or reports or [failure])

    def close(self) -> None:
        """Flush what is queued (for at most a second), then close."""
        self.socket.close(linger=1000)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # --- plumbing -----------------------------------------------------------------------------------------------
    def _gather(self, kind: type, fence: int, timeout: float) -> dict[int, _Message]:
        deadline = time.monotonic() + timeout
        while len(answers := self._inbox.get((kind, fence), {})) < len(self.ranks):
            self._check()
            if time.monotonic() > deadline:
                missing = ", ".join(str(r) for r in self.ranks if r not in answers)
                raise RankFailure(f"rank {missing} sent no {kind.__name__} for step {fence} within {timeout:.0f}s")
            if self._live and time.monotonic() - self._sent > BEAT_INTERVAL:
                self._send_all(Beat())
            self._receive(int(BEAT_INTERVAL * 1000))
        return self._inbox.pop((kind, fence))

    def _receive(self, timeout_ms: int) -> None:
        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            rank = int(frames[0]) if frames[0].isdigit() else -1
            if rank not in self._heard or len(frames) != 2:
                self._drops.drop(frames[0], f"{len(frames) - 1} frames where a message has one" if rank in self._heard
                                 else "not a rank of this group")
                continue
            self._heard[rank] = time.monotonic()
            message = _decode(frames[1], f"rank {rank}")
            if isinstance(message, Failed):
                self._failed[rank] = message.reason
            elif not isinstance(message, Beat):
                self._inbox.setdefault((type(message), getattr(message, "fence", 0)), {})[rank] = message

    def _check(self) -> None:
        if self._failed:
            rank, reason = next(iter(self._failed.items()))
            raise RankFailure(f"rank {rank} failed: {reason}")
        now = time.monotonic()
        for rank, heard in self._heard.items():
            if self._live and now - heard > SILENCE_LIMIT:
                raise RankFailure(f"rank {rank} has been silent for {now - heard:.1f}s (dead, stuck, or unreachable)")

    def _send_all(self, message: _Message) -> None:
        payload = _encoder.encode(message)
        for rank in self.ranks:
            self._send(rank, payload)
        self._sent = time.monotonic()

    def _send(self, rank: int, message: _Message | bytes) -> None:
        payload = message if isinstance(message, bytes) else _encoder.encode(message)
        try:
            self.socket.send_multipart([str(rank).encode(), payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its connection closed; EAGAIN: it stopped reading
            raise RankFailure(f"rank {rank} is unreachable ({exc})") from None


class Follower:
    """The end of a rank > 0: a DEALER named by its rank, connected to rank 0's ROUTER."""

    def __init__(self, tp: TensorParallel, keys: LinkKeys | None, frame_limit: int) -> None:
        endpoint = tp.store.get(ENDPOINT_KEY).decode()  # waits until rank 0 has bound it
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, str(tp.rank).encode())
        self.socket.setsockopt(zmq.LINGER, 1000)
        bound(self.socket, frame_limit)
        if keys:
            keys.join(self.socket)
        self._drops = Drops(log, "step channel")
        self.socket.connect(endpoint)
        self._heard = time.monotonic()
        self._sent = 0.0

    def setup(self, num_pages: int, max_active: int, host_slots: int, host_snapshots: int = 0
              ) -> tuple[int, int, int, int]:
        """Offer this rank's KV and host-tier pages (and host snapshot rows); rank 0 answers with the pages, slots
        and rows every rank uses."""
        self.send(Hello(num_pages, host_slots, host_snapshots))
        setup = self._await(Setup)
        return setup.num_pages, setup.max_active, setup.host_slots, setup.host_snapshots

    def start(self) -> None:
        """Say this rank's executor is built; wait until rank 0 starts the group."""
        self.send(Ready(START))
        self._await(Commit)
        self._heard = time.monotonic()

    def _await(self, kind: type) -> _Message:
        deadline = time.monotonic() + SETUP_TIMEOUT
        while time.monotonic() < deadline:
            for message in self.receive(int(BEAT_INTERVAL * 1000)):
                if isinstance(message, kind):
                    return message
                if isinstance(message, Stop):
                    raise RankFailure(f"rank 0 stopped the group during setup: {message.reason}")
        raise RankFailure(f"rank 0 sent no {kind.__name__} within {SETUP_TIMEOUT:.0f}s")

    def receive(self, timeout_ms: int = 0) -> list[_Message]:
        messages: list[_Message] = []
        if not self.socket.poll(timeout_ms):
            return messages
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 1:
                self._drops.drop("rank 0", f"{len(frames)} frames where a message has one")
                continue
            self._heard = time.monotonic()
            message = _decode(frames[0], "rank 0")
            if not isinstance(message, Beat):
                messages.append(message)
        return messages

    def send(self, message: _Message) -> None:
        try:
            self.socket.send(_encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # no connection to rank 0 (or it stopped reading)
            raise RankFailure(f"rank 0 is unreachable ({exc})") from None
        self._sent = time.monotonic()

    def tick(self) -> None:
        """Beat when due, and fail when rank 0 went silent."""
        if time.monotonic() - self._sent > BEAT_INTERVAL:
            self.send(Beat())
        silent = time.monotonic() - self._heard
        if silent > SILENCE_LIMIT:
            raise RankFailure(f"rank 0 has been silent for {silent:.1f}s (dead, stuck, or unreachable)")

    def fail(self, reason: str) -> None:
        """Tell rank 0 why this rank gives up, if it still listens."""
        try:
            self.send(Failed(reason))
        except RankFailure:
            pass

    def close(self) -> None:
        """Flush what is queued (for at most a second), then close."""
        self.socket.close(linger=1000)
        self._context.term()


def connect(tp: TensorParallel, address: str, keys: LinkKeys | None, frame_limit: int) -> Leader | Follower:
    """Rank 0 binds the channel on the host of --dist-address; every other rank connects to it."""
    return Leader(tp, address.rsplit(":", 1)[0], keys, frame_limit) if tp.rank == 0 else \
        Follower(tp, keys, frame_limit)
