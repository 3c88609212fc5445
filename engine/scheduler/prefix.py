"""Prefix reuse for the scheduler: find a request's longest cached prefix when it gets a slot, publish its blocks and
message ends as checkpoints as its steps complete, and give back what it held when it ends.

Page ownership: a request's page list mixes pages the cache owns (shared, read-only for everyone: complete blocks) and
private pages. An exact checkpoint inside a block gets a private copy of that partial page, so the request that made it
can keep writing its own page, and a request that reuses it writes into a fresh copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine.cache.checkpoint_cache import Checkpoint, Created, PrefixCheckpointCache
from engine.cache.page_allocator import PageAllocator
from common.prefix_history import PrefixHistory, RecentHistories
from engine.scheduler.request import Request

@dataclass(frozen=True)
class PageCopy:
    """A KV page copy the next step makes before its forward."""

    source: int
    destination: int
    made: Checkpoint | None  # the exact checkpoint the copy creates (None: a reusing request's private copy)
    reader: Request  # the request whose page table holds the source (or that reuses it)
    source_checkpoint: Checkpoint | None  # the source's owner when the cache owns it: pinned until the copy is sent


# Request.publish_from of a request whose prefixes are never published.
NEVER = 2 ** 62


class PrefixReuse:
    def __init__(self, identity: bytes, page_size: int, pages: PageAllocator, counters: Counter[str],
                 enabled: bool = True) -> None:
        """`enabled` False: no reuse and no publication. A hybrid model's requests carry a recurrent state that
        pages of KV cannot rebuild (engine/model/recurrent_state.py), so a cached prefix would be no start."""
        self.enabled = enabled
        self.identity = identity
        self.page_size = page_size
        self.pages = pages
        self.cache = PrefixCheckpointCache()
        self.recent = RecentHistories(identity, page_size)  # a long prompt seen again hashes only its new end
        self.counters = counters
        self.pending_copies: list[PageCopy] = []
        # Private pages of ended requests that a pending copy still reads: released once that copy is submitted.
        self.held_for_copies: set[int] = set()

    def track(self, request: Request) -> None:
        # An image's content keys every prefix that reaches its first token.
        request.history = self.recent.history(request.tokens, [(i.offset, i.identity) for i in request.images])

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
            for retired in self.cache.evict(shortfall):
                self.pages.release(retired.pages, retired.fence)

    # --- reuse when a request gets its slot -------------------------------------------------------------------------
    def reuse(self, request: Request, allocate: Callable[[int], list[int] | None]) -> None:
        if not self.enabled:
            request.publish_from = NEVER
            return
        if request.sampling.prompt_logprobs is not None:
            return  # every prompt position must be computed to report its logprob
        history, size = self._history(request), self.page_size
        limit = request.first_computed  # the position whose logits are read is always computed
        chain = self.cache.lookup_run(history.block_keys, limit // size)
        reused, exact = len(chain) * size, None
        for end in sorted(request.message_ends, reverse=True):
            if reused < end <= limit and end % size and end // size <= len(chain):
                if (exact := self.cache.lookup(history.key_at(end))) is not None:
                    reused = end
                    break
        self.counters["prefix_lookups"] += 1
        if reused == 0:
            self.counters["prefix_misses"] += 1
            return
        blocks = chain[: reused // size]
        if exact is not None:
            page = allocate(1)
            if page is None:  # no page for the private copy: fall back to the whole blocks
                exact, reused = None, len(blocks) * size
            else:
                self._copy(PageCopy(exact.page, page[0], None, request, exact))
        if reused == 0:
            self.counters["prefix_misses"] += 1
            return
        self.counters["prefix_hits"] += 1
        self.counters["reused_tokens"] += reused
        cached = [c.page for c in blocks]
        request.cache_pages = set(cached)
        request.pages = cached + ([page[0]] if exact is not None else [])
        request.block_chain = list(blocks)
        request.published_ends = reused
        self._pin(request, exact or blocks[-1])
        request.scheduled = reused
        if not request.started:
            request.cached_tokens = reused

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
        request.publish_from = 0 if request.message_ends else (len(request.block_chain) + 1) * self.page_size

    def _publish(self, request: Request, computed: int, fence: int,
                 allocate: Callable[[int], list[int] | None]) -> None:
        size, history = self.page_size, self._history(request)
        while len(request.block_chain) < min(computed // size, len(history.block_keys)):
            k = len(request.block_chain)
            parent = request.block_chain[-1] if request.block_chain else None
            if parent is not None and parent.evicted:
                return
            if any(copy.source == request.pages[k] for copy in self.pending_copies):
                break  # a copy not yet sent reads this page: it stays the request's until then
            result = self.cache.publish(history.block_keys[k], (k + 1) * size, parent, request.pages[k], fence)
            if isinstance(result, Created):
                request.cache_pages.add(request.pages[k])
                self.counters["checkpoint_publications"] += 1
            request.block_chain.append(result.checkpoint)
            self._pin(request, result.checkpoint)
        for end in request.message_ends:
            if request.published_ends < end <= computed and end % size and end // size <= len(request.block_chain):
                self._publish_exact(request, end, allocate)
                request.published_ends = end

    def _publish_exact(self, request: Request, end: int, allocate: Callable[[int], list[int] | None]) -> None:
        key = self._history(request).key_at(end)
        parent = request.block_chain[end // self.page_size - 1] if end >= self.page_size else None
        if self.cache.lookup(key) is not None or (parent is not None and parent.evicted):
            return
        page = allocate(1)
        if page is None:
            return
        result = self.cache.publish(key, end, parent, page[0], ready_fence=None)
        if isinstance(result, Created):
            self.counters["checkpoint_publications"] += 1
            k = end // self.page_size
            owner = request.block_chain[k] if request.pages[k] in request.cache_pages else None
            self._copy(PageCopy(request.pages[k], page[0], result.checkpoint, request, owner))
        else:
            self.pages.release(page, 0)

    def _copy(self, copy: PageCopy) -> None:
        if copy.source_checkpoint is not None:
            self.cache.pin(copy.source_checkpoint)
        self.pending_copies.append(copy)

    def planned_copies(self) -> tuple[PageCopy, ...]:
        """The copies the next plan makes; they stay pending until that plan is committed."""
        return tuple(self.pending_copies)

    def copies_committed(self, copies: tuple[PageCopy, ...], fence: int) -> None:
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

    # --- the end of a request's hold on its pages -------------------------------------------------------------------
    def release(self, request: Request) -> None:
        """Give back private pages at the request's last-use fence and drop its pin."""
        # A copy into this request's own page is moot now; a copy that makes a checkpoint still reads its page.
        for copy in [c for c in self.pending_copies if c.reader is request and c.made is None]:
            self.pending_copies.remove(copy)
            if copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, request.last_fence)
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
