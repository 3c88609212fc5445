"""The `vllm bench serve` table for one run, and the JSON of a run."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from bench.datasets import Workload
from bench.metrics import summarize
from bench.runner import Run, Traffic

WIDTH = 50

# (section title, [(summary key, label, format)]); the first section has no title.
SECTIONS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("", [("successful", "Successful requests", "d"),
          ("failed", "Failed requests", "d"),
          ("duration_s", "Benchmark duration (s)", ".2f"),
          ("total_input_tokens", "Total input tokens", "d"),
          ("cached_input_tokens", "Cached input tokens (server's usage)", "d"),
          ("total_output_tokens", "Total generated tokens", "d"),
          ("request_throughput", "Request throughput (req/s)", ".2f"),
          ("output_throughput", "Output token throughput (tok/s)", ".2f"),
          ("total_token_throughput", "Total token throughput (tok/s)", ".2f"),
          ("peak_concurrency", "Peak concurrent requests", "d")]),
    *[(title, [(f"{stat}_{key}_ms", f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms)", ".2f")
               for stat in ("mean", "median", "p99")])
      for key, short, title in (("ttft", "TTFT", "Time to First Token"),
                                ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                                ("itl", "ITL", "Inter-token Latency"),
                                ("e2el", "E2EL", "End-to-end Latency"))],
]


def cell(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def describe(run: Run, workload: Workload, traffic: Traffic) -> str:
    rate = "inf" if math.isinf(traffic.request_rate) else f"{traffic.request_rate:g}/s"
    return (f"{run.target.label}: model {run.model}, {run.target.endpoint} endpoint, {workload.dataset} x "
            f"{workload.num_prompts}, input {workload.input_len}, output {workload.output_len}, rate {rate}, "
            f"max concurrency {traffic.max_concurrency or 'none'}")


def serve_table(run: Run) -> str:
    summary = summarize(run.records, run.duration)
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    for title, rows in SECTIONS:
        if title:
            lines.append(title.center(WIDTH, "-"))
        lines += [f"{label + ':':<40} {cell(summary[key], fmt)}" for key, label, fmt in rows]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def run_json(run: Run, workload: Workload, traffic: Traffic) -> dict:
    rate = "inf" if math.isinf(traffic.request_rate) else traffic.request_rate
    return {"label": run.target.label, "base_url": run.target.base_url, "endpoint": run.target.endpoint,
            "model": run.model, "started_at": run.started_at, "workload": dataclasses.asdict(workload),
            "traffic": {**dataclasses.asdict(traffic), "request_rate": rate},
            "metrics": summarize(run.records, run.duration),
            "requests": [record.to_json() for record in run.records]}


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1) + "\n")
