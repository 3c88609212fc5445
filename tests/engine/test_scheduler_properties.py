"""State-machine tests of the scheduler and prefix cache: random admit / plan / commit / complete / cancel / evict.

A fake executor completes steps in order with random tokens, so thousands of interleavings run in seconds. After every
rule: every page is in exactly one place (free, retiring, the cache, or one live request), no free page has a step in
flight that used it, and checkpoint pins equal what live requests hold.
"""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.protocol import SamplingParams
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.scheduler.plan import Completion, DiskDone, Plan
from engine.scheduler.request import Phase, Request
from engine.scheduler.rows import next_row
from engine.scheduler.scheduler import RequestScheduler, StalePlan

PAGES, PAGE, SLOTS = 24, 4, 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12], [20, 21, 22]]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = RequestScheduler(SLOTS, 8, PAGES, PAGE, 8)
        self.in_flight: deque[tuple[int, Plan]] = deque()
        self.disk_in_flight: list[tuple[int, Plan]] = []  # completed steps whose disk work has not ended
        self.fence = 0
        self.completed = 0
        self.last_use: dict[int, int] = {}
        self.requests: list[Request] = []
        self.random = random.Random(0)

    @rule(prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(0, 40), max_size=9),
          max_tokens=st.integers(1, 24), ends=st.lists(st.integers(1, 18), max_size=3), min_tokens=st.integers(0, 6))
    def admit(self, prefix: list[int], extra: list[int], max_tokens: int, ends: list[int], min_tokens: int) -> None:
        if not self.scheduler.can_admit():
            return
        prompt = prefix + extra
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
        request = Request(f"r{len(self.requests)}", b"t", len(prompt), list(prompt), params, 0, frozenset({0}),
                          max_tokens, float(len(self.requests)),
                          message_ends=sorted({e for e in ends if e < len(prompt)}))
        self.scheduler.add(request)
        self.requests.append(request)

    @precondition(lambda self: len(self.in_flight) < 2)
    @rule()
    def plan_and_commit(self) -> None:
        plan = self.scheduler.plan()
        if plan is None:
            return
        assert plan.kind == Plan(plan.rows).kind  # the kind the scheduler knew is the one its rows have
        for row in plan.rows:
            request = self.scheduler.slots[row.slot]
            if row.draft:  # a verify round starts from the committed state: nothing of the request is pending
                assert not self.scheduler.in_flight(request) and row.tokens[0] == request.tokens[-1]
                assert row.start == len(request.tokens) - 1
            if row.tokens is None:  # a decode row, moved on from the request's previous one: as if built anew
                assert row == next_row(request, 1, PAGE)
        self.fence += 1
        self.scheduler.commit(plan, self.fence)
        for row in plan.rows:
            for page in row.page_table:
                self.last_use[page] = self.fence
        for src, dst in plan.copies:
            self.last_use[src] = self.last_use[dst] = self.fence
        for _, dst in plan.restores:  # (a spill reads a page before anything this step or later writes it)
            self.last_use[dst] = self.fence
        self.in_flight.append((self.fence, plan))

    @precondition(lambda self: self.in_flight)
    @rule()
    def complete(self) -> None:
        fence, plan = self.in_flight.popleft()
        sampled = [row for row in plan.rows if row.sample]
        tokens = tuple(self.random.randrange(50) for _ in sampled)
        # A verify row accepts any number of its drafts (the executor's verdict is not the scheduler's business).
        accepted = tuple(self.random.randint(0, len(r.draft)) for r in sampled) if plan.kind == "verify" else ()
        # Durations grow with the step's tokens, so a verify round is not always worth its cost (or its bubble).
        completion = Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled), tokens,
                                0.001 * (4 + plan.num_tokens), accepted=accepted)
        self.scheduler.complete(completion, plan)
        self.completed = fence
        if plan.disk is not None:
            self.disk_in_flight.append((fence, plan))
        for row in plan.rows:
            request = self.scheduler.slots[row.slot]
            if row.draft and request is not None and request.generation == row.generation and \
                    not self.scheduler.in_flight(request):
                assert len(request.pages) <= -(-len(request.tokens) // PAGE)  # rejected positions' pages went back

    @precondition(lambda self: self.disk_in_flight)
    @rule(index=st.integers(0, 3))
    def end_disk_work(self, index: int) -> None:
        """A completed step's disk work ends, at any time after the step and in any order (the executor's disk
        thread keeps the order it was handed, which a tensor-parallel group's ranks may not share)."""
        fence, plan = self.disk_in_flight.pop(index % len(self.disk_in_flight))
        self.scheduler.disk_done(DiskDone(fence, self.unreadable(plan)))

    def unreadable(self, plan: Plan) -> tuple[int, ...]:
        """The host slots of the plan's disk reads whose files the executor found unreadable."""
        return ()

    @rule(steps=st.integers(1, 8))
    def advance(self, steps: int) -> None:
        """Several plan/complete rounds at once, so requests get deep into decoding within an example."""
        for _ in range(steps):
            if len(self.in_flight) < 2:
                self.plan_and_commit()
            if self.in_flight:
                self.complete()
            if self.disk_in_flight and self.random.random() < 0.5:
                self.end_disk_work(0)

    @rule(index=st.integers(0, 50))
    def cancel(self, index: int) -> None:
        live = [r for r in self.requests if r.phase is not Phase.FINISHED]
        if live:
            self.scheduler.cancel(live[index % len(live)])

    @precondition(lambda self: len(self.in_flight) < 2)
    @rule(index=st.integers(0, 50))
    def stale_plan_is_refused(self, index: int) -> None:
        plan = self.scheduler.plan()
        if plan is None or not plan.rows:
            if plan is not None:  # copies only: commit it like any other plan
                self.fence += 1
                self.scheduler.commit(plan, self.fence)
                for src, dst in plan.copies:
                    self.last_use[src] = self.last_use[dst] = self.fence
                self.in_flight.append((self.fence, plan))
            return
        row = plan.rows[index % len(plan.rows)]
        self.scheduler.cancel(self.scheduler.slots[row.slot])
        with pytest.raises(StalePlan):
            self.scheduler.commit(plan, self.fence + 1)

    @rule(pages=st.integers(1, PAGES))
    def evict(self, pages: int) -> None:
        self.scheduler.prefix.free_pages(pages)

    @invariant()
    def every_page_in_exactly_one_place(self) -> None:
        allocator = self.scheduler.pages
        places = Counter(allocator._free)
        places.update(p for _, _, pages in allocator._retiring for p in pages)
        places.update(c.page for c in self.scheduler.prefix.cache._by_key.values())
        places.update(self.scheduler.prefix.page_copies.held)
        for request in self.requests:
            if request.phase is not Phase.FINISHED:
                places.update(p for p in request.pages if p not in request.cache_pages)
        assert sorted(places) == list(range(PAGES)), places
        assert all(count == 1 for count in places.values()), places

    @invariant()
    def outputs_stay_within_limits_and_positions_follow_tokens(self) -> None:
        for request in self.requests:
            assert request.outputs <= request.max_outputs
            if request.phase is Phase.DECODE and not self.scheduler.in_flight(request):
                assert request.scheduled == len(request.tokens) - 1  # rejected drafts left no positions behind
                assert len(request.pages) >= -(-request.scheduled // PAGE)

    @invariant()
    def no_free_page_is_still_in_use(self) -> None:
        for page in self.scheduler.pages._free:
            assert self.last_use.get(page, 0) <= self.completed

    @invariant()
    def pins_equal_what_live_requests_and_pending_copies_hold(self) -> None:
        expected: Counter[int] = Counter()
        holders = [r.pinned for r in self.requests if r.phase is not Phase.FINISHED]
        holders += [c.source_checkpoint for c in self.scheduler.prefix.page_copies.pending]
        holders += [c.source_checkpoint for c in self.scheduler.prefix.snapshots.pending_state]  # (a hybrid's restores)
        assert all(r.pinned is None for r in self.requests if r.phase is Phase.FINISHED)
        for node in holders:
            while node is not None:
                expected[node.id] += 1
                node = node.parent
        for checkpoint in self.scheduler.prefix.cache._by_key.values():
            assert checkpoint.pins == expected[checkpoint.id]


class HostTierSchedulerMachine(SchedulerMachine):
    """The same rules with a host tier that evicted checkpoints move to and requests restore from, and a disk tier
    below it whose files are now and then unreadable."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = self.tiered_scheduler()
        self.announced: set[bytes] = set()  # what a frontend's routing index holds after the announcements
        self.files: set[bytes] = set()  # the disk tier's directory as the executor's disk thread leaves it
        commit = self.scheduler.commit

        def commit_and_follow_files(plan: Plan, fence: int) -> None:
            commit(plan, fence)
            self.follow_files(plan)

        self.scheduler.commit = commit_and_follow_files

    def tiered_scheduler(self) -> RequestScheduler:
        return RequestScheduler(SLOTS, 8, PAGES, PAGE, 8, host=HostTier(12), disk=DiskTier(4, []))

    def follow_files(self, plan: Plan) -> None:
        """A committed plan's disk work as the disk thread does it, in commit order: deletions, then writes; the
        directory never holds more files than the tier's budget."""
        if plan.disk is not None:
            self.files.difference_update(plan.disk.erasures)
            self.files.update(write.key for write in plan.disk.writes)
            assert len(self.files) <= self.scheduler.prefix.tiers.disk.disk.capacity, len(self.files)

    @rule(slow=st.booleans())
    def disk_speed(self, slow: bool) -> None:
        """The disk's learned file time turns slower (or faster) than computing a page's tokens again: what the host
        gives up is then gone at once (or written)."""
        self.scheduler.prefix.tiers.disk.file_seconds.extend([1.0 if slow else 1e-6] * 9)

    def unreadable(self, plan: Plan) -> tuple[int, ...]:
        return tuple(read.slot for read in plan.disk.reads if self.random.random() < 0.2) if plan.disk else ()

    @invariant()
    def every_host_slot_in_exactly_one_place(self) -> None:
        host, disk = self.scheduler.prefix.host, self.scheduler.prefix.tiers.disk
        places = host._slots.free + host._slots.dropping + [slot for _, slot in host._slots.retiring]
        places += [*host._slots.held, *(entry.slot for entry in host._entries.values())]
        places += [read.slot for read, _ in disk._loading.values()] if disk is not None else []
        assert sorted(places) == list(range(host.slots)), places

    @invariant()
    def no_free_host_slot_has_disk_work_in_flight(self) -> None:
        rows, slots = self.scheduler.prefix.host._rows.free, self.scheduler.prefix.host._slots.free
        for _, plan in self.disk_in_flight:
            assert not {work.slot for work in plan.disk.writes + plan.disk.reads} & set(slots)
            assert not {work.snapshot for work in plan.disk.writes + plan.disk.reads} & set(rows)

    @rule(pages=st.integers(1, PAGES))
    def evict_cached(self, pages: int) -> None:
        """Evict whatever the cache may give up, free pages or not: later prompts find those blocks on the host."""
        prefix = self.scheduler.prefix
        prefix._retire(prefix.cache.evict(pages))

    @invariant()
    def host_slots_are_pinned_by_pending_restores_only(self) -> None:
        tiers = self.scheduler.prefix.tiers
        assert tiers.host._pins == Counter(r.slot for r in tiers.pending_restores + tiers.pending_snapshot_restores)
        assert all(r.reader.phase is not Phase.FINISHED and r.page in r.reader.pages for r in tiers.pending_restores)
        slots = [entry.slot for entry in tiers.host._entries.values()]
        assert len(slots) == len(set(slots))

    @invariant()
    def announcements_count_both_tiers(self) -> None:
        prefix = self.scheduler.prefix
        stored, hosted, evicted = prefix.tiers.take_journal()
        self.announced.update(stored)
        self.announced.update(hosted)
        self.announced.difference_update(evicted)
        held = prefix.tiers.disk.held() if prefix.tiers.disk is not None else set()
        assert self.announced == set(prefix.cache.ready_keys()) | set(prefix.host.keys()) | held


class HybridHostTierSchedulerMachine(HostTierSchedulerMachine):
    """The same rules for a hybrid model's exact checkpoints (snapshot rows on the device and the host, files with
    snapshots on disk): every snapshot row, on the device and the host, is in exactly one place, whatever is
    cancelled or evicted while its spill, restore or read is planned, and none is free while a step in flight uses
    it."""

    SNAPSHOTS, HOST_SNAPSHOTS = 3, 4

    def __init__(self) -> None:
        super().__init__()
        self.row_use: dict[int, int] = {}  # device state row -> the last fence that used it
        self.cancelled_restores = 0
        self.host_row_use: dict[int, int] = {}

    def tiered_scheduler(self) -> RequestScheduler:
        return RequestScheduler(SLOTS, 8, PAGES, PAGE, 8, snapshots=self.SNAPSHOTS,
                                host=HostTier(6, self.HOST_SNAPSHOTS), disk=DiskTier(4, []))

    def plan_and_commit(self) -> None:
        super().plan_and_commit()
        if self.in_flight and self.in_flight[-1][0] == self.fence:
            self._record_rows(self.in_flight[-1][1])

    def stale_plan_is_refused(self, index: int) -> None:
        committed = self.fence
        super().stale_plan_is_refused(index)
        if self.fence > committed:  # a plan of copies only went out
            self._record_rows(self.in_flight[-1][1])

    def _record_rows(self, plan: Plan) -> None:
        for source, destination in plan.state_copies:
            self.row_use[source] = self.row_use[destination] = self.fence
        for row, host_row in plan.state_spills + tuple((row, host) for host, row in plan.state_restores):
            self.row_use[row] = self.host_row_use[host_row] = self.fence
        for work in (plan.disk.writes + plan.disk.reads) if plan.disk is not None else ():
            if work.snapshot >= 0:
                self.host_row_use[work.snapshot] = self.fence

    @precondition(lambda self: len(self.in_flight) < 2)
    @rule()
    def cancel_a_restore_before_it_is_sent(self) -> None:
        """Plan, and cancel a request whose snapshot restore from the host that plan was to send: what the restore
        held (its host entry, its snapshot row in transit, its pages) is given back."""
        self.scheduler.plan()
        restoring = [c.reader for c in self.scheduler.prefix.tiers.pending_snapshot_restores]
        if restoring:
            self.scheduler.cancel(restoring[0])
            self.cancelled_restores += 1

    @rule(snapshots=st.integers(1, SNAPSHOTS))
    def evict_snapshots(self, snapshots: int) -> None:
        prefix = self.scheduler.prefix
        prefix._retire(prefix.cache.evict(0, snapshots))

    @invariant()
    def every_snapshot_row_in_exactly_one_place(self) -> None:
        prefix = self.scheduler.prefix
        ids = prefix.snapshots.ids
        places = list(ids._free) + [i for _, _, rows in ids._retiring for i in rows]
        places += [c.snapshot for c in prefix.cache._by_key.values() if c.snapshot is not None]
        places += [i for r in self.requests if r.phase is not Phase.FINISHED for i in r.snapshots.values()]
        places += [c.snapshot for c in prefix.snapshots.pending_state if c.transit]
        assert sorted(places) == list(range(self.SNAPSHOTS)), places
        rows = prefix.host._rows
        places = rows.free + rows.dropping + [row for _, row in rows.retiring] + list(rows.held)
        places += [e.snapshot for e in prefix.host._entries.values() if e.snapshot is not None]
        places += [read.snapshot for read, _ in prefix.tiers.disk._loading.values() if read.snapshot >= 0]
        assert sorted(places) == list(range(self.HOST_SNAPSHOTS)), places

    @invariant()
    def no_free_snapshot_row_is_still_in_use(self) -> None:
        prefix = self.scheduler.prefix
        assert all(self.row_use.get(SLOTS + i, 0) <= self.completed for i in prefix.snapshots.ids._free)
        assert all(self.host_row_use.get(row, 0) <= self.completed for row in prefix.host._rows.free)


class RandomProposer:
    """Drafts of random tokens (the stop id among them), as deep as asked."""

    name = "random"

    def __init__(self) -> None:
        self.random = random.Random(2)

    def available(self, request: Request, depth: int) -> int:
        return depth

    def propose(self, batch: list[tuple[Request, int]], live: set) -> list[tuple[int, ...]]:
        return [tuple(self.random.randrange(50) for _ in range(depth)) for _, depth in batch]


class SpeculativeSchedulerMachine(SchedulerMachine):
    """The same rules with verify rounds among the plans: variable accepted lengths, stops inside drafts."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = RequestScheduler(SLOTS, 8, PAGES, PAGE, 8, proposer=RandomProposer())


# Derandomized: CI runs the same interleavings each time (a soak with more examples is a local job).
SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None, derandomize=True)
test_scheduler_state_machine = SchedulerMachine.TestCase
SpeculativeSchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                                         derandomize=True)
test_speculative_scheduler_state_machine = SpeculativeSchedulerMachine.TestCase
HostTierSchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                                      derandomize=True)
test_host_tier_scheduler_state_machine = HostTierSchedulerMachine.TestCase
HybridHostTierSchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                                            derandomize=True)
test_hybrid_host_tier_scheduler_state_machine = HybridHostTierSchedulerMachine.TestCase
