"""KV page ids: a free list, plus pages retired at a fence that become reusable only once that fence completes.

With two steps in flight, a page released by a finished request may still be read or written by a step the GPU has
not run yet; handing it to another request before that step completes would corrupt both.
"""

from __future__ import annotations

import heapq
from collections import deque


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._retiring: list[tuple[int, int, list[int]]] = []  # heap of (fence, order, pages)
        self._order = 0
        self._completed_fence = 0

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def retiring_count(self) -> int:
        return sum(len(pages) for _, _, pages in self._retiring)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"{count} pages asked, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def release(self, pages: list[int], last_use_fence: int) -> None:
        """Give pages back; they are reusable once `last_use_fence` has completed."""
        if not pages:
            return
        if last_use_fence <= self._completed_fence:
            self._free.extend(pages)
        else:
            self._order += 1
            heapq.heappush(self._retiring, (last_use_fence, self._order, list(pages)))

    def advance_completed(self, fence: int) -> None:
        if fence < self._completed_fence:
            raise ValueError(f"completed fence went back from {self._completed_fence} to {fence}")
        self._completed_fence = fence
        while self._retiring and self._retiring[0][0] <= fence:
            self._free.extend(heapq.heappop(self._retiring)[2])
