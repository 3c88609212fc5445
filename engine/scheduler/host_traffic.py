"""The traffic between the device's prefix cache and the host tier below it, for the scheduler's prefix reuse
(engine/scheduler/prefix.py; docs/design.md, Host retention): an evicted checkpoint's page (and a hybrid model's
snapshot) spilled to the host, host entries restored into a request's pages (and snapshot rows), whether a restore
pays against computing the tokens again, the disk tier's work below the host (engine/scheduler/disk_reuse.py), and the
routing announcements of what the tiers hold.

Spills and restores are planned copies (engine/scheduler/copies.py) until the plan that makes them is committed; a
restore's host slot is pinned until then. The host slots a step last used are free once it completes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from engine.cache.checkpoint_cache import PrefixCheckpointCache, RetiredResources
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostEntry, HostTier
from engine.scheduler.copies import Copy, PageCopy, Restore, SnapshotRestore, Spill, StateCopy
from engine.scheduler.disk_reuse import DiskReuse
from engine.scheduler.plan import Completion, DiskDone, DiskWork, Plan
from engine.scheduler.policy import beats_recomputing
from engine.scheduler.request import Request


class HostTraffic:
    def __init__(self, host: HostTier | None, cache: PrefixCheckpointCache, counters: Counter[str], page_size: int,
                 page_bytes: int, snapshot_bytes: int, disk: DiskTier | None, hybrid: bool = False) -> None:
        """`host`: the host tier evicted pages (and snapshots, of `snapshot_bytes`) move to, of `page_bytes` a page
        (None: no tier, no traffic); `disk`, the disk tier below it; `hybrid`: a hybrid model's (whose exact
        checkpoints carry snapshots)."""
        self.host = host
        self.cache = cache
        self.counters = counters
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.snapshot_bytes = snapshot_bytes
        self.disk = DiskReuse(disk, host, cache, counters, page_size, page_bytes, snapshot_bytes, hybrid) \
            if disk is not None and host is not None else None
        self.pending_spills: list[Spill] = []
        self.pending_restores: list[Restore] = []
        self.pending_snapshot_restores: list[SnapshotRestore] = []
        self._host_gone: list[bytes] = []  # keys the host tier gave up, without a disk tier (for announcements)
        # Seconds a host page copy took in recent steps (spills and restores alike), and what recomputing a number
        # of prompt tokens would take by the learned step costs (0.0: not known yet). Set by the scheduler.
        self.page_copy_seconds: deque[float] = deque(maxlen=9)
        self.recompute_seconds: Callable[[int], float] = lambda tokens: 0.0

    def spill(self, retired: list[RetiredResources], state_row: Callable[[tuple[int, ...]], int | None]) -> None:
        """The evicted checkpoints' pages to host slots, with the snapshots `state_row` names (a hybrid model's
        device state row of a checkpoint's snapshots; None: the page alone).

        The device evicts leaves first, so a conversation's blocks arrive deepest first; a host short of slots would
        then take the deep blocks and refuse their parents, and no lookup could reach what it took. Slots go to
        parents first, and a checkpoint whose parent no tier holds is not spilled. They are then placed in the least
        recently used order deepest first, so that the tier gives up the ends of conversations before their
        beginnings (as the most recent entries, or as the oldest: HostTier.place)."""
        if not retired:
            return
        below: set[bytes] | None = None  # the keys on disk or on their way there, when first asked
        stored: list[tuple[bytes, int]] = []  # (key, slot): pinned meanwhile, so that room is made from older entries
        offered = sorted(retired, key=lambda r: r.length)
        for resources in offered:
            parent = resources.parent
            if parent and parent not in self.cache and parent not in self.host:
                if below is None:
                    below = self.disk.held() if self.disk is not None else set()
                if parent not in below:
                    continue
            entry = self._spill(resources, state_row(resources.snapshots))
            if entry is not None:
                self.host.pin(entry.slot)
                stored.append((resources.key, entry.slot))
        for _, slot in stored:
            self.host.unpin(slot)
        if self.host.place([r.key for r in offered], [key for key, _ in stored]):
            self.counters["host_placed_oldest"] += len(stored)

    def _spill(self, resources: RetiredResources, state_row: int | None) -> HostEntry | None:
        entry = self.host.store(resources.key, resources.length, state_row is not None, resources.parent)
        if entry is None:
            return None
        state = (state_row, entry.snapshot) if state_row is not None else None
        self.pending_spills.append(Spill(resources.pages[0], entry.slot, state))
        self.counters["host_spills"] += 1
        self.counters["host_bytes_out"] += self.page_bytes
        if state is not None:
            self.counters["host_snapshot_spills"] += 1
            self.counters["host_bytes_out"] += self.snapshot_bytes
        return entry

    def take_journal(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """(stored, hosted, evicted) keys since the last call, for the routing announcements: a key the device
        evicted is hosted while the host tier holds it, and evicted once neither holds it."""
        stored, evicted = self.cache.take_journal()
        if self.host is None:
            return stored, [], evicted
        hosted = [key for key in evicted if key in self.host]
        gone = [key for key in evicted if key not in self.host]
        if self.disk is None:
            self._host_dropped()
        dropped = self.disk.gone if self.disk is not None else self._host_gone
        # A key the device evicted may have passed through the host to disk within the same steps: still hosted.
        held = self.disk.held() if self.disk is not None and (dropped or gone) else set()
        hosted += [key for key in gone if key in held]
        gone = [key for key in gone if key not in held]
        gone += [key for key in dropped if key not in self.cache and key not in self.host and key not in held]
        dropped.clear()
        return stored, hosted, gone

    # --- restores when a request gets its slot ----------------------------------------------------------------------
    def restore_pays(self, pages: int) -> bool:
        """Whether restoring `pages` from the host is expected to beat computing their tokens again (taken while
        either is unmeasured)."""
        return beats_recomputing(self.page_copy_seconds, pages, self.recompute_seconds(pages * self.page_size))

    def run(self, keys: list[bytes], lookup: bool = False) -> list[HostEntry]:
        """The host tier's entries of keys[0], keys[1], ... up to the first it lacks. `lookup`: a request's reuse
        looks for them (not a waiting request's look ahead), which the tier's placement learns from."""
        run: list[HostEntry] = []
        if self.host is not None:
            if lookup and keys:
                self.host.placement.looked_up(keys)
            for key in keys:
                if (entry := self.host.get(key)) is None:
                    break
                run.append(entry)
        return run

    def restore_page(self, entry: HostEntry, page: int, request: Request) -> None:
        self.host.pin(entry.slot)  # until the restore is sent
        self.pending_restores.append(Restore(entry.slot, page, request))
        self.counters["host_restores"] += 1
        self.counters["host_bytes_in"] += self.page_bytes

    def restore_snapshot(self, entry: HostEntry, row: int, request: Request) -> None:
        """The entry's host snapshot into device state row `row` (a snapshot row in transit)."""
        self.host.pin(entry.slot)  # until the snapshot's restore is sent
        self.pending_snapshot_restores.append(SnapshotRestore(entry.snapshot, row, entry.slot, request))
        self.counters["host_snapshot_restores"] += 1
        self.counters["host_bytes_in"] += self.snapshot_bytes

    # --- planned, committed and completed ---------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return bool(self.pending_spills or self.pending_restores or self.pending_snapshot_restores
                    or self.host is not None and self.host.dropped or self.disk is not None and self.disk.pending)

    def planned_copies(self) -> tuple[Copy, ...]:
        """The next plan's spills then restores (pages', then snapshots'), in the order the executor makes them."""
        return (*self.pending_spills, *self.pending_restores, *self.pending_snapshot_restores)

    def planned_disk(self) -> DiskWork | None:
        """The disk tier's work for the next plan (DiskReuse); without one, what the host gave up is gone."""
        if self.disk is not None:
            return self.disk.planned(self.recompute_seconds)
        if self.host is not None:
            self._host_dropped()
        return None

    def _host_dropped(self) -> None:
        """Without a disk tier, what the host gave up is gone."""
        self._host_gone.extend(key for key, _ in self.host.dropped)
        self.host.dropped = []

    def committed(self, copies: tuple[Copy, ...], fence: int, disk: DiskWork | None) -> tuple[PageCopy | StateCopy,
                                                                                               ...]:
        """Spills, restores and disk work sent with the step of `fence`: a restore's slot may be reused from now on
        (the executor copies in order), and its pages are the reader's until that step completes. The other
        copies."""
        if self.host is not None:
            self.host.committed(fence)
            if self.disk is not None:
                self.disk.committed(disk, fence)
        if not (self.pending_spills or self.pending_restores or self.pending_snapshot_restores):
            return copies
        sent = {id(c) for c in copies}
        self.pending_spills = [c for c in self.pending_spills if id(c) not in sent]
        self.pending_restores = [c for c in self.pending_restores if id(c) not in sent]
        self.pending_snapshot_restores = [c for c in self.pending_snapshot_restores if id(c) not in sent]
        for copy in copies:
            if isinstance(copy, (Restore, SnapshotRestore)):
                self.host.unpin(copy.slot)
                copy.reader.copy_fence = max(copy.reader.copy_fence, fence)
        return tuple(c for c in copies if not isinstance(c, (Spill, Restore, SnapshotRestore)))

    def completed(self, completion: Completion, plan: Plan) -> None:
        """Steps up to the completion's fence completed: the host slots they last used are free; what the plan's
        spills and restores took is learned. A failed step's spills and disk work may not have happened: what they
        would have filled is given up."""
        if completion.tier_seconds and (plan.spills or plan.restores):  # (a snapshot's copy counts with its page)
            self.page_copy_seconds.append(completion.tier_seconds / (len(plan.spills) + len(plan.restores)))
        if self.host is None:
            return
        if completion.error is not None:
            for _, slot in plan.spills:
                self.host.forget(slot)
            if self.disk is not None:
                self.disk.done(completion.fence, None)
        self.host.completed(completion.fence)

    def disk_done(self, done: DiskDone) -> None:
        """A step's disk work ended (after the step completed: engine/executor/disk_worker.py)."""
        self.disk.done(done.fence, done.unreadable, done.seconds)

    def release(self, request: Request) -> None:
        """A request's end: its restores not sent are moot (its pages and transit row are given back with it)."""
        for restore in [c for c in self.pending_restores if c.reader is request]:
            self.pending_restores.remove(restore)
            self.host.unpin(restore.slot)
        for restore in [c for c in self.pending_snapshot_restores if c.reader is request]:
            self.pending_snapshot_restores.remove(restore)
            self.host.unpin(restore.slot)
