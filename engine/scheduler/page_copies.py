"""The KV page copies the scheduler's prefix reuse plans (engine/scheduler/prefix.py), held until the plan that makes
them is committed (docs/design.md, Scheduler and prefix checkpoints): an exact checkpoint's private copy of its partial
page, and a reusing request's copy of it. A copy's source checkpoint stays pinned until it is sent, and the private
page of an ended request that a copy still reads is released only then.
"""

from __future__ import annotations

from dataclasses import replace

from engine.cache.checkpoint_cache import Checkpoint, PrefixCheckpointCache
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.copies import PageCopy
from engine.scheduler.request import Request


class PageCopies:
    def __init__(self, cache: PrefixCheckpointCache, pages: PageAllocator) -> None:
        self.cache = cache
        self.pages = pages
        self.pending: list[PageCopy] = []
        # Private pages of ended requests that a pending copy still reads: released once that copy is submitted.
        self.held: set[int] = set()

    def add(self, copy: PageCopy) -> None:
        if copy.source_checkpoint is not None:
            self.cache.pin(copy.source_checkpoint)
        self.pending.append(copy)

    def reading_cached(self, page: int, checkpoint: Checkpoint) -> None:
        """A copy not yet sent that reads a private page the cache now owns holds the new checkpoint's pin until it
        is sent, as a copy of a cached page does."""
        for i, copy in enumerate(self.pending):
            if copy.source == page and copy.source_checkpoint is None:
                self.cache.pin(checkpoint)
                self.pending[i] = replace(copy, source_checkpoint=checkpoint)

    def committed(self, copies: tuple[PageCopy, ...], fence: int) -> None:
        """The page copies sent with the step of `fence`: the checkpoints they make turn ready once it completes."""
        self.pending = [c for c in self.pending if c not in copies]
        for copy in copies:
            if copy.made is not None:
                self.cache.set_ready_fence(copy.made, fence)
            copy.reader.copy_fence = max(copy.reader.copy_fence, fence)  # the copy uses the reader's pages
            if copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, fence)
            if copy.source in self.held:
                self.held.discard(copy.source)
                self.pages.release([copy.source], fence)

    def release(self, request: Request) -> None:
        """Give back the ended request's private pages at its last-use fence, but those a pending copy reads."""
        # A copy into this request's own page is moot now; a copy that makes a checkpoint still reads its page.
        for copy in [c for c in self.pending if c.reader is request and c.made is None]:
            self.pending.remove(copy)
            if copy.source_checkpoint is not None:
                self.cache.unpin(copy.source_checkpoint, request.last_fence)
        sources = {copy.source for copy in self.pending}
        private = [p for p in request.pages if p not in request.cache_pages]
        self.held.update(p for p in private if p in sources)
        self.pages.release([p for p in private if p not in sources], request.last_fence)
