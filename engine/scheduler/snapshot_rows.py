"""A hybrid model's snapshot rows for the scheduler's prefix reuse (engine/scheduler/prefix.py): the state rows beyond
the slots' that hold the recurrent state of exact checkpoints, and the state copies that take and restore them
(docs/design.md, Scheduler and prefix checkpoints).

A step that ends a request's row at a message end or its prompt end has the next step copy the slot's state row to a
snapshot row (StateCopy) before its forward, and so does the request's end; the snapshot is published with an exact
checkpoint (or given to the checkpoint of the block that ends there) as steps complete, and one not published is
dropped. A restore copies a checkpoint's snapshot into the request's slot row, or a host snapshot that came through a
snapshot row in transit (docs/design.md, Host retention). A row is reused once the fence of its last use completes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from common.prefix_history import PrefixHistory
from engine.cache.checkpoint_cache import Checkpoint, PrefixCheckpointCache, RetiredResources
from engine.cache.host_tier import HostEntry, HostTier
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.copies import Copy, PageCopy, StateCopy
from engine.scheduler.request import Request


class SnapshotRows:
    def __init__(self, rows: int, slot_rows: int, row_bytes: int, cache: PrefixCheckpointCache,
                 host: HostTier | None, page_size: int, counters: Counter[str],
                 retire: Callable[[list[RetiredResources]], None]) -> None:
        """`rows` snapshot rows (state rows `slot_rows` onwards; none: a model with no recurrent state, or a hybrid
        one that reuses nothing), of `row_bytes` each (reported in /metrics). `host`: the host tier whose entries
        may hold snapshots too. `retire`: what becomes of checkpoints evicted to free a row (PrefixReuse)."""
        self.active = rows > 0
        self.ids = PageAllocator(rows)
        self.slot_rows = slot_rows
        self.row_bytes = row_bytes
        self.cache = cache
        self.host = host
        self.page_size = page_size
        self.counters = counters
        self.retire = retire
        self.pending_state: list[StateCopy] = []
        self.fences: dict[int, int] = {}  # snapshot id -> the step that wrote it (once committed)
        self.committed_fence = 0

    def make_room(self) -> None:
        """Evict a snapshot when no row is free (it frees once its last step completes)."""
        if not self.ids.free_count:
            self.retire(self.cache.evict(0, 1))

    def allocate(self) -> int | None:
        self.make_room()
        return self.ids.allocate(1)[0] if self.ids.free_count else None

    def deepest_exact(self, history: PrefixHistory, chain: list[Checkpoint], hosted: int, limit: int
                      ) -> tuple[Checkpoint | None, HostEntry | None]:
        """The deepest exact checkpoint with a snapshot that the prompt extends up to `limit`, on the device or on
        the host (the device's first at a length), whose blocks the device's `chain` and the `hosted` host blocks
        after it hold."""
        size = self.page_size
        for depth in range(len(chain) + hosted, -1, -1):
            ends = set(self.cache.exact_ends(chain[depth - 1] if depth else None)) if depth <= len(chain) else set()
            if self.host is not None:
                ends.update(self.host.exact_ends(history.block_keys[depth - 1] if depth else b""))
            for end in sorted(ends, reverse=True):
                if end > limit or end // size > len(chain) + hosted:
                    continue
                # At a block's end the key names the block's own checkpoint too, which holds a snapshot only when
                # an endpoint fell there: one without is no place to continue a recurrent state from.
                key = history.key_at(end)
                found = self.cache.lookup(key) if end // size <= len(chain) else None
                if found is not None and found.snapshot is not None:
                    return found, None
                entry = self.host.get(key) if self.host is not None else None
                if entry is not None and entry.snapshot is not None:
                    return None, entry
        return None, None

    def awaits_snapshot(self, history: PrefixHistory, limit: int, made: list[Checkpoint | None]) -> bool:
        """Whether a hybrid request (of prefix keys `history`, computing from `limit`) had better wait before it
        takes a slot: an exact checkpoint that its prompt extends turns ready once a step in flight, or the copies
        planned next (which make `made`), complete. The next turn of a conversation that has just ended meets its
        terminal checkpoint so; taking a slot now would restore a shallower one (or none) and compute the rest
        again."""
        pending = self.cache.pending_snapshots()
        return any(c.length <= limit and (c.ready_fence is not None or any(c is m for m in made))
                   and history.key_at(c.length) == c.key for c in pending)

    def stop_at(self, request: Request, start: int, length: int) -> int:
        """A hybrid model's prefill row from `start` stops at the next message end, where a snapshot is taken."""
        if not self.active:
            return length
        return min([length] + [end - start for end in request.message_ends if start < end < start + length])

    def snapshot_at(self, request: Request, end: int) -> None:
        """The request's slot row holds its state at exactly `end` once the step just committed completes: the next
        step copies it to a snapshot row, published with an exact checkpoint as steps complete (PrefixReuse.publish)."""
        if not self.active or end <= request.published_ends or end in request.snapshots:
            return
        snapshot = self.allocate()
        if snapshot is None:
            return
        self.pending_state.append(StateCopy(request.slot, self.slot_rows + snapshot, snapshot, request, None))
        request.snapshots[end] = snapshot
        request.publish_from = 0

    def drop(self, snapshot: int) -> None:
        pending = [c for c in self.pending_state if c.source_checkpoint is None and c.snapshot == snapshot]
        for copy in pending:
            self.pending_state.remove(copy)
        self.ids.release([snapshot], self.fences.pop(snapshot, self.committed_fence))

    def attach_to_block(self, block: Checkpoint, snapshot: int) -> None:
        """A snapshot at a block's end: the block's checkpoint owns it, unless it holds one already (another
        request's, of the same state) or was evicted meanwhile. The block may turn ready before the step that copies
        the snapshot runs: a restore found through it is planned after that copy, so it runs after it too."""
        if block.snapshot is not None or block.evicted:
            self.drop(snapshot)
            return
        self.cache.attach_snapshot(block, snapshot)
        self.counters["snapshot_publications"] += 1

    def spillable(self, snapshots: tuple[int, ...]) -> int | None:
        """The device state row of an evicted checkpoint's snapshot, to spill with its page; None without one, or
        while the copy that writes it is not sent yet (a step makes its spills before its state copies)."""
        snapshot = snapshots[0] if snapshots else None
        if snapshot is None or any(c.snapshot == snapshot and c.source_checkpoint is None and not c.transit
                                   for c in self.pending_state):
            return None
        return self.slot_rows + snapshot

    def retired(self, snapshots: tuple[int, ...], fence: int) -> None:
        """An evicted checkpoint's snapshots: their rows are free once `fence` completes."""
        self.ids.release(list(snapshots), fence)
        self.counters["snapshot_evictions"] += len(snapshots)

    def restore(self, request: Request, exact: Checkpoint) -> None:
        """The copy of a device checkpoint's snapshot into the request's slot row; the checkpoint stays pinned
        until it is sent."""
        self.cache.pin(exact)
        self.pending_state.append(StateCopy(self.slot_rows + exact.snapshot, request.slot, exact.snapshot,
                                            request, exact))

    def restore_through(self, request: Request, transit: int) -> None:
        """The copy into the request's slot row of the host snapshot restored into row `transit`."""
        self.pending_state.append(StateCopy(self.slot_rows + transit, request.slot, transit, request, None,
                                            transit=True))

    def committed(self, copies: tuple[Copy, ...], fence: int) -> tuple[PageCopy, ...]:
        """The state copies sent with the step of `fence`; the page copies among `copies`."""
        self.committed_fence = fence
        states = [c for c in copies if isinstance(c, StateCopy)]
        self.pending_state = [c for c in self.pending_state if c not in states]
        for copy in states:
            copy.reader.copy_fence = max(copy.reader.copy_fence, fence)  # the copy uses the reader's slot row
            if copy.transit:  # the row a host snapshot came through is free once this step completes
                self.ids.release([copy.snapshot], fence)
                self.counters["snapshot_restores"] += 1
            elif copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, fence)
                self.counters["snapshot_restores"] += 1
            else:
                self.fences[copy.snapshot] = fence
        return tuple(c for c in copies if isinstance(c, PageCopy))

    def release(self, request: Request) -> None:
        """A request's end: its restores not sent are moot, and its snapshots not published are dropped."""
        restoring = [c for c in self.pending_state if c.reader is request and (c.source_checkpoint or c.transit)]
        for state in restoring:
            self.pending_state.remove(state)  # a restore not sent: moot now
            if state.transit:
                self.ids.release([state.snapshot], self.committed_fence)
            else:
                self.cache.unpin(state.source_checkpoint, request.last_fence)
        for snapshot in request.snapshots.values():  # taken (or to be) but not published
            self.drop(snapshot)
        request.snapshots = {}
