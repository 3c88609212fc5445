"""Host cost of scheduling: microseconds of plan + commit + complete per steady decode step, of the engine
loop's own work around them (publishing the step's outputs, counting, telemetry), and of the graph executor's
packing of the plan into its input frame (engine/executor/frames.py `pack`, into a decode graph's layout as
GraphExecutor does, on the CPU), at 1 to 256 live requests (docs/design.md: Scheduler and prefix checkpoints, The
engine loop, Executors and CUDA graphs; docs/host.md: the scheduler's budget is 300 us a step at 256 live requests, so that a GPU's decode step
hides it).

    python -m bench.lab.host.scheduler [--steps 300] [--repeats 3] [--clock wall|cpu] [--percentile P] [--active 64 256]

No model runs: completions are made up (token 7, never a stop token), so the table shows only the host's Python
work per step, which the engine must hide behind the device's step time (not included: the executor's launch calls
and reading back the sampled tokens). Outputs go to a frontend's socket over ZeroMQ inproc, drained between steps.
The phase columns show wall time (perf_counter) or, with `--clock cpu`, CPU time of this process (process_time),
the steadier of the two on a machine shared with other work; the last column is always CPU time. Each size runs
`--repeats` times and reports the fastest run by that clock (the least disturbed one). Each phase is its mean over
the steps, or with `--percentile P` its P-th percentile (10: what a step costs when other work leaves it alone; the
total is then the sum of the phases' percentiles).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from itertools import compress
from typing import Any

import numpy as np
import zmq

from common.protocol import ModelCard, SamplingParams
from engine.core import Engine
from engine.executor.frames import PageTableMirror, host_views, make_layout, pack
from engine.executor.graph import decode_capacities
from engine.scheduler.plan import GENERATION, SAMPLE, SLOT, Completion, Plan, fields
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry

PHASES = ("plan", "commit", "complete", "engine", "pack")
_ADDRESSES = itertools.count()  # an inproc address stays taken for a while after its socket closes


def timed(call: Callable[[], Any]) -> tuple[Any, tuple[float, float]]:
    """The call's result and its (wall, CPU) seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    return result, (time.perf_counter() - wall, time.process_time() - cpu)


def decoding_scheduler(active: int, prompt_len: int = 200) -> RequestScheduler:
    """A scheduler with `active` requests waiting to prefill `prompt_len`-token prompts and decode without end (their
    stop id, 0, is never sampled here unless a benchmark says so)."""
    scheduler = RequestScheduler(active, active, num_pages=active * 16, page_size=64, prefill_chunk_size=512)
    params = SamplingParams(temperature=0.0, max_tokens=10**6)
    for i in range(active):
        prompt = [(i * 31 + j) % 1000 + 1 for j in range(prompt_len)]
        scheduler.add(Request(f"r{i}", b"b", prompt_len, prompt, params, i, frozenset({0}), 10**6, float(i)))
    return scheduler


def sampled_completion(plan: Plan, fence: int, tokens: Callable[[int], tuple[int, ...]]) -> Completion:
    """The executor's completion of a plan (its sampled rows' slots and generations, read as GraphExecutor reads
    them), with tokens(count) for its sampled rows."""
    sample = list(fields(plan.rows, SAMPLE))
    return Completion(fence, tuple(compress(fields(plan.rows, SLOT), sample)),
                      tuple(compress(fields(plan.rows, GENERATION), sample)), tokens(sum(sample)), 0.01)


def measure(active: int, steps: int, prompt_len: int = 200,
            percentile: float | None = None) -> dict[str, tuple[float, float]]:
    """Per phase: (wall us, CPU us) per steady decode step, the mean or the given percentile over the steps."""
    scheduler = decoding_scheduler(active, prompt_len)
    context = zmq.Context.instance()
    socket, frontend = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    address = f"inproc://bench-scheduler-{next(_ADDRESSES)}"
    socket.bind(address)
    frontend.setsockopt(zmq.ROUTING_ID, b"b")
    frontend.connect(address)
    card = ModelCard(["bench"], "bench", "llama", 1 << 20, [0])
    engine = Engine(card, None, scheduler, 1000, socket, EngineTelemetry(socket, "bench"), "")
    # GraphExecutor's frame for the decode graph that holds every live request (its host side; no CUDA).
    layout = make_layout("decode", decode_capacities(active)[-1], decode_capacities(active)[-1])
    width = 1 << 10  # pages a request's table may hold
    frame = np.zeros(layout.patches + 2 * active * width, dtype=np.int32)
    views, mirror = host_views(frame, layout), PageTableMirror(active, width)
    fence = 0
    times: dict[str, list[tuple[float, float]]] = {phase: [] for phase in PHASES}  # (wall, CPU) s per step
    measured = 0
    while measured < steps:
        plan, plan_times = timed(scheduler.plan)
        fence += 1
        _, commit_times = timed(lambda: scheduler.commit(plan, fence))
        _, engine_submit_times = timed(lambda: engine.count_start(plan))
        # The prefill steps before the steady state need an extend layout: not packed (nor counted), so the first
        # decode step writes every request's page table, as after a preemption storm.
        _, pack_times = timed(lambda: pack(plan, layout, frame, views, mirror, scheduler.page_size, active)
                              if plan.kind == "decode" else None)
        completion = sampled_completion(plan, fence, lambda count: (7,) * count)  # (the executor's: not timed)
        result, complete_times = timed(lambda: scheduler.complete(completion, plan))
        _, engine_complete_times = timed(lambda: engine.publish_step(plan, completion, result))
        while frontend.poll(0):
            frontend.recv_multipart()
        engine_times = tuple(map(sum, zip(engine_submit_times, engine_complete_times)))
        if plan.kind == "decode":  # steady state: every request decoding
            for phase, phase_times in zip(PHASES, (plan_times, commit_times, complete_times, engine_times,
                                                   pack_times)):
                times[phase].append(phase_times)
            measured += 1
    socket.close(linger=0)
    frontend.close(linger=0)
    summary = np.mean if percentile is None else lambda a, axis: np.percentile(a, percentile, axis=axis)
    return {phase: tuple((1e6 * summary(np.array(times[phase]), axis=0)).tolist()) for phase in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what the phase columns show (the fastest run by that clock is reported)")
    parser.add_argument("--percentile", type=float, help="each phase's percentile over the steps (default: the mean)")
    parser.add_argument("--active", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    clock = 0 if args.clock == "wall" else 1
    print(f"{'active':>7} {'plan us':>9} {'commit us':>10} {'complete us':>12} {'engine us':>10} {'pack us':>8}"
          f" {'total us':>9} {'us/request':>11} {'total CPU us':>13}")
    for active in args.active:
        runs = [measure(active, args.steps, percentile=args.percentile) for _ in range(args.repeats)]
        best = min(runs, key=lambda run: sum(run[phase][clock] for phase in PHASES))
        plan, commit, complete, engine, packing = (best[phase][clock] for phase in PHASES)
        total, total_cpu = plan + commit + complete + engine + packing, sum(best[phase][1] for phase in PHASES)
        print(f"{active:>7} {plan:>9.1f} {commit:>10.1f} {complete:>12.1f} {engine:>10.1f} {packing:>8.1f}"
              f" {total:>9.1f} {total / active:>11.2f} {total_cpu:>13.1f}")


if __name__ == "__main__":
    main()
