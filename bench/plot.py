"""`--plot`: latency CDFs and throughput over time, one curve per run (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.metrics import latency_samples
from bench.runner import Run

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
BIN_S = 1.0


def output_rate(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in BIN_S bins. A chunk's tokens are not reported one by one, so each request's
    tokens are spread evenly over its text chunks."""
    times, weights = [], []
    for record in run.records:
        if not record.ok or record.ttft is None:
            continue
        arrivals = np.cumsum([record.start + record.ttft, *record.itl])
        times.extend(arrivals)
        weights.extend([record.output_tokens / len(arrivals)] * len(arrivals))
    edges = np.arange(0.0, run.duration + BIN_S, BIN_S)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / BIN_S


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib  # imported here: only --plot needs it, and it is an optional extra

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4 * (len(PANELS) + 1), 3.6), constrained_layout=True)
    for run in runs:
        samples = latency_samples(run.records)
        for axis, (key, title) in zip(axes, PANELS, strict=False):
            values = np.sort(np.asarray(samples[key]) * 1000.0)
            fractions = np.arange(1, len(values) + 1) / max(len(values), 1)
            axis.step(values, fractions, where="post", label=run.target.label)
            axis.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples")
        start, rate = output_rate(run)
        axes[-1].step(start, rate, where="post", label=run.target.label)
    axes[-1].set(title="Output throughput", xlabel="seconds since start", ylabel="tokens/s")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.savefig(path, dpi=120)
    plt.close(figure)
