"""Engine telemetry: counters and gauges for /metrics, the prefix cache's announcements for routing, and
graph/request detail for an attached dashboard.

Snapshots go out on an XPUB socket twice a second. Frontends subscribe to METRICS_TOPIC and CACHE_TOPIC; dashboards
to DASHBOARD_TOPIC, and only while one is subscribed does the engine record per-step detail (in a preallocated ring:
recording never blocks the loop, and overflow between two snapshots is counted, not waited for). On CACHE_TOPIC go
the keys the prefix cache gained and lost since the last snapshot; a new subscriber gets the whole set first.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter, defaultdict, deque

import zmq

from common import protocol as wire
from engine.scheduler.plan import Plan
from engine.scheduler.scheduler import RequestScheduler

METRICS_TOPIC = wire.TELEMETRY_METRICS_TOPIC
DASHBOARD_TOPIC = wire.TELEMETRY_DASHBOARD_TOPIC
CACHE_TOPIC = wire.TELEMETRY_CACHE_TOPIC
PUBLISH_INTERVAL = 0.5
RATE_SAMPLE_INTERVAL = 5.0
GRAPH_WINDOW = 2.0
RING_SIZE = 1024
# Per step kind: its launches, the steps' summed durations and the tokens they ran (a scrape before and after a
# workload says where its time went); the keys made once, not on every step.
STEP_COUNTERS = {kind: (f"launches_{kind}", f"step_microseconds_{kind}", f"step_tokens_{kind}")
                 for kind in wire.STEP_KINDS}
COUNTERS = ("admissions", "completions", "cancellations", "failures", "rejections", "prefix_lookups", "prefix_hits",
            "prefix_misses", "reused_tokens", "checkpoint_publications", "checkpoint_evictions", "prompt_tokens",
            "output_tokens", "snapshot_publications", "snapshot_restores", "snapshot_evictions",
            *(key for keys in STEP_COUNTERS.values() for key in keys))
MAX_REQUEST_ROWS = 128


class EngineTelemetry:
    def __init__(self, socket: zmq.Socket, engine_id: str, kv_element_bytes: int = 0) -> None:
        """`kv_element_bytes`: the KV cache's element size (1 for an FP8 cache), reported beside its pages."""
        self.socket = socket
        self.engine_id = engine_id
        self.kv_element_bytes = kv_element_bytes
        self.started = time.monotonic()
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._queue_buckets = [0] * (len(wire.QUEUE_TIME_BUCKETS) + 1)
        self._queue_sum = 0.0
        self._rate_samples: deque[tuple[float, int]] = deque(maxlen=int(60 / RATE_SAMPLE_INTERVAL) + 1)
        self._last_publish = 0.0
        self._dashboards = 0
        self._cache_subscribed = False  # a subscriber arrived: the next announcement is the whole set
        self._ring: list[tuple[float, str, int, int, float, int] | None] = [None] * RING_SIZE
        self._ring_next = 0
        self._ring_since_publish = 0
        self.dropped = 0

    @property
    def next_publish(self) -> float:
        return self._last_publish + PUBLISH_INTERVAL

    @property
    def detailed(self) -> bool:
        return self._dashboards > 0

    def observe_queue_time(self, seconds: float) -> None:
        self._queue_buckets[bisect.bisect_left(wire.QUEUE_TIME_BUCKETS, seconds)] += 1
        self._queue_sum += seconds

    def observe_step(self, plan: Plan, duration: float) -> None:
        launches, microseconds, tokens = STEP_COUNTERS[plan.kind]
        self.counters[launches] += 1
        self.counters[microseconds] += round(duration * 1e6)
        self.counters[tokens] += plan.num_tokens
        if not self.detailed:
            return
        if self._ring_since_publish >= RING_SIZE:
            self.dropped += 1
            return
        capacity = plan.num_tokens if plan.kind != "decode" else 1 << (len(plan.rows) - 1).bit_length()
        width = 0
        if plan.kind == "verify":  # its batch capacity and width (target positions per request)
            capacity, width = plan.shape[1], plan.shape[2]
        self._ring[self._ring_next] = (time.monotonic(), plan.kind, capacity, len(plan.rows), duration, width)
        self._ring_next = (self._ring_next + 1) % RING_SIZE
        self._ring_since_publish += 1

    def maybe_publish(self, scheduler: RequestScheduler) -> None:
        now = time.monotonic()
        self._track_subscriptions()
        if now - self._last_publish < PUBLISH_INTERVAL:
            return
        self._last_publish = now
        if not self._rate_samples or now - self._rate_samples[-1][0] >= RATE_SAMPLE_INTERVAL:
            self._rate_samples.append((now, self.counters["output_tokens"]))
        snapshot = wire.Telemetry(
            engine_id=self.engine_id, uptime_s=now - self.started, counters=self._counters(scheduler),
            gauges=self._gauges(scheduler, now), queue_time_buckets=self._cumulative_buckets(),
            queue_time_sum=self._queue_sum, dropped_updates=self.dropped)
        self._send(METRICS_TOPIC, snapshot)
        self._announce_cache(scheduler)
        if self.detailed:
            snapshot.graphs = self._graph_stats(now)
            snapshot.requests = self._request_rows(scheduler, now)
            self._send(DASHBOARD_TOPIC, snapshot)
        self._ring_since_publish = 0

    def _announce_cache(self, scheduler: RequestScheduler) -> None:
        prefix = scheduler.prefix
        stored, hosted, evicted = prefix.tiers.take_journal()
        if self._cache_subscribed:
            self._cache_subscribed = False
            self._send(CACHE_TOPIC, wire.CacheEvents(self.engine_id, prefix.cache.ready_keys(), full=True,
                                                     hosted=prefix.host.keys() if prefix.host is not None else []))
        elif stored or hosted or evicted:
            self._send(CACHE_TOPIC, wire.CacheEvents(self.engine_id, stored, evicted, hosted=hosted))

    def _send(self, topic: bytes, snapshot: wire.Telemetry | wire.CacheEvents) -> None:
        try:
            self.socket.send_multipart([topic, wire.encode(snapshot)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # a slow subscriber misses a snapshot; the next one supersedes it

    def _track_subscriptions(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = frames[0]
            # A subscriber's frames are (un)subscriptions; anything else a peer sends (an XSUB may) is not counted.
            if len(frames) != 1 or event[:1] not in (b"\x00", b"\x01"):
                continue
            if event[1:] == DASHBOARD_TOPIC:
                self._dashboards = max(self._dashboards + (1 if event[0] == 1 else -1), 0)
            elif event[1:] == CACHE_TOPIC and event[0] == 1:
                self._cache_subscribed = True

    def _counters(self, scheduler: RequestScheduler) -> dict[str, int]:
        """The engine loop's counters, and the scheduler's prefix-cache ones."""
        return {**self.counters, **scheduler.counters,
                "checkpoint_evictions": scheduler.prefix.cache.stats.evictions}

    def _cumulative_buckets(self) -> list[int]:
        total, out = 0, []
        for count in self._queue_buckets:
            total += count
            out.append(total)
        return out

    def _gauges(self, scheduler: RequestScheduler, now: float) -> dict[str, float]:
        live = scheduler.live
        oldest = self._rate_samples[0] if self._rate_samples else (now, 0)
        return {
            "live_requests": live, "free_slots": scheduler.max_active - live,
            "retiring_slots": scheduler.retiring_count, "free_pages": scheduler.pages.free_count,
            "kv_pages": scheduler.pages.num_pages, "kv_element_bytes": self.kv_element_bytes,
            "retiring_pages": scheduler.pages.retiring_count, "cached_pages": scheduler.cached_pages,
            "pending_requests": len(scheduler.waiting), "uptime_seconds": now - self.started,
            "tokens_last_minute": self.counters["output_tokens"] - oldest[1],
            **({"spec_mean_acceptance_length": scheduler.counters["draft_accepted_tokens"]
                / max(scheduler.counters["draft_rounds"], 1)} if scheduler.speculation is not None else {}),
            **(self._snapshot_gauges(scheduler) if scheduler.prefix.hybrid else {}),
            **(self._tier_gauges(scheduler) if scheduler.prefix.host is not None else {}),
        }

    @staticmethod
    def _tier_gauges(scheduler: RequestScheduler) -> dict[str, float]:
        """The host and disk tiers (docs/design.md, Host retention): pages (and a hybrid model's snapshots) held,
        a host page copy's recent median seconds (a restore's time per page) and a disk file's."""
        prefix, tiers = scheduler.prefix, scheduler.prefix.tiers
        copies, files = tiers.page_copy_seconds, tiers.disk.file_seconds if tiers.disk else ()
        return {"host_pages": len(prefix.host), "disk_pages": len(tiers.disk.disk) if tiers.disk else 0,
                "host_page_copy_seconds": statistics.median(copies) if copies else 0.0,
                "disk_file_seconds": statistics.median(files) if files else 0.0,
                **({"host_snapshots": prefix.host.snapshots} if prefix.hybrid else {})}

    @staticmethod
    def _snapshot_gauges(scheduler: RequestScheduler) -> dict[str, float]:
        """A hybrid model's recurrent-state snapshots (exact checkpoints): held by the cache, free, and the bytes
        the held ones take."""
        prefix = scheduler.prefix
        cached = prefix.cache.snapshots
        return {"cached_snapshots": cached, "free_snapshots": prefix.snapshots.ids.free_count,
                "snapshot_bytes": cached * prefix.snapshots.row_bytes}

    def _graph_stats(self, now: float) -> list[wire.GraphStat]:
        groups: dict[tuple[str, int, int], list[tuple[int, float]]] = defaultdict(list)
        for entry in self._ring:
            if entry is not None and now - entry[0] <= GRAPH_WINDOW:
                groups[(entry[1], entry[2], entry[5])].append((entry[3], entry[4]))
        return [wire.GraphStat(kind, capacity, len(calls), 1000 * sum(d for _, d in calls) / len(calls),
                               1000 * max(d for _, d in calls), sum(n for n, _ in calls) / len(calls), width)
                for (kind, capacity, width), calls in sorted(groups.items())]

    def _request_rows(self, scheduler: RequestScheduler, now: float) -> list[wire.RequestRow]:
        live = [r for r in scheduler.slots if r is not None] + list(scheduler.waiting)
        return [wire.RequestRow(
            slot=r.slot, generation=r.generation, phase=r.phase.value, gap_ms=1000 * (now - r.last_commit),
            prompt_done=min(r.scheduled, r.prompt_len), prompt_len=r.prompt_len, outputs=r.outputs,
            since_publish_ms=1000 * (now - r.last_publish) if r.last_publish else -1.0, bursts=r.bursts,
            speculative_rounds=r.speculation.rounds if r.speculation else 0)
            for r in live[:MAX_REQUEST_ROWS]]
