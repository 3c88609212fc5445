"""Prefix reuse for the scheduler: find a request's longest cached prefix when it gets a slot, publish its blocks and
message ends as checkpoints as its steps complete, and give back what it held when it ends.

Page ownership: a request's page list mixes pages the cache owns (shared, read-only for everyone: complete blocks) and
private pages. An exact checkpoint inside a block gets a private copy of that partial page, so the request that made it
can keep writing its own page, and a request that reuses it writes into a fresh copy.

A hybrid model (`snapshots` given) reuses exact checkpoints only, each holding a snapshot of the recurrent state at
exactly its length: a later request restores the deepest one whose prefix its prompt extends and continues from exactly
there (docs/design.md, Scheduler and prefix checkpoints). Its parts: the snapshot rows and the state copies that take
and restore them (engine/scheduler/snapshot_rows.py), the traffic with the host and disk tiers below the device's cache
(engine/scheduler/host_traffic.py), the copies a plan makes (engine/scheduler/copies.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from common.prefix_history import PrefixHistory, RecentHistories, prefix_events
from engine.cache.checkpoint_cache import Checkpoint, Created, PrefixCheckpointCache, RetiredResources
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostEntry, HostTier
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.copies import Copy, PageCopy
from engine.scheduler.host_traffic import HostTraffic
from engine.scheduler.page_copies import PageCopies
from engine.scheduler.plan import DiskWork
from engine.scheduler.request import Request
from engine.scheduler.snapshot_rows import SnapshotRows

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
        self.identity = identity
        self.page_size = page_size
        self.pages = pages
        self.cache = PrefixCheckpointCache()
        self.recent = RecentHistories(identity, page_size)  # a long prompt seen again hashes only its new end
        self.counters = counters
        self.page_copies = PageCopies(self.cache, pages)
        self.host = host
        self.snapshots = SnapshotRows(snapshots or 0, slots, snapshot_bytes, self.cache, host, page_size, counters,
                                      self._retire)
        self.tiers = HostTraffic(host, self.cache, counters, page_size, page_bytes, snapshot_bytes, disk, self.hybrid)

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
        self.snapshots.ids.advance_completed(fence)

    def _retire(self, retired: list[RetiredResources]) -> None:
        if self.host is not None:
            self.tiers.spill(retired, self.snapshots.spillable)
        for resources in retired:
            self.pages.release(resources.pages, resources.fence)
            if resources.snapshots:
                self.snapshots.retired(resources.snapshots, resources.fence)

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
        hosted = self.tiers.run(history.block_keys[len(chain): limit // size], lookup=True)
        if hosted and not self.tiers.restore_pays(len(hosted)):
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
            self.tiers.restore_page(entry, page, request)
        if exact is not None:
            self.page_copies.add(PageCopy(exact.page, pages[-1], None, request, exact))
        self._reused(request, chain, pages, reused, exact if exact is not None else chain[-1] if chain else None)

    def _reused(self, request: Request, blocks: list[Checkpoint], pages: list[int], length: int,
                held: Checkpoint | None) -> None:
        """The request starts at `length`, with the cache's `blocks` and then its own `pages`; it pins `held`."""
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

    def _restore(self, request: Request, allocate: Callable[[int], list[int] | None]) -> None:
        """A hybrid model's reuse: the deepest exact checkpoint with a snapshot that the prompt extends (a message
        end, a prompt end or a terminal endpoint of an earlier request), on the device or the host: its blocks'
        pages shared (or restored from the host), its partial page copied (or restored), its snapshot restored into
        the request's slot row (from the host through a snapshot row in transit)."""
        history, size, limit = self._history(request), self.page_size, request.first_computed
        chain, hosted = self._held_run(history, limit, lookup=True)
        self.counters["prefix_lookups"] += 1
        if hosted and not self.tiers.restore_pays(len(hosted)):
            hosted = []
            self.counters["host_declined"] += 1
        exact, entry = self.snapshots.deepest_exact(history, chain, len(hosted), limit)
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
        transit = self.snapshots.allocate() if entry is not None and pages is not None else None
        if pages is not None and entry is not None and transit is None:  # no snapshot row to restore through
            self.pages.release(pages, 0)
            pages = None
        if pages is None:
            self.counters["prefix_misses"] += 1
        else:
            self._plan_restore(request, exact, entry, restored, pages, transit)
            self._reused(request, blocks, pages, length, held)
        if held is not None:
            self.cache.unpin(held, 0)
        for pinned in used:
            self.host.unpin(pinned.slot)

    def _plan_restore(self, request: Request, exact: Checkpoint | None, entry: HostEntry | None,
                      restored: list[HostEntry], pages: list[int], transit: int | None) -> None:
        """The copies of a hybrid request's restore: host blocks into its fresh `pages`, then the partial page of
        the exact checkpoint (from the device's `exact` or the host's `entry`) into the last, and the snapshot."""
        for hosted, page in zip(restored, pages):
            self.tiers.restore_page(hosted, page, request)
        if len(pages) > len(restored):
            if exact is not None:
                self.page_copies.add(PageCopy(exact.page, pages[-1], None, request, exact))
            else:
                self.tiers.restore_page(entry, pages[-1], request)
        if exact is not None:
            self.snapshots.restore(request, exact)
            return
        self.tiers.restore_snapshot(entry, self.snapshots.slot_rows + transit, request)
        self.snapshots.restore_through(request, transit)

    def awaits_snapshot(self, request: Request) -> bool:
        """Whether a hybrid request had better wait before it takes a slot (SnapshotRows.awaits_snapshot)."""
        if not self.snapshots.active or request.sampling.prompt_logprobs is not None:
            return False
        return self.snapshots.awaits_snapshot(self._history(request), request.first_computed,
                                              [copy.made for copy in self.page_copies.pending])

    def terminal(self, request: Request, allocate: Callable[[int], list[int] | None]) -> None:
        """A hybrid request that ended: an exact checkpoint of what its submitted steps consumed (its prompt and its
        output but the last token, or all of it when a step after the last token was already in flight), so that
        the next turn of the conversation continues from there."""
        end = request.scheduled
        self.snapshots.snapshot_at(request, end)
        if end in request.snapshots:
            self._publish(request, end, request.last_fence, allocate)

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
                self.page_copies.reading_cached(request.pages[k], result.checkpoint)
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

    def _publish_exact(self, request: Request, end: int, allocate: Callable[[int], list[int] | None],
                       snapshot: int | None = None) -> None:
        """With a snapshot (a hybrid model's), the checkpoint owns it; a snapshot not published is dropped."""
        if snapshot is not None and end % self.page_size == 0:  # the block's checkpoint is exact there
            self.snapshots.attach_to_block(request.block_chain[end // self.page_size - 1], snapshot)
            return
        key = self._history(request).key_at(end)
        parent = request.block_chain[end // self.page_size - 1] if end >= self.page_size else None
        page = None
        if self.cache.lookup(key) is None and not (parent is not None and parent.evicted):
            page = allocate(1)
        if page is None:
            if snapshot is not None:
                self.snapshots.drop(snapshot)
            return
        result = self.cache.publish(key, end, parent, page[0], ready_fence=None)
        if isinstance(result, Created):
            self.counters["checkpoint_publications"] += 1
            if snapshot is not None:
                self.cache.attach_snapshot(result.checkpoint, snapshot)
                self.counters["snapshot_publications"] += 1
            k = end // self.page_size
            owner = request.block_chain[k] if request.pages[k] in request.cache_pages else None
            self.page_copies.add(PageCopy(request.pages[k], page[0], result.checkpoint, request, owner))
        else:
            self.pages.release(page, 0)
            if snapshot is not None:
                self.snapshots.drop(snapshot)

    @property
    def pending(self) -> bool:
        return bool(self.page_copies.pending or self.snapshots.pending_state or self.tiers.pending)

    @property
    def persists(self) -> bool:
        """Whether a clean stop writes the checkpoints to a disk tier (persist)."""
        return self.tiers.disk is not None

    @property
    def writing(self) -> bool:
        """Whether disk work sent with steps has not ended yet."""
        return self.tiers.disk is not None and self.tiers.disk.in_flight

    def persist(self) -> bool:
        """A round of a clean stop with a disk tier, once the copies that requests' ends left are made: as many of
        the device's checkpoints as the host has free slots (and snapshot rows) for move there, the host gives up
        entries (to disk) to make room for the rest in the next round, and every host entry without a file is
        written, so that a restart finds them all. The steps that follow do the copies and the writes; False: no
        progress (the device's checkpoints are all on the host, or none can move)."""
        left = self.cache.stats.pages
        room = min(self.host.free(), self.host.free(rows=True)) if self.hybrid else self.host.free()
        if room and left:
            self._retire(self.cache.evict(room))
        gave_way = self.host.give_way(self.cache.stats.pages, self.cache.snapshots) if self.cache.stats.pages \
            else False
        self.tiers.disk.write_host(self.tiers.recompute_seconds)
        return self.cache.stats.pages < left or gave_way

    def _held_run(self, history: PrefixHistory, limit: int,
                  lookup: bool = False) -> tuple[list[Checkpoint], list[HostEntry]]:
        """The device's checkpoints of the prompt's blocks before `limit`, then the host's entries of the blocks
        after them (`lookup`: HostTraffic.run)."""
        blocks = limit // self.page_size
        chain = self.cache.lookup_run(history.block_keys, blocks)
        return chain, self.tiers.run(history.block_keys[len(chain): blocks], lookup)

    def awaits_room(self, request: Request, completed: int, committed: int) -> bool:
        """Whether a waiting request had better wait before it takes a slot: its prompt extends blocks on the host
        tier, the device has no room to restore them into (pages; for a hybrid, the snapshot row in transit), and
        steps are in flight (after fence `completed`, up to `committed`) whose completion may make some: pages
        retiring behind them, checkpoints their copies make turning evictable. Taking a slot now would compute
        those blocks again; it waits once, for the steps in flight now."""
        if request.room_fence:
            return request.room_fence > completed
        if self.host is None or not self.enabled or committed <= completed or \
                request.sampling.prompt_logprobs is not None:
            return False
        chain, hosted = self._held_run(self._history(request), request.first_computed)
        if not hosted:
            return False
        wanted = len(hosted) + 1  # (and a partial page beyond them)
        # The evictions below make room around the blocks the request reuses (their spills may push host entries out).
        if chain:
            self.cache.pin(chain[-1])
        for entry in hosted:
            self.host.pin(entry.slot)
        try:
            self.free_pages(wanted)
            if self.hybrid:
                self.snapshots.make_room()
        finally:
            if chain:
                self.cache.unpin(chain[-1], 0)
            for entry in hosted:
                self.host.unpin(entry.slot)
        short = self.pages.free_count < wanted or (self.hybrid and not self.snapshots.ids.free_count)
        request.room_fence = committed if short else -1  # (-1: it does not wait, now or later)
        return short

    def awaits_load(self, request: Request) -> bool:
        """Whether a waiting request had better wait for checkpoints its prompt extends to be read from disk (not
        when recomputing them is expected to be faster)."""
        if self.tiers.disk is None or request.sampling.prompt_logprobs is not None:
            return False
        return self.tiers.disk.awaits_load(self._history(request), request.first_computed, request.message_ends,
                                           self.page_size, self.tiers.recompute_seconds)

    def planned_copies(self) -> tuple[Copy, ...]:
        """The copies the next plan makes: spills, restores, page copies then state copies, in the order the
        executor makes them; they stay pending until that plan is committed."""
        return (*self.tiers.planned_copies(), *self.page_copies.pending, *self.snapshots.pending_state)

    def copies_committed(self, copies: tuple[Copy, ...], fence: int,
                         disk: DiskWork | None = None) -> None:
        """The copies (and disk work) sent with the step of `fence`: the tiers' and the state copies first, then the
        page copies."""
        copies = self.snapshots.committed(self.tiers.committed(copies, fence, disk), fence)
        self.page_copies.committed(copies, fence)

    # --- the end of a request's hold on its pages -------------------------------------------------------------------
    def release(self, request: Request) -> None:
        """Give back private pages at the request's last-use fence and drop its pin."""
        self.page_copies.release(request)
        self.tiers.release(request)
        self.snapshots.release(request)
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
