"""Host cost of decode steps while requests end (docs/design.md, Scheduler and prefix checkpoints; docs/host.md): `bench.lab.host.scheduler`'s
workload never ends a request, so its steady steps all keep the same requests. Here every `--every`-th completed step
draws a stop token for one request, with two steps in flight (as the engine keeps them): the next completion then
carries a row of a request that ended, and the next plan has one request fewer. CPU microseconds of plan, commit and
complete (the scheduler alone), 10th percentile and median, over the decode steps right after an end and over the
others; the live count falls by one per end, from `--active`.

    python -m bench.lab.host.scheduler_ends [--active 256] [--steps 200] [--every 4]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import numpy as np

from bench.lab.host.scheduler import decoding_scheduler, sampled_completion
from engine.scheduler.plan import Plan

PHASES = ("plan", "commit", "complete")


def measure(active: int, steps: int, every: int) -> dict[bool, dict[str, list[float]]]:
    """CPU seconds per phase of each decode step, keyed by whether an end came just before it."""
    scheduler = decoding_scheduler(active)
    in_flight: deque[tuple[int, Plan]] = deque()
    times: dict[bool, dict[str, list[float]]] = {after: {phase: [] for phase in PHASES} for after in (False, True)}
    fence, measured, ended = 0, 0, False
    while measured < steps:
        start = time.process_time()
        plan = scheduler.plan()
        planned = time.process_time()
        fence += 1
        scheduler.commit(plan, fence)
        committed = time.process_time()
        in_flight.append((fence, plan))
        if len(in_flight) < 2:
            continue
        done, oldest = in_flight.popleft()
        steady = oldest.kind == "decode"
        end = steady and measured % every == 0
        completion = sampled_completion(oldest, done, lambda count: tuple(
            0 if end and i == count // 2 else 7 for i in range(count)))
        completing = time.process_time()
        scheduler.complete(completion, oldest)
        if steady:  # (the prefill steps before the steady state are not counted)
            for phase, seconds in zip(PHASES, (planned - start, committed - planned,
                                               time.process_time() - completing)):
                times[ended][phase].append(seconds)
            measured += 1
            ended = end
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--active", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=4, help="decode steps per end")
    args = parser.parse_args()
    times = measure(args.active, args.steps, args.every)
    print(f"{'steps':<14} {'count':>6}" + "".join(f" {phase + ' p10':>13} {phase + ' median':>16}" for phase in PHASES))
    for after, label in ((False, "without an end"), (True, "after an end")):
        columns = times[after]
        print(f"{label:<14} {len(columns['plan']):>6}" + "".join(
            f" {np.percentile(columns[phase], 10) * 1e6:>13.1f} {np.median(columns[phase]) * 1e6:>16.1f}"
            for phase in PHASES))


if __name__ == "__main__":
    main()
