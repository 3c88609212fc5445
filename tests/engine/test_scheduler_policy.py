"""The cost model's exploration never splits a prompt that one step could take (engine/scheduler/policy.py):
a shape never measured is explored only when it takes all that waits or is the largest chunk, and a shape measured
more than 30 seconds ago keeps its last cost instead of being explored again."""

from __future__ import annotations

import time

from common.protocol import SamplingParams
from engine.scheduler.plan import Completion
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler

PAGE, CHUNK = 4, 32  # chunk capacities 4, 8, 16, 32


def scheduler() -> RequestScheduler:
    return RequestScheduler(4, 8, num_pages=128, page_size=PAGE, prefill_chunk_size=CHUNK)


def prefill_lengths(scheduler: RequestScheduler, prompt_len: int, name: str = "r") -> list[int]:
    """The prompt rows' lengths of each step until the prompt's first token."""
    prompt = [(7 * i) % 50 + 1 for i in range(prompt_len)]
    scheduler.add(Request(name, b"f", prompt_len, prompt, SamplingParams(temperature=0.0, max_tokens=1), 0,
                          frozenset(), 1, time.monotonic()))
    lengths, fence = [], 0
    while (plan := scheduler.plan()) is not None:
        fence += 1
        scheduler.commit(plan, fence)
        lengths += [row.length for row in plan.rows]
        sampled = [row for row in plan.rows if row.sample]
        scheduler.complete(Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                                      (7,) * len(sampled), 0.01), plan)
    return lengths


def test_a_prompt_that_fits_one_step_is_not_split_to_explore_a_smaller_shape() -> None:
    planner = scheduler()
    planner.costs.observe(("prefill", 16), 0.01)  # the shape that takes the prompt whole is known, 4 and 8 are not
    assert prefill_lengths(planner, 12) == [12]


def test_a_cold_long_prompt_takes_the_largest_chunks() -> None:
    assert prefill_lengths(scheduler(), 70) == [32, 32, 6]


def test_a_stale_cost_is_kept_rather_than_explored_again() -> None:
    planner = scheduler()
    planner.costs.observe(("prefill", 8), 0.01, now=time.monotonic() - 60)  # older than stale_after
    planner.costs.observe(("prefill", 16), 0.01)
    assert prefill_lengths(planner, 12) == [12]
