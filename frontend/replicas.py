"""Replicas: a connection to every engine group, and the choice of one for each request (docs/design.md, Processes).

Each replica announces its prefix cache on its telemetry socket (block keys stored and evicted, the whole set when a
subscriber arrives); this frontend keeps an approximate index per replica from those announcements, plus the prompts
it routed there itself (their blocks will be cached there before the next announcement comes). Nothing else is shared
between frontends.

The rule (`--routing prefix`, the default), among replicas that are connected and not draining:
1. load = the replica's requests, live and queued (its latest telemetry), or this frontend's own requests on it when
   that is more (telemetry lags by up to half a second).
2. Balance first: when the most loaded replica carries more than `IMBALANCE_ABS` requests more than the least, and
   more than `IMBALANCE_REL` times as many, the request goes to the least loaded.
3. Otherwise, cache: the request goes to the replica whose index holds the longest run of the prompt's leading
   blocks, if that run is at least one block; among equal runs, the least loaded.
4. Otherwise (no block cached anywhere), the least loaded.
Ties go to the replica that caches fewer blocks (every frontend sees the same announcements, so frontends spread new
prefixes alike), then rotate. A replica found unreachable when sending is skipped and the next choice is taken.
`--routing round-robin` rotates over the available replicas regardless, to measure what the rule is worth.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common import protocol as wire
from common.errors import EngineUnavailable
from common.links import FIXED_FRAME_BYTES, Drops, LinkKeys, subscriber
from common.prefix_history import RecentHistories, prefix_events
from frontend.engine_client import EngineClient, Update

log = logging.getLogger("flare.frontend")

IMBALANCE_ABS = 16  # requests
IMBALANCE_REL = 1.5
INDEX_LIMIT = 1 << 20  # keys per replica; past it the index starts over from the next full announcement
ROUTINGS = ("prefix", "round-robin")


@dataclass(eq=False)
class Replica:
    index: int
    client: EngineClient
    keys: set[bytes] = field(default_factory=set)  # block keys it is believed to cache
    telemetry: wire.Telemetry | None = None
    routed: int = 0  # requests this frontend sent it

    @property
    def available(self) -> bool:
        return self.client.connected and not self.client.draining

    def load(self) -> int:
        gauges = self.telemetry.gauges if self.telemetry is not None else {}
        engine = int(gauges.get("live_requests", 0) + gauges.get("pending_requests", 0))
        return max(engine, self.client.in_flight)

    def cached_run(self, keys: list[bytes]) -> int:
        """Leading blocks of the prompt that this replica caches."""
        return next((i for i, key in enumerate(keys) if key not in self.keys), len(keys))

    def announce(self, events: wire.CacheEvents) -> None:
        """Keys on the device and keys in its host tier count alike: a host hit is a restore, not a recompute."""
        if events.full or len(self.keys) > INDEX_LIMIT:
            self.keys = {*events.stored, *events.hosted}
        else:
            self.keys.update(events.stored)
            self.keys.update(events.hosted)
        self.keys.difference_update(events.evicted)


class Replicas:
    """The engine side of a frontend: submit, abort and release as one EngineClient offers them, over N engines."""

    def __init__(self, addresses: list[str], routing: str = "prefix", keys: LinkKeys | None = None,
                 frame_limit: int = FIXED_FRAME_BYTES) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        first = EngineClient(addresses[0], None, keys, frame_limit)
        clients = [first] + [EngineClient(a, first.frontend_id, keys, frame_limit) for a in addresses[1:]]
        self.replicas = [Replica(i, c) for i, c in enumerate(clients)]
        self.routing = routing
        self.frontend_id = first.frontend_id
        self._owner: dict[str, Replica] = {}
        self._turn = itertools.count()
        self._recent: RecentHistories | None = None  # the replicas' prefix keys of recent long prompts
        self._tasks: list[asyncio.Task] = []

    async def start(self, timeout: float = 600.0) -> wire.Welcome:
        """Connect to every replica; ready once one has answered (the others join when they do)."""
        for replica in self.replicas:
            replica.client.connect()
            self._tasks.append(asyncio.create_task(self._follow(replica)))
        waits = [asyncio.create_task(r.client.welcomed()) for r in self.replicas]
        done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in pending:
            wait.cancel()
        if not done:
            raise TimeoutError
        return next(iter(done)).result()

    @property
    def welcome(self) -> wire.Welcome | None:
        return next((r.client.welcome for r in self.replicas if r.client.welcome is not None), None)

    @property
    def connected(self) -> bool:
        return any(r.client.connected for r in self.replicas)

    @property
    def draining(self) -> bool:
        return all(r.client.draining for r in self.replicas if r.client.connected)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.close()

    async def submit(self, submit: wire.Submit) -> asyncio.Queue[Update]:
        """Route and send; a replica found unreachable on sending is skipped for the next choice."""
        tried: set[Replica] = set()
        while True:
            replica = self.choose(submit.prompt, tried, prefix_events(submit.cache_salt, submit.images))
            try:
                queue = await replica.client.submit(submit)
            except EngineUnavailable:
                tried.add(replica)
                continue
            replica.routed += 1
            self._owner[submit.request_id] = replica
            return queue

    async def updates(self, submit: wire.Submit) -> AsyncIterator[Update]:
        """Submit, then yield the request's updates up to its last (one with a finish reason); an update carrying
        an error raises it. Closing the iterator early (wrap it in contextlib.aclosing: a client gone, a stop string
        matched, a failure elsewhere) aborts the request in its engine; a finished one is only forgotten."""
        queue = await self.submit(submit)
        finished = False
        try:
            while True:
                update = await queue.get()
                if update.error is not None:
                    finished = True
                    raise update.error
                finished = update.finish_reason is not None
                yield update
                if finished:
                    return
        finally:
            (self.release if finished else self.abort)(submit.request_id)

    def abort(self, request_id: str) -> None:
        if (replica := self._owner.pop(request_id, None)) is not None:
            replica.client.abort(request_id)

    def release(self, request_id: str) -> None:
        if (replica := self._owner.pop(request_id, None)) is not None:
            replica.client.release(request_id)

    def choose(self, prompt: list[int], exclude: set[Replica] = frozenset(),
               events: list[tuple[int, bytes]] = ()) -> Replica:
        """`events`: the prompt's conditioning (salt, images), which the replicas' prefix keys include."""
        available = [r for r in self.replicas if r.available and r not in exclude]
        if not available:
            if any(r.client.connected and r not in exclude for r in self.replicas):
                raise EngineUnavailable("the engine is draining and admits no new requests")
            raise EngineUnavailable("the engine is unreachable")
        turn = next(self._turn)
        if self.routing == "round-robin" or len(available) == 1:
            return available[turn % len(available)]
        loads = {r: r.load() for r in available}
        least = min(loads.values())
        # Ties go to the replica that caches less (announcements reach every frontend, so frontends spread new
        # prefixes alike), then rotate.
        by_load = sorted(available, key=lambda r: (loads[r], len(r.keys), (r.index - turn) % len(available)))
        if max(loads.values()) - least > IMBALANCE_ABS and max(loads.values()) > IMBALANCE_REL * max(least, 1):
            return by_load[0]
        keys = self._keys(prompt, available, events)
        runs = {r: r.cached_run(keys) for r in available} if keys else {}
        best = max(runs.values(), default=0)
        chosen = next(r for r in by_load if runs.get(r, 0) == best) if best > 0 else by_load[0]
        chosen.keys.update(keys)  # it will cache these blocks: the next turn of this conversation follows
        return chosen

    def _keys(self, prompt: list[int], available: list[Replica], events: list[tuple[int, bytes]]) -> list[bytes]:
        welcome = next((r.client.welcome for r in available if r.client.welcome and r.client.welcome.cache_identity),
                       None)
        if welcome is None or len(prompt) < welcome.page_size:
            return []
        recent = self._recent
        if recent is None or (recent.identity, recent.block_size) != (welcome.cache_identity, welcome.page_size):
            recent = self._recent = RecentHistories(welcome.cache_identity, welcome.page_size)
        return recent.history(prompt, events).block_keys

    async def _follow(self, replica: Replica) -> None:
        """The replica's telemetry: its load for routing and /metrics, and its cache announcements."""
        welcome = await replica.client.welcomed()
        client = replica.client
        socket = subscriber(client.keys, client.frame_limit, wire.TELEMETRY_METRICS_TOPIC, wire.TELEMETRY_CACHE_TOPIC)
        socket.connect(welcome.telemetry_address)
        drops = Drops(log, f"telemetry of replica {replica.index}")
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 2:
                    drops.drop(welcome.telemetry_address, f"{len(frames)} frames where a snapshot has two")
                    continue
                topic, data = frames
                try:
                    if topic == wire.TELEMETRY_METRICS_TOPIC:
                        replica.telemetry = wire.decode_telemetry(data)
                    elif topic == wire.TELEMETRY_CACHE_TOPIC:
                        replica.announce(wire.decode_cache_events(data))
                except Exception as exc:  # a broken announcement must not stop routing
                    drops.drop(welcome.telemetry_address, f"undecodable: {exc}")
        finally:
            socket.close()
