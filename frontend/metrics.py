"""/metrics: this frontend's own numbers plus each engine replica's latest telemetry snapshot, in Prometheus text.

Per frontend: HTTP admission and worker-pool gauges, and the latency histograms (time to first token, inter-token
latency, end-to-end), measured where the client sees them. Per engine: everything named flare_engine_*, relayed from
the engine's telemetry socket (frontend/replicas.py follows it), so every frontend reports the same engine figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from common import protocol as wire

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)

REGISTRY = CollectorRegistry()
TIME_TO_FIRST_TOKEN = Histogram("flare_time_to_first_token_seconds", "Arrival to first output token",
                                buckets=LATENCY_BUCKETS, registry=REGISTRY)
INTER_TOKEN_LATENCY = Histogram("flare_inter_token_latency_seconds", "Gap between output token deliveries",
                                buckets=LATENCY_BUCKETS, registry=REGISTRY)
END_TO_END_LATENCY = Histogram("flare_e2e_request_latency_seconds", "Arrival to the last output token",
                               buckets=LATENCY_BUCKETS, registry=REGISTRY)


class RequestTimer:
    """Feeds the latency histograms from one generation's deliveries."""

    def __init__(self) -> None:
        self.arrival = time.monotonic()
        self._last: float | None = None

    def delivered(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.monotonic()
        if self._last is None:
            TIME_TO_FIRST_TOKEN.observe(now - self.arrival)
        else:
            INTER_TOKEN_LATENCY.observe((now - self._last) / tokens)
        self._last = now

    def finished(self) -> None:
        END_TO_END_LATENCY.observe(time.monotonic() - self.arrival)


def frontend_gauges(admission: Callable[[], tuple[int, int]], pool: Callable[[], tuple[int, int]]) -> None:
    """Register the gauges read at scrape time: (capacity, in use) of HTTP admission and of the worker pool."""
    for name, read in (("http_admission", admission), ("worker_pool", pool)):
        Gauge(f"flare_frontend_{name}_capacity", f"{name} capacity", registry=REGISTRY).set_function(
            lambda read=read: read()[0])
        Gauge(f"flare_frontend_{name}_in_use", f"{name} in use", registry=REGISTRY).set_function(
            lambda read=read: read()[1])


class EngineSnapshots(Collector):
    """Renders each replica's latest telemetry snapshot at scrape time. With one replica the series carry no labels;
    with several, each carries `replica="i"` (its position among the frontend's --engine addresses)."""

    def __init__(self, snapshots: Callable[[], list[wire.Telemetry | None]]) -> None:
        self._snapshots = snapshots
        REGISTRY.register(self)

    def collect(self) -> Iterator:
        snapshots = self._snapshots()
        labelled = [(([] if len(snapshots) == 1 else [str(i)]), s) for i, s in enumerate(snapshots) if s is not None]
        if not labelled:
            return
        names = [] if len(snapshots) == 1 else ["replica"]
        counters = sorted({name for _, s in labelled for name in s.counters})
        for name in counters:
            family = CounterMetricFamily(f"flare_engine_{name}", f"engine counter {name}", labels=names)
            for labels, snapshot in labelled:
                family.add_metric(labels, snapshot.counters.get(name, 0))
            yield family
        for name in sorted({name for _, s in labelled for name in s.gauges}):
            family = GaugeMetricFamily(f"flare_engine_{name}", f"engine gauge {name}", labels=names)
            for labels, snapshot in labelled:
                family.add_metric(labels, snapshot.gauges.get(name, 0.0))
            yield family
        family = HistogramMetricFamily("flare_engine_queue_time_seconds", "arrival to first scheduling", labels=names)
        for labels, snapshot in labelled:
            buckets = [(str(b), c) for b, c in zip(wire.QUEUE_TIME_BUCKETS, snapshot.queue_time_buckets)]
            buckets.append(("+Inf", snapshot.queue_time_buckets[-1]))
            family.add_metric(labels, buckets, snapshot.queue_time_sum)
        yield family


async def serve_metrics(_request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(REGISTRY), content_type="text/plain", charset="utf-8")
