"""The figures of a run, computed from its request records the way `vllm bench serve` computes them."""

from __future__ import annotations

import numpy as np

from bench.client import RequestRecord


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first; undefined for a one-token answer."""
    if record.ttft is None or record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def peak_concurrency(records: list[RequestRecord]) -> int:
    # Ends sort before starts at the same instant, so back-to-back requests do not count as overlapping.
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p99": float(np.percentile(ms, 99))}


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds, over successful requests; ITL pools every gap of every request."""
    ok = [r for r in records if r.ok]
    return {"ttft": [r.ttft for r in ok if r.ttft is not None],
            "tpot": [t for r in ok if (t := tpot(r)) is not None],
            "itl": [gap for r in ok for gap in r.itl],
            "e2el": [r.e2e for r in ok]}


def summarize(records: list[RequestRecord], duration: float) -> dict[str, float | int | None]:
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, float | int | None] = {
        "successful": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_input_tokens": sum(r.cached_tokens or 0 for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "peak_concurrency": peak_concurrency(records),
    }
    for name, values in latency_samples(records).items():
        for stat, value in stats(values).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary
