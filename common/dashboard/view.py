"""What the dashboard shows, derived from successive Telemetry snapshots: plain data, no textual, easy to test.

Throughput comes from counter deltas over the engine's own clock (uptime_s), so a late or bunched delivery of
snapshots does not distort it. Request history is kept here, not in the engine: one cell per snapshot (the engine
publishes every 0.5 s), marking whether the request's prompt or output advanced since the previous sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.protocol import GraphStat, RequestRow, Telemetry

RATE_WINDOW = 2.0  # seconds of engine time a throughput figure averages over
HISTORY_CELLS = 20  # ten seconds at the engine's publication interval
MAX_TRACKED = 128  # request rows kept, live and retired together
# Counters a speculative engine adds; the acceptance figure shows only when the snapshot carries both.
DRAFT_ACCEPTED = "draft_accepted_tokens"
DRAFT_ROUNDS = "draft_rounds"

PREFILL_MARK, DECODE_MARK, SPECULATIVE_MARK, IDLE_MARK, GONE_MARK = "P", "D", "S", "·", " "


@dataclass
class GraphRow:
    label: str  # kind with its capacity: b = batch rows (decode, verify), t = tokens (prefill, mixed), w = width
    calls: int
    mean_ms: float
    max_ms: float
    share: float  # of the graph time observed over the window, 0..1; not device utilization
    requests_per_call: float


@dataclass
class TrackedRequest:
    slot: int
    generation: int
    row: RequestRow  # the latest sample
    retired_for: int = 0  # snapshots since the engine last listed it
    cells: deque[str] = field(default_factory=lambda: deque(maxlen=HISTORY_CELLS))

    @property
    def history(self) -> str:
        return "".join(self.cells).rjust(HISTORY_CELLS, GONE_MARK)

    @property
    def live(self) -> bool:
        return self.retired_for == 0


class TelemetryView:
    def __init__(self) -> None:
        self.latest: Telemetry | None = None
        self._clear()

    def _clear(self) -> None:
        self._tracked: dict[tuple[int, int], TrackedRequest] = {}
        self._queued: list[RequestRow] = []
        self._samples: deque[tuple[float, int, int]] = deque()  # (uptime, prompt tokens, output tokens)

    def update(self, snapshot: Telemetry) -> None:
        if self.latest is not None and snapshot.engine_id != self.latest.engine_id:
            self._clear()  # another engine (a restart): nothing before it compares
        self.latest = snapshot
        counters = snapshot.counters
        self._samples.append((snapshot.uptime_s, counters.get("prompt_tokens", 0), counters.get("output_tokens", 0)))
        while len(self._samples) > 2 and snapshot.uptime_s - self._samples[1][0] >= RATE_WINDOW:
            self._samples.popleft()
        self._track(snapshot.requests)

    def throughput(self) -> tuple[float, float]:
        """Prefill and generation tokens per second over the last RATE_WINDOW seconds."""
        if len(self._samples) < 2:
            return 0.0, 0.0
        (t0, p0, o0), (t1, p1, o1) = self._samples[0], self._samples[-1]
        elapsed = max(t1 - t0, 1e-9)
        return (p1 - p0) / elapsed, (o1 - o0) / elapsed

    def draft_acceptance(self) -> float | None:
        counters = self.latest.counters if self.latest else {}
        if DRAFT_ACCEPTED not in counters or DRAFT_ROUNDS not in counters:
            return None
        return counters[DRAFT_ACCEPTED] / max(counters[DRAFT_ROUNDS], 1)

    def graphs(self) -> list[GraphRow]:
        stats = self.latest.graphs if self.latest else []
        total = sum(s.calls * s.mean_ms for s in stats) or 1.0
        return [GraphRow(graph_label(s), s.calls, s.mean_ms, s.max_ms, s.calls * s.mean_ms / total,
                         s.requests_per_call) for s in stats]

    def requests(self) -> tuple[list[TrackedRequest], list[RequestRow]]:
        """Slotted requests, live and recently retired, by slot then generation; and the queued ones."""
        return [self._tracked[key] for key in sorted(self._tracked)], self._queued

    def _track(self, rows: list[RequestRow]) -> None:
        seen = set()
        for row in rows:
            if row.slot < 0:
                continue
            key = (row.slot, row.generation)
            seen.add(key)
            tracked = self._tracked.get(key)
            previous = tracked.row if tracked else None
            if tracked is None:
                tracked = self._tracked[key] = TrackedRequest(row.slot, row.generation, row)
            tracked.row, tracked.retired_for = row, 0
            tracked.cells.append(progress_mark(previous, row))
        self._queued = [row for row in rows if row.slot < 0]
        for key, tracked in list(self._tracked.items()):
            if key in seen:
                continue
            tracked.retired_for += 1
            tracked.cells.append(GONE_MARK)
            if tracked.retired_for >= HISTORY_CELLS:  # retired rows stay while their history shows anything
                del self._tracked[key]
        retired = sorted((t for t in self._tracked.values() if not t.live), key=lambda t: -t.retired_for)
        for tracked in retired[:max(len(self._tracked) - MAX_TRACKED, 0)]:
            del self._tracked[(tracked.slot, tracked.generation)]


def progress_mark(previous: RequestRow | None, row: RequestRow) -> str:
    """The latest kind of progress between two samples: a verify round beats decode, output beats prompt (a
    decode follows its prefill)."""
    outputs, prompt = (previous.outputs, previous.prompt_done) if previous else (0, 0)
    if row.speculative_rounds > (previous.speculative_rounds if previous else 0):
        return SPECULATIVE_MARK
    if row.outputs > outputs:
        return DECODE_MARK
    if row.prompt_done > prompt:
        return PREFILL_MARK
    return IDLE_MARK


def graph_label(stat: GraphStat) -> str:
    if stat.width:  # a verify graph: batch capacity, width, and the target rows it packs
        return f"{stat.kind} b{stat.capacity} w{stat.width} rows{stat.capacity * stat.width}"
    return f"{stat.kind} {'b' if stat.kind == 'decode' else 't'}{stat.capacity}"
