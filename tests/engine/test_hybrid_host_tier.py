"""A hybrid model's exact checkpoints in the host tier, at the scheduler's level (each step completed as soon as it is
committed, no model; docs/design.md, Host retention): an evicted checkpoint's snapshot moves to a host snapshot row
with its page, and a prompt that extends it restores both, the snapshot through a device snapshot row in transit; the
host's snapshot rows are bounded, the least recently used given up with their pages; a request cancelled before its
restore is sent gives back all it held. (Through the model: tests/engine/test_host_tier_steps.py.)"""

from __future__ import annotations

from common.protocol import SamplingParams
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.scheduler.plan import Completion, DiskDone, Plan
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import RequestScheduler

PAGE, CHUNK, PAGES, SLOTS, SNAPSHOTS = 4, 16, 16, 2, 2
PAGE_BYTES, SNAPSHOT_BYTES = 10, 100
FIRST = list(range(1, 11))  # two complete blocks and a partial one


def scheduler(host_snapshots: int = 4) -> RequestScheduler:
    return RequestScheduler(SLOTS, 4, PAGES, PAGE, CHUNK, snapshots=SNAPSHOTS, snapshot_bytes=SNAPSHOT_BYTES,
                            host=HostTier(32, host_snapshots), page_bytes=PAGE_BYTES)


def add(scheduler: RequestScheduler, tokens: list[int]) -> Request:
    request = Request(f"r{len(scheduler._by_id)}", b"f", len(tokens), list(tokens),
                      SamplingParams(temperature=0.0, max_tokens=2), 0, frozenset(), 2, 0.0)
    scheduler.add(request)
    return request


def complete(scheduler: RequestScheduler, plan: Plan, fence: int) -> None:
    """The step completes, and its disk work (if any) ends right after."""
    sampled = [row for row in plan.rows if row.sample]
    scheduler.complete(Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                                  (7,) * len(sampled), 0.01), plan)
    if plan.disk is not None:
        scheduler.disk_done(DiskDone(fence))


def step(scheduler: RequestScheduler, plan: Plan) -> None:
    fence = scheduler._completed_fence + 1
    scheduler.commit(plan, fence)
    complete(scheduler, plan, fence)


def run(scheduler: RequestScheduler) -> list[Plan]:
    """Every step until nothing is left to do (the copies that requests' ends left included)."""
    plans = []
    while (plan := scheduler.plan()) is not None:
        step(scheduler, plan)
        plans.append(plan)
    return plans


def evicted(scheduler: RequestScheduler, tokens: list[int]) -> Request:
    """A request of `tokens` to its end, then every checkpoint evicted from the device (spilled as the next step's
    copies): its exact checkpoints' pages and snapshots are on the host only."""
    request = add(scheduler, tokens)
    run(scheduler)
    scheduler.prefix.free_pages(PAGES)
    run(scheduler)
    return request


def test_an_evicted_exact_checkpoint_is_restored_with_its_snapshot() -> None:
    s = scheduler()
    first = evicted(s, FIRST)
    assert s.prefix.cache.snapshots == 0 and s.prefix.host.snapshots == 2  # the prompt end's and the terminal's
    assert s.counters["host_snapshot_spills"] == 2
    second = add(s, first.tokens + [5, 6])
    plans = run(s)
    assert second.phase is Phase.FINISHED and second.cached_tokens == len(FIRST) + 1  # the terminal endpoint: 11
    restoring = plans[0]
    assert len(restoring.restores) == 3 and len(restoring.state_restores) == 1  # two blocks, the partial page
    (host_row, transit), = restoring.state_restores
    assert (transit, second.slot) in restoring.state_copies  # the transit row into the request's slot row
    assert s.counters["host_snapshot_restores"] == 1 and s.counters["snapshot_restores"] == 1
    assert s.counters["host_bytes_in"] == 3 * PAGE_BYTES + SNAPSHOT_BYTES
    assert s.prefix.snapshots.ids.free_count + s.prefix.cache.snapshots == SNAPSHOTS  # the transit row came back


def test_host_snapshot_rows_are_bounded_and_the_least_recently_used_given_up() -> None:
    s = scheduler(host_snapshots=4)  # an eighth (one row) stays free or on its way
    for base in range(4):
        evicted(s, [base * 50 + t for t in FIRST])
    host = s.prefix.host
    assert host.snapshots == 3
    latest = add(s, [150 + t for t in FIRST] + [7, 9])
    oldest = add(s, FIRST + [7, 9])
    run(s)
    assert latest.cached_tokens == len(FIRST) + 1 and oldest.cached_tokens == 0


def test_a_request_cancelled_before_its_restore_is_sent_gives_back_what_it_held() -> None:
    s = scheduler()
    first = evicted(s, FIRST)
    cancelled = add(s, first.tokens + [5, 6])
    assert s.plan() is not None  # placed: its restores planned, not sent
    prefix = s.prefix
    assert len(prefix.tiers.pending_snapshot_restores) == 1 and prefix.host._pins
    s.cancel(cancelled)
    tiers = prefix.tiers
    assert not (tiers.pending_snapshot_restores or tiers.pending_restores or prefix.snapshots.pending_state
                or prefix.host._pins)
    run(s)
    assert s.pages.free_count == PAGES and prefix.snapshots.ids.free_count == SNAPSHOTS
    assert prefix.host.snapshots == 2  # what it was to restore stays on the host
    again = add(s, first.tokens + [5, 6])
    run(s)
    assert again.cached_tokens == len(FIRST) + 1


def test_an_exact_checkpoint_given_up_to_disk_is_read_back_with_its_snapshot() -> None:
    """A host tier of two snapshot rows gives the exact checkpoints of earlier conversations up to the disk, whose
    entries keep their snapshots and are indexed by their parent block: a prompt that extends one waits while it is
    read into a host slot and snapshot row, then restores it as any host hit (and reads it only once)."""
    s = RequestScheduler(SLOTS, 4, PAGES, PAGE, CHUNK, snapshots=SNAPSHOTS, snapshot_bytes=SNAPSHOT_BYTES,
                         host=HostTier(8, 2), page_bytes=PAGE_BYTES, disk=DiskTier(100, []))
    first = evicted(s, FIRST)
    for base in (1, 2, 3):
        evicted(s, [base * 50 + t for t in FIRST])
    disk = s.prefix.tiers.disk.disk
    terminal = first.history.key_at(len(FIRST) + 1)
    assert terminal not in s.prefix.host and disk.get(terminal).snapshot
    blocks = [key for key in first.history.block_keys[:2] if key not in s.prefix.host]
    second = add(s, first.tokens + [5, 6])
    plans = run(s)
    reads = [read for plan in plans if plan.disk is not None for read in plan.disk.reads]
    assert [read.key for read in reads] == blocks + [terminal]  # the blocks before it first, each once
    assert [read.snapshot >= 0 for read in reads] == [False] * len(blocks) + [True]
    assert second.phase is Phase.FINISHED and second.cached_tokens == len(FIRST) + 1
    assert s.counters["disk_reads"] == len(reads) and s.counters["host_snapshot_restores"] == 1
    assert s.counters["disk_bytes_in"] == len(reads) * PAGE_BYTES + SNAPSHOT_BYTES




def test_a_restore_waits_for_room_retiring_behind_a_step_in_flight() -> None:
    """Making room for a restore evicts another conversation's checkpoints whose pages a step still in flight reads
    (the copies of its exact checkpoint, sent after its end): the restoring request waits for that step rather than
    take its slot with no pages to restore into, and compute the whole conversation again."""
    s = scheduler()
    first = evicted(s, FIRST)
    other = add(s, list(range(100, 152)))  # with its output, 14 of the 16 pages
    in_flight: list[tuple[Plan, int]] = []
    while True:  # two steps in flight, as the engine keeps them
        while len(in_flight) < 2 and (plan := s.plan()) is not None:
            in_flight.append((plan, s._completed_fence + len(in_flight) + 1))
            s.commit(*in_flight[-1])
        if other.phase is Phase.FINISHED:
            break
        complete(s, *in_flight.pop(0))
    assert in_flight  # the copies its end left
    second = add(s, first.tokens + [5, 6])
    assert s.plan() is None and second.slot < 0  # nothing to do while the room it needs retires
    for plan, fence in in_flight:
        complete(s, plan, fence)
    run(s)
    assert second.phase is Phase.FINISHED and second.cached_tokens == len(FIRST) + 1
