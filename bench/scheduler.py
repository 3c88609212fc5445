"""Host cost of scheduling: microseconds of plan + commit + complete per step, at 1 to 256 live requests.

    python -m bench.scheduler [--steps 300]

No model runs: completions are made up (token 7, never a stop token), so the table shows only the scheduler's own
Python work per step, which the engine must hide behind the device's step time.
"""

from __future__ import annotations

import argparse
import time

from common.protocol import SamplingParams
from engine.scheduler.plan import Completion
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler


def measure(active: int, steps: int, prompt_len: int = 200) -> tuple[float, float, float]:
    scheduler = RequestScheduler(active, active, num_pages=active * 16, page_size=64, prefill_chunk_size=512)
    params = SamplingParams(temperature=0.0, max_tokens=10**6)
    for i in range(active):
        prompt = [(i * 31 + j) % 1000 + 1 for j in range(prompt_len)]
        scheduler.add(Request(f"r{i}", b"b", prompt_len, prompt, params, i, frozenset({0}), 10**6, float(i)))
    fence = 0
    timings = {"plan": 0.0, "commit": 0.0, "complete": 0.0}
    measured = 0
    while measured < steps:
        started = time.perf_counter()
        plan = scheduler.plan()
        planned = time.perf_counter()
        fence += 1
        scheduler.commit(plan, fence)
        committed = time.perf_counter()
        sampled = [row for row in plan.rows if row.sample]
        scheduler.complete(Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                                      (7,) * len(sampled), 0.01), plan)
        completed = time.perf_counter()
        if plan.kind == "decode":  # steady state: every request decoding
            timings["plan"] += planned - started
            timings["commit"] += committed - planned
            timings["complete"] += completed - committed
            measured += 1
    return tuple(1e6 * timings[k] / steps for k in ("plan", "commit", "complete"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(f"{'active':>7} {'plan us':>9} {'commit us':>10} {'complete us':>12} {'total us':>9} {'us/request':>11}")
    for active in (1, 16, 64, 256):
        plan, commit, complete = measure(active, args.steps)
        total = plan + commit + complete
        print(f"{active:>7} {plan:>9.1f} {commit:>10.1f} {complete:>12.1f} {total:>9.1f} {total / active:>11.2f}")


if __name__ == "__main__":
    main()
