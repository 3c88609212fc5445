"""The host tier's restores against recomputation: a restore is taken unless the learned costs say that computing
the tokens again is faster (docs/design.md, Host retention)."""

from __future__ import annotations

from common.protocol import SamplingParams
from engine.cache.host_tier import HostTier
from engine.scheduler.plan import Completion
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler

PAGE, CHUNK = 4, 16
PROMPT = list(range(1, 14))  # three complete blocks, and the position whose logits are read


def run(scheduler: RequestScheduler, name: str) -> tuple[Request, tuple[tuple[int, int], ...]]:
    """One request of PROMPT to its end, every step completed as soon as it is committed; the restores planned."""
    request = Request(name, b"f", len(PROMPT), list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1), 0,
                      frozenset({0}), 1, 0.0)
    scheduler.add(request)
    fence, restores = scheduler._completed_fence, ()
    while (plan := scheduler.plan()) is not None:
        fence += 1
        scheduler.commit(plan, fence)
        sampled = [row for row in plan.rows if row.sample]
        scheduler.complete(Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                                      (0,) * len(sampled), 0.01), plan)
        restores += plan.restores
    return request, restores


def evicted_scheduler() -> RequestScheduler:
    scheduler = RequestScheduler(2, 4, 8, PAGE, CHUNK, host=HostTier(8))
    run(scheduler, "first")
    scheduler.prefix.free_pages(8)  # every block leaves the device for the host
    return scheduler


def test_blocks_evicted_to_the_host_are_restored_while_restoring_is_faster() -> None:
    scheduler = evicted_scheduler()
    scheduler.costs.observe(("prefill", CHUNK), 1.0)
    scheduler.prefix.tiers.page_copy_seconds.append(0.001)
    second, restores = run(scheduler, "second")
    assert second.cached_tokens == 12 and len(restores) == 3


def test_a_restore_slower_than_recomputing_is_not_taken() -> None:
    scheduler = evicted_scheduler()
    scheduler.costs.observe(("prefill", CHUNK), 0.001)
    scheduler.prefix.tiers.page_copy_seconds.append(1.0)
    second, restores = run(scheduler, "second")
    assert second.cached_tokens == 0 and not restores
    assert scheduler.counters["host_declined"] == 1
