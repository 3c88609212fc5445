"""A decode step of the 8B at batch 1, kernel by kernel: torch.profiler over replays of the captured graph, which
lists the kernels inside it:

    python3 -m bench.lab.gpu.step_profile CORE [--contexts 640,4096] [--steps 20]

Prints per context: wall and GPU ms per step, then each kernel's µs per step, launches per step and µs per launch
(largest first), and the idle gaps between consecutive kernels on the stream (what launches cost inside a graph).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from bench.lab.gpu.steps import decode_plan, time_steps, weight_bytes
from engine.executor.graph import GraphExecutor
from engine.model.loader import load_model

MAX_GAP_US = 50  # longer idle stretches are the host's, between steps


def kernel_table(executor: GraphExecutor, context: int, page_size: int, steps: int, layers: int) -> None:
    plan = decode_plan(1, context, page_size)
    wall = time_steps(executor, plan, 50)
    gpu = statistics.median(end - start for start, end, _, _ in list(executor.spans)[-50:])
    print(f"## context {context}: wall {wall * 1e3:.3f} ms/step, GPU {gpu:.3f} ms/step")
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
    parser.add_argument("--contexts", default="640,4096")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.lab.gpu.step_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",")]
    manifest, model = load_model(args.core, torch.device("cuda"), verify=False)
    caps = manifest.capacities
    print(f"# {manifest.checkpoint} ({manifest.dtype}), batch 1: {weight_bytes(model) / 1e9:.2f} GB of weights a step")
    executor = GraphExecutor(model, 2 * -(-max(contexts) // caps.page_size) + 16, caps.page_size, 1,
                             torch.device("cuda"), manifest.context_limit, caps.prefill_chunk_size)
    executor.kv_cache.normal_()  # attention over random keys, not zeros
    for context in contexts:
        kernel_table(executor, context, caps.page_size, args.steps, model.config.num_layers)
    executor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
