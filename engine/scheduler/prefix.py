"""Prefix reuse for the scheduler: find a request's longest cached prefix when it gets a slot, publish its blocks and
message ends as checkpoints as its steps complete, and give back what it held when it ends.

Page ownership: a request's page list mixes pages the cache owns (shared, read-only for everyone: complete blocks) and
private pages. An exact checkpoint inside a block gets a private copy of that partial page, so the request that made it
can keep writing its own page, and a request that reuses it writes into a fresh copy.

A hybrid model (`snapshots` given) reuses exact checkpoints only, each holding a snapshot of the recurrent state at
exactly its length (docs/design.md, Scheduler and prefix checkpoints): a step that ends a request's row at a message
end or its prompt end has the next step copy the slot's state row to a snapshot row (StateCopy) before its forward,
and so does the request's end, at the position its submitted steps consumed (the terminal endpoint); the exact
checkpoint is published with that snapshot and a private copy of its partial page (at a block boundary, the block's
own checkpoint takes the snapshot: its page is complete). A later request restores the deepest snapshot whose prefix
its prompt extends into its own slot row and continues from exactly there. With a host tier, an evicted checkpoint's
snapshot moves to a host snapshot row with its page, and comes back through a device snapshot row in transit
(SnapshotRestore, then a StateCopy into the slot's row: docs/design.md, Host retention).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace

from common.prefix_history import PrefixHistory, RecentHistories, prefix_events
from engine.cache.checkpoint_cache import Checkpoint, Created, PrefixCheckpointCache, RetiredResources
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostEntry, HostTier
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.copies import Copy, PageCopy, Restore, SnapshotRestore, Spill, StateCopy
from engine.scheduler.disk_reuse import DiskReuse
from engine.scheduler.plan import Completion, DiskWork, Plan
from engine.scheduler.request import Request

# Request.publish_from of a request whose prefixes are never published.
NEVER = 2 ** 62


class PrefixReuse:
    def __init__(self, identity: bytes, page_size: int, pages: PageAllocator, counters: Counter[str],
                 snapshots: int | None = None, slots: int = 0, snapshot_bytes: int = 0,
                 host: HostTier | None = None, page_bytes: int = 0, disk: DiskTier | None = None) -> None:
        """`snapshots`: a hybrid model's snapshot rows (state rows `slots` onwards); its requests carry a recurrent
        state that pages of KV cannot rebuild (engine/model/recurrent_state.py), so only an exact checkpoint with a
        snapshot is a start, and with no snapshot rows nothing is reused or published. `snapshot_bytes`: a
        snapshot row's size (reported in /metrics). `host`: the host tier that evicted pages (and snapshots) move
        to, of `page_bytes` a page; `disk`, the disk tier below it."""
        self.hybrid = snapshots is not None
        self.enabled = not self.hybrid or snapshots > 0
        self.snapshot_ids = PageAllocator(snapshots or 0)
        self.slot_rows = slots
        self.snapshot_bytes = snapshot_bytes
        self.pending_state: list[StateCopy] = []
        self.snapshot_fences: dict[int, int] = {}  # snapshot id -> the step that wrote it (once committed)
        self.committed_fence = 0
        self.identity = identity
        self.page_size = page_size
        self.pages = pages
        self.cache = PrefixCheckpointCache()
        self.recent = RecentHistories(identity, page_size)  # a long prompt seen again hashes only its new end
        self.counters = counters
        self.pending_copies: list[PageCopy] = []
        # Private pages of ended requests that a pending copy still reads: released once that copy is submitted.
        self.held_for_copies: set[int] = set()
        self.host = host
        self.page_bytes = page_bytes
        self.pending_spills: list[Spill] = []
        self.pending_restores: list[Restore] = []
        self.pending_snapshot_restores: list[SnapshotRestore] = []
        self.disk = DiskReuse(disk, self.host, self.cache, counters, page_bytes) \
            if disk is not None and self.host is not None and not self.hybrid else None
        self._host_gone: list[bytes] = []  # keys the host tier gave up, without a disk tier (for announcements)
        # Seconds a host page copy took in recent steps (spills and restores alike), and what recomputing a number
        # of prompt tokens would take by the learned step costs (0.0: not known yet). Set by the scheduler.
        self.page_copy_seconds: deque[float] = deque(maxlen=9)
        self.recompute_seconds: Callable[[int], float] = lambda tokens: 0.0

    def track(self, request: Request) -> None:
        # An image's content keys every prefix that reaches its first token; a salt, every prefix.
        request.history = self.recent.history(request.tokens, prefix_events(request.cache_salt, request.images))

    @staticmethod
    def _history(request: Request) -> PrefixHistory:
        """The request's prefix keys, brought up to its committed tokens: committing a token does not touch the
        history (a call per live request and step), so every read here catches up first."""
        history = request.history
        if len(history) < len(request.tokens):
            history.extend(request.tokens[len(history):])
        return history

    def free_pages(self, needed: int) -> None:
        """Evict unpinned checkpoints (least recently used leaves first) until `needed` pages are free or
        retiring, or nothing more can go."""
        shortfall = needed - self.pages.free_count
        if shortfall > 0:
            self._retire(self.cache.evict(shortfall))

    def advance_completed(self, fence: int) -> None:
        """Steps up to `fence` completed: checkpoints they wrote become visible, snapshot rows they last used free."""
        self.cache.advance_completed(fence)
        self.snapshot_ids.advance_completed(fence)

    def _retire(self, retired: list[RetiredResources]) -> None:
        for resources in retired:
            if self.host is not None:
                self._spill(resources)
            self.pages.release(resources.pages, resources.fence)
            if resources.snapshots:
                self.snapshot_ids.release(list(resources.snapshots), resources.fence)
                self.counters["snapshot_evictions"] += len(resources.snapshots)

    def _spill(self, resources: RetiredResources) -> None:
        """The evicted checkpoint's page to a host slot, and its snapshot (a hybrid model's) to a host snapshot row,
        unless the copy that writes that snapshot is not sent yet: a step makes its spills before its state copies."""
        snapshot = resources.snapshots[0] if resources.snapshots else None
        if snapshot is not None and any(c.snapshot == snapshot and c.source_checkpoint is None and not c.transit
                                        for c in self.pending_state):
            snapshot = None
        entry = self.host.store(resources.key, resources.length, snapshot is not None, resources.parent)
        if entry is None:
            return
        state = (self.slot_rows + snapshot, entry.snapshot) if snapshot is not None else None
        self.pending_spills.append(Spill(resources.pages[0], entry.slot, state))
        self.counters["host_spills"] += 1
        self.counters["host_bytes_out"] += self.page_bytes
        if state is not None:
            self.counters["host_snapshot_spills"] += 1
            self.counters["host_bytes_out"] += self.snapshot_bytes

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
        held = self.disk.held() if self.disk is not None and dropped else set()
        gone += [key for key in dropped if key not in self.cache and key not in self.host and key not in held]
        dropped.clear()
        return stored, hosted, gone

    def _allocate_snapshot(self) -> int | None:
        if not self.snapshot_ids.free_count:
            self._retire(self.cache.evict(0, 1))
        return self.snapshot_ids.allocate(1)[0] if self.snapshot_ids.free_count else None

    # --- reuse when a request gets its slot -------------------------------------------------------------------------
    def reuse(self, request: Request, allocate: Callable[[int], list[int] | None]) -> None:
        if not self.enabled:
            request.publish_from = NEVER
            return
        if request.sampling.prompt_logprobs is not None:
            return  # every prompt position must be computed to report its logprob
        if self.hybrid:
            self._restore(request, allocate)
            return
        history, size = self._history(request), self.page_size
        limit = request.first_computed  # the position whose logits are read is always computed
        chain = self.cache.lookup_run(history.block_keys, limit // size)
        self.counters["prefix_lookups"] += 1
        if chain:
            self.cache.pin(chain[-1])  # while pages are allocated below (which may evict)
        try:
            self._reuse_found(request, chain, allocate)
        finally:
            if chain:
                self.cache.unpin(chain[-1], 0)

    def _reuse_found(self, request: Request, chain: list[Checkpoint],
                     allocate: Callable[[int], list[int] | None]) -> None:
        """Reuse the device's blocks `chain`, the host tier's blocks after them, and the exact checkpoint (on the
        device or the host) of the latest message end just beyond those."""
        history, size, limit = self._history(request), self.page_size, request.first_computed
        hosted = self._host_run(history.block_keys[len(chain): limit // size])
        if hosted and not self._restore_pays(len(hosted)):
            hosted = []
            self.counters["host_declined"] += 1
        depth = (len(chain) + len(hosted)) * size
        reused, exact, exact_hosted = depth, None, None
        for end in sorted(request.message_ends, reverse=True):
            if depth < end <= limit and end // size == depth // size:
                key = history.key_at(end)
                exact = None if hosted else self.cache.lookup(key)
                exact_hosted = self.host.get(key) if exact is None and self.host is not None else None
                if exact is not None or exact_hosted is not None:
                    reused = end
                    break
        if self.host is not None and len(chain) * size < limit:
            self.counters["host_hits" if hosted or exact_hosted else "host_misses"] += 1
        wanted = len(hosted) + (exact is not None or exact_hosted is not None)
        if exact is not None:
            self.cache.pin(exact)  # a leaf: the allocation below must not evict it
        pages = allocate(wanted) if wanted else []
        if exact is not None:
            self.cache.unpin(exact, 0)
        if pages is None:  # no pages for the restores or the private copy: the device's blocks only
            hosted, exact, exact_hosted, pages, reused = [], None, None, [], len(chain) * size
        if reused == 0:
            self.counters["prefix_misses"] += 1
            return
        for entry, page in zip(hosted + ([exact_hosted] if exact_hosted is not None else []), pages):
            self._restore_page(entry, page, request)
        if exact is not None:
            self._copy(PageCopy(exact.page, pages[-1], None, request, exact))
        self.counters["prefix_hits"] += 1
        self.counters["reused_tokens"] += reused
        cached = [c.page for c in chain]
        request.cache_pages = set(cached)
        request.pages = cached + pages
        request.block_chain = list(chain)
        request.published_ends = reused
        if exact is not None or chain:
            self._pin(request, exact or chain[-1])
        request.scheduled = reused
        if not request.started:
            request.cached_tokens = reused

    def _restore_pays(self, pages: int) -> bool:
        """Whether restoring `pages` from the host is expected to beat computing their tokens again (taken while
        either is unmeasured)."""
        if not self.page_copy_seconds:
            return True
        recompute = self.recompute_seconds(pages * self.page_size)
        return recompute == 0.0 or pages * statistics.median(self.page_copy_seconds) <= recompute

    def _host_run(self, keys: list[bytes]) -> list[HostEntry]:
        """The host tier's entries of keys[0], keys[1], ... up to the first it lacks."""
        run: list[HostEntry] = []
        if self.host is not None:
            for key in keys:
                if (entry := self.host.get(key)) is None:
                    break
                run.append(entry)
        return run

    def _restore_page(self, entry: HostEntry, page: int, request: Request) -> None:
        self.host.pin(entry.slot)  # until the restore is sent
        self.pending_restores.append(Restore(entry.slot, page, request))
        self.counters["host_restores"] += 1
        self.counters["host_bytes_in"] += self.page_bytes

    def _restore(self, request: Request, allocate: Callable[[int], list[int] | None]) -> None:
        """A hybrid model's reuse: the deepest exact checkpoint with a snapshot that the prompt extends (a message
        end, a prompt end or a terminal endpoint of an earlier request), on the device or the host: its blocks'
        pages shared (or restored from the host), its partial page copied (or restored), its snapshot restored into
        the request's slot row (from the host through a snapshot row in transit)."""
        history, size = self._history(request), self.page_size
        limit = request.first_computed
        chain = self.cache.lookup_run(history.block_keys, limit // size)
        self.counters["prefix_lookups"] += 1
        hosted = self._host_run(history.block_keys[len(chain): limit // size])
        if hosted and not self._restore_pays(len(hosted)):
            hosted = []
            self.counters["host_declined"] += 1
        exact, entry = self._deepest_exact(history, chain, len(hosted), limit)
        length = exact.length if exact is not None else entry.length if entry is not None else 0
        blocks, restored = chain[: length // size], hosted[: max(length // size - len(chain), 0)]
        if self.host is not None and len(chain) * size < limit:
            self.counters["host_hits" if entry is not None or restored else "host_misses"] += 1
        # What the allocations below may evict (they spill to the host, whose entries may give way in turn) is pinned.
        held = exact if exact is not None else blocks[-1] if blocks else None
        used = restored + ([entry] if entry is not None else [])
        if held is not None:
            self.cache.pin(held)
        for pinned in used:
            self.host.pin(pinned.slot)
        wanted = len(restored) + (length % size != 0)
        pages = (allocate(wanted) if wanted else []) if length else None
        transit = self._allocate_snapshot() if entry is not None and pages is not None else None
        if pages is not None and entry is not None and transit is None:  # no snapshot row to restore through
            self.pages.release(pages, 0)
            pages = None
        if pages is None:
            self.counters["prefix_misses"] += 1
        else:
            self._plan_restore(request, exact, entry, restored, pages, transit)
            self.counters["prefix_hits"] += 1
            self.counters["reused_tokens"] += length
            request.cache_pages = {c.page for c in blocks}
            request.pages = [c.page for c in blocks] + pages
            request.block_chain = list(blocks)
            request.published_ends = request.scheduled = length
            if held is not None:
                self._pin(request, held)
            if not request.started:
                request.cached_tokens = length
        if held is not None:
            self.cache.unpin(held, 0)
        for pinned in used:
            self.host.unpin(pinned.slot)

    def _deepest_exact(self, history: PrefixHistory, chain: list[Checkpoint], hosted: int, limit: int
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

    def _plan_restore(self, request: Request, exact: Checkpoint | None, entry: HostEntry | None,
                      restored: list[HostEntry], pages: list[int], transit: int | None) -> None:
        """The copies of a hybrid request's restore: host blocks into its fresh `pages`, then the partial page of
        the exact checkpoint (from the device's `exact` or the host's `entry`) into the last, and the snapshot."""
        for hosted, page in zip(restored, pages):
            self._restore_page(hosted, page, request)
        if len(pages) > len(restored):
            if exact is not None:
                self._copy(PageCopy(exact.page, pages[-1], None, request, exact))
            else:
                self._restore_page(entry, pages[-1], request)
        if exact is not None:
            self.cache.pin(exact)  # for the state copy, until it is sent
            self.pending_state.append(StateCopy(self.slot_rows + exact.snapshot, request.slot, exact.snapshot,
                                                request, exact))
            return
        self.host.pin(entry.slot)  # until the snapshot's restore is sent
        self.pending_snapshot_restores.append(SnapshotRestore(entry.snapshot, self.slot_rows + transit, entry.slot,
                                                              request))
        self.pending_state.append(StateCopy(self.slot_rows + transit, request.slot, transit, request, None,
                                            transit=True))
        self.counters["host_snapshot_restores"] += 1
        self.counters["host_bytes_in"] += self.snapshot_bytes

    def awaits_snapshot(self, request: Request) -> bool:
        """Whether a hybrid request had better wait before it takes a slot: an exact checkpoint that its prompt
        extends turns ready once a step in flight, or the copies planned next, complete. The next turn of a
        conversation that has just ended meets its terminal checkpoint so; taking a slot now would restore a
        shallower one (or none) and compute the rest again."""
        if not (self.hybrid and self.enabled) or request.sampling.prompt_logprobs is not None:
            return False
        pending = self.cache.pending_snapshots()
        if not pending:
            return False
        history, limit = self._history(request), request.first_computed
        made = [copy.made for copy in self.pending_copies]
        return any(c.length <= limit and (c.ready_fence is not None or any(c is m for m in made))
                   and history.key_at(c.length) == c.key for c in pending)

    def stop_at(self, request: Request, start: int, length: int) -> int:
        """A hybrid model's prefill row from `start` stops at the next message end, where a snapshot is taken."""
        if not (self.hybrid and self.enabled):
            return length
        return min([length] + [end - start for end in request.message_ends if start < end < start + length])

    def snapshot_at(self, request: Request, end: int) -> None:
        """The request's slot row holds its state at exactly `end` once the step just committed completes: the next
        step copies it to a snapshot row, published with an exact checkpoint as steps complete (publish)."""
        if not (self.hybrid and self.enabled) or end <= request.published_ends or end in request.snapshots:
            return
        snapshot = self._allocate_snapshot()
        if snapshot is None:
            return
        self.pending_state.append(StateCopy(request.slot, self.slot_rows + snapshot, snapshot, request, None))
        request.snapshots[end] = snapshot
        request.publish_from = 0

    def terminal(self, request: Request, allocate: Callable[[int], list[int] | None]) -> None:
        """A hybrid request that ended: an exact checkpoint of what its submitted steps consumed (its prompt and its
        output but the last token, or all of it when a step after the last token was already in flight), so that
        the next turn of the conversation continues from there."""
        end = request.scheduled
        self.snapshot_at(request, end)
        if end in request.snapshots:
            self._publish(request, end, request.last_fence, allocate)

    def _drop_snapshot(self, snapshot: int) -> None:
        pending = [c for c in self.pending_state if c.source_checkpoint is None and c.snapshot == snapshot]
        for copy in pending:
            self.pending_state.remove(copy)
        self.snapshot_ids.release([snapshot], self.snapshot_fences.pop(snapshot, self.committed_fence))

    # --- publication as steps complete ----------------------------------------------------------------------------
    def publish(self, request: Request, computed: int, fence: int,
                allocate: Callable[[int], list[int] | None]) -> None:
        """KV for positions below `computed` is written (by steps up to `fence`): publish what that completes. Sets
        Request.publish_from: a call before `computed` reaches it (another block complete) has no work, unless a
        message end may be pending."""
        if not self.enabled:
            request.publish_from = NEVER
            return
        self._publish(request, computed, fence, allocate)
        ends = request.snapshots if self.hybrid else request.message_ends
        request.publish_from = 0 if ends else (len(request.block_chain) + 1) * self.page_size

    def _publish(self, request: Request, computed: int, fence: int,
                 allocate: Callable[[int], list[int] | None]) -> None:
        size, history = self.page_size, self._history(request)
        while len(request.block_chain) < min(computed // size, len(history.block_keys)):
            k = len(request.block_chain)
            parent = request.block_chain[-1] if request.block_chain else None
            if parent is not None and parent.evicted:
                return
            result = self.cache.publish(history.block_keys[k], (k + 1) * size, parent, request.pages[k], fence)
            if isinstance(result, Created):
                request.cache_pages.add(request.pages[k])
                self.counters["checkpoint_publications"] += 1
                self._reading_cached(request.pages[k], result.checkpoint)
            request.block_chain.append(result.checkpoint)
            self._pin(request, result.checkpoint)
        if self.hybrid:
            for end in sorted(request.snapshots):
                if end <= computed and end // size <= len(request.block_chain):
                    self._publish_exact(request, end, allocate, request.snapshots.pop(end))
            return
        for end in request.message_ends:
            if request.published_ends < end <= computed and end % size and end // size <= len(request.block_chain):
                self._publish_exact(request, end, allocate)
                request.published_ends = end

    def _reading_cached(self, page: int, checkpoint: Checkpoint) -> None:
        """A copy not yet sent that reads a private page the cache now owns holds the new checkpoint's pin until it
        is sent, as a copy of a cached page does."""
        for i, copy in enumerate(self.pending_copies):
            if copy.source == page and copy.source_checkpoint is None:
                self.cache.pin(checkpoint)
                self.pending_copies[i] = replace(copy, source_checkpoint=checkpoint)

    def _publish_exact(self, request: Request, end: int, allocate: Callable[[int], list[int] | None],
                       snapshot: int | None = None) -> None:
        """With a snapshot (a hybrid model's), the checkpoint owns it; a snapshot not published is dropped."""
        if snapshot is not None and end % self.page_size == 0:  # the block's checkpoint is exact there
            self._attach_to_block(request.block_chain[end // self.page_size - 1], snapshot)
            return
        key = self._history(request).key_at(end)
        parent = request.block_chain[end // self.page_size - 1] if end >= self.page_size else None
        page = None
        if self.cache.lookup(key) is None and not (parent is not None and parent.evicted):
            page = allocate(1)
        if page is None:
            if snapshot is not None:
                self._drop_snapshot(snapshot)
            return
        result = self.cache.publish(key, end, parent, page[0], ready_fence=None)
        if isinstance(result, Created):
            self.counters["checkpoint_publications"] += 1
            if snapshot is not None:
                self.cache.attach_snapshot(result.checkpoint, snapshot)
                self.counters["snapshot_publications"] += 1
            k = end // self.page_size
            owner = request.block_chain[k] if request.pages[k] in request.cache_pages else None
            self._copy(PageCopy(request.pages[k], page[0], result.checkpoint, request, owner))
        else:
            self.pages.release(page, 0)
            if snapshot is not None:
                self._drop_snapshot(snapshot)

    def _attach_to_block(self, block: Checkpoint, snapshot: int) -> None:
        """A snapshot at a block's end: the block's checkpoint owns it, unless it holds one already (another
        request's, of the same state) or was evicted meanwhile. The block may turn ready before the step that copies
        the snapshot runs: a restore found through it is planned after that copy, so it runs after it too."""
        if block.snapshot is not None or block.evicted:
            self._drop_snapshot(snapshot)
            return
        self.cache.attach_snapshot(block, snapshot)
        self.counters["snapshot_publications"] += 1

    def _copy(self, copy: PageCopy) -> None:
        if copy.source_checkpoint is not None:
            self.cache.pin(copy.source_checkpoint)
        self.pending_copies.append(copy)

    @property
    def pending(self) -> bool:
        return bool(self.pending_copies or self.pending_state or self.pending_spills or self.pending_restores
                    or self.pending_snapshot_restores or self.host is not None and self.host.dropped
                    or self.disk is not None and self.disk.pending)

    def planned_disk(self) -> DiskWork | None:
        """The disk tier's work for the next plan (DiskReuse); without one, what the host gave up is gone."""
        if self.disk is not None:
            return self.disk.planned()
        if self.host is not None:
            self._host_dropped()
        return None

    def _host_dropped(self) -> None:
        """Without a disk tier, what the host gave up is gone."""
        self._host_gone.extend(key for key, _ in self.host.dropped)
        self.host.dropped = []

    def awaits_load(self, request: Request) -> bool:
        """Whether a waiting request had better wait for checkpoints its prompt extends to be read from disk."""
        if self.disk is None or request.sampling.prompt_logprobs is not None:
            return False
        return self.disk.awaits_load(self._history(request), request.first_computed, request.message_ends,
                                     self.page_size)

    def tiers_completed(self, completion: Completion, plan: Plan) -> None:
        """Steps up to the completion's fence completed: their disk work is done, the host slots they last used are
        free; what the plan's spills and restores took is learned. A failed step's spills and reads may not have
        happened: what they would have filled is given up."""
        if completion.tier_seconds and (plan.spills or plan.restores):  # (a snapshot's copy counts with its page)
            self.page_copy_seconds.append(completion.tier_seconds / (len(plan.spills) + len(plan.restores)))
        if self.host is None:
            return
        fence, unreadable = completion.fence, completion.unreadable
        if completion.error is not None:
            for _, slot in plan.spills:
                self.host.forget(slot)
            if plan.disk is not None:
                unreadable = tuple(slot for _, slot in plan.disk.reads)
        if self.disk is not None:
            self.disk.completed(fence, unreadable)
        self.host.completed(fence)

    def planned_copies(self) -> tuple[Copy, ...]:
        """The copies the next plan makes: spills, restores, page copies then state copies, in the order the
        executor makes them; they stay pending until that plan is committed."""
        return (*self.pending_spills, *self.pending_restores, *self.pending_snapshot_restores, *self.pending_copies,
                *self.pending_state)

    def copies_committed(self, copies: tuple[Copy, ...], fence: int,
                         disk: DiskWork | None = None) -> None:
        self.committed_fence = fence
        if self.host is not None:
            self.host.committed(fence)
            if self.disk is not None:
                self.disk.committed(disk, fence)
        if self.pending_spills or self.pending_restores or self.pending_snapshot_restores:
            copies = self._tier_copies_committed(copies, fence)
        states = [c for c in copies if isinstance(c, StateCopy)]
        if states:
            self._states_committed(states, fence)
            copies = tuple(c for c in copies if isinstance(c, PageCopy))
        self.pending_copies = [c for c in self.pending_copies if c not in copies]
        for copy in copies:
            if copy.made is not None:
                self.cache.set_ready_fence(copy.made, fence)
            copy.reader.copy_fence = max(copy.reader.copy_fence, fence)  # the copy uses the reader's pages
            if copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, fence)
            if copy.source in self.held_for_copies:
                self.held_for_copies.discard(copy.source)
                self.pages.release([copy.source], fence)

    def _tier_copies_committed(self, copies: tuple[Copy, ...], fence: int) -> tuple[PageCopy | StateCopy, ...]:
        """Spills and restores sent with the step of `fence`: a restore's slot may be reused from now on (the
        executor copies in order), and its pages are the reader's until that step completes. The other copies."""
        sent = {id(c) for c in copies}
        self.pending_spills = [c for c in self.pending_spills if id(c) not in sent]
        self.pending_restores = [c for c in self.pending_restores if id(c) not in sent]
        self.pending_snapshot_restores = [c for c in self.pending_snapshot_restores if id(c) not in sent]
        for copy in copies:
            if isinstance(copy, (Restore, SnapshotRestore)):
                self.host.unpin(copy.slot)
                copy.reader.copy_fence = max(copy.reader.copy_fence, fence)
        return tuple(c for c in copies if not isinstance(c, (Spill, Restore, SnapshotRestore)))

    def _states_committed(self, copies: list[StateCopy], fence: int) -> None:
        self.pending_state = [c for c in self.pending_state if c not in copies]
        for copy in copies:
            copy.reader.copy_fence = max(copy.reader.copy_fence, fence)  # the copy uses the reader's slot row
            if copy.transit:  # the row a host snapshot came through is free once this step completes
                self.snapshot_ids.release([copy.snapshot], fence)
                self.counters["snapshot_restores"] += 1
            elif copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, fence)
                self.counters["snapshot_restores"] += 1
            else:
                self.snapshot_fences[copy.snapshot] = fence

    # --- the end of a request's hold on its pages -------------------------------------------------------------------
    def release(self, request: Request) -> None:
        """Give back private pages at the request's last-use fence and drop its pin."""
        # A copy into this request's own page is moot now; a copy that makes a checkpoint still reads its page.
        for copy in [c for c in self.pending_copies if c.reader is request and c.made is None]:
            self.pending_copies.remove(copy)
            if copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, request.last_fence)
        for restore in [c for c in self.pending_restores if c.reader is request]:
            self.pending_restores.remove(restore)  # not sent: moot now (its page is private, released below)
            self.host.unpin(restore.slot)
        for restore in [c for c in self.pending_snapshot_restores if c.reader is request]:
            self.pending_snapshot_restores.remove(restore)  # not sent: moot now (its row in transit, below)
            self.host.unpin(restore.slot)
        restoring = [c for c in self.pending_state if c.reader is request and (c.source_checkpoint or c.transit)]
        for state in restoring:
            self.pending_state.remove(state)  # a restore not sent: moot now
            if state.transit:
                self.snapshot_ids.release([state.snapshot], self.committed_fence)
            else:
                self.cache.unpin(state.source_checkpoint, request.last_fence)
        for snapshot in request.snapshots.values():  # taken (or to be) but not published
            self._drop_snapshot(snapshot)
        request.snapshots = {}
        sources = {copy.source for copy in self.pending_copies}
        private = [p for p in request.pages if p not in request.cache_pages]
        self.held_for_copies.update(p for p in private if p in sources)
        self.pages.release([p for p in private if p not in sources], request.last_fence)
        if request.pinned is not None:
            self.cache.unpin(request.pinned, request.last_fence)
        request.pages, request.cache_pages, request.block_chain, request.pinned = [], set(), [], None
        request.published_ends = request.publish_from = 0

    def _pin(self, request: Request, checkpoint: Checkpoint) -> None:
        if request.pinned is not None and checkpoint.parent is request.pinned:  # its next block: the usual case
            self.cache.pin_child(request.pinned, checkpoint)
        else:
            self.cache.pin(checkpoint)
            if request.pinned is not None:
                self.cache.unpin(request.pinned, request.last_fence)
        request.pinned = checkpoint
