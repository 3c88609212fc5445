"""A step kernel by kernel: torch.profiler over replays of the captured graph, which lists the kernels inside it.

    python3 -m bench.lab.gpu.step_profile CORE [--contexts 640,4096] [--extends 64@16000,64@0] [--steps 20]

`--contexts`: decode steps at batch 1 over that many tokens. `--extends NEW@CACHED`: a prompt step of NEW tokens of
one sequence after CACHED tokens in its pages (the 8b-prefix16k row's step is 64@16000 beside 8b-short64's 64@0).
Prints per step: wall and GPU ms, then each kernel's µs per step, launches per step and µs per launch (largest
first), and the idle gaps between consecutive kernels on the stream (what launches cost inside a graph).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from bench.lab.gpu.steps import decode_plan, extend_plan, time_steps, weight_bytes
from engine.executor.graph import GraphExecutor
from engine.model.loader import load_model
from engine.scheduler.plan import Plan

MAX_GAP_US = 50  # longer idle stretches are the host's, between steps


def kernel_table(executor: GraphExecutor, plan: Plan, title: str, steps: int, layers: int) -> None:
    wall = time_steps(executor, plan, 50)
    gpu = statistics.median(end - start for start, end, _, _ in list(executor.spans)[-50:])
    print(f"## {title}: wall {wall * 1e3:.3f} ms/step, GPU {gpu:.3f} ms/step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        time_steps(executor, plan, steps, warmup=0)
    torch.cuda.synchronize()
    events = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        per_kernel[event.name][0] += event.device_time
        per_kernel[event.name][1] += 1
    total = sum(time for time, _ in per_kernel.values())
    print(f"{len(events) / steps:.0f} kernels a step, {total / steps / 1e3:.3f} ms a step of kernel time")
    print("| µs a step | launches a step | µs each | kernel |\n| --- | --- | --- | --- |")
    for name, (time, count) in sorted(per_kernel.items(), key=lambda item: -item[1][0]):
        if time / steps >= 1.0:
            print(f"| {time / steps:.1f} | {count / steps:.1f} | {time / count:.2f} | {name[:100]} |")
    ordered = sorted(events, key=lambda e: e.time_range.start)
    for name, (time, count) in per_kernel.items():  # a kernel that runs several times a layer: each place apart
        places = count // steps // layers
        if places > 1 and count == places * steps * layers:
            times = [e.device_time for e in ordered if e.name == name]
            each = [statistics.mean(times[place::places]) for place in range(places)]
            print(f"{name[:40]}, each of its {places} launches a layer in order, µs: "
                  + ", ".join(f"{t:.2f}" for t in each))
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(ordered, ordered[1:])]
    inside = [gap for gap in gaps if 0 <= gap < MAX_GAP_US]
    print(f"gaps between kernels (< {MAX_GAP_US} µs): {len(inside) / steps:.0f} a step, "
          f"{sum(inside) / steps / 1e3:.3f} ms a step, median {statistics.median(inside):.2f} µs\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--contexts", default="640,4096", help="decode steps over these contexts ('' for none)")
    parser.add_argument("--extends", default="", help="prompt steps NEW@CACHED, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.lab.gpu.step_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",") if c]
    extends = [tuple(int(n) for n in e.split("@")) for e in args.extends.split(",") if e]
    manifest, model = load_model(args.core, torch.device("cuda"), verify=False)
    caps = manifest.capacities
    print(f"# {manifest.checkpoint} ({manifest.dtype}): {weight_bytes(model) / 1e9:.2f} GB of weights a step")
    longest = max([*contexts, *(new + cached for new, cached in extends)])
    executor = GraphExecutor(model, 2 * -(-longest // caps.page_size) + 16, caps.page_size, 1,
                             torch.device("cuda"), manifest.context_limit, caps.prefill_chunk_size)
    executor.kv_cache.normal_()  # attention over random keys, not zeros
    plans = [(decode_plan(1, context, caps.page_size), f"decode, batch 1, context {context}") for context in contexts]
    plans += [(extend_plan(new, cached, caps.page_size), f"{new} prompt tokens after {cached} cached")
              for new, cached in extends]
    for plan, title in plans:
        kernel_table(executor, plan, title, args.steps, model.config.num_layers)
    executor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
