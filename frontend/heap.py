"""Giving the memory of large request bodies back to the system (docs/design.md, Trust boundaries).

glibc keeps what a process frees in its heaps for reuse, and moves its mmap threshold up after large frees, so later
large blocks come from the heaps too: a burst of megabyte bodies (each parsed into as many Python strings) leaves a
frontend's RSS at its high-water mark long after the bodies are gone. A second after large bodies were read, one
malloc_trim hands the free pages back; other C libraries have no such call, and nothing is done there.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

TRIM_DELAY = 1.0  # seconds: the bodies' requests have usually finished, and a burst costs one trim


def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


class HeapTrim:
    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._scheduled = False

    def after_large_body(self) -> None:
        """Called once a large body has been read: trim a little later, once for all bodies read meanwhile."""
        if self._trim is None or self._scheduled:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_later(TRIM_DELAY, self._run)

    def _run(self) -> None:
        self._scheduled = False
        self._trim(0)
