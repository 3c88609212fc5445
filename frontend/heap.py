"""Giving the memory of large request bodies back to the system (docs/design.md, Trust boundaries).

glibc keeps what a process frees in its heaps for reuse, and moves its mmap threshold up after large frees, so later
large blocks come from the heaps too: a burst of megabyte bodies (each parsed into as many Python strings) leaves a
frontend's RSS at its high-water mark long after the bodies are gone. So the threshold is pinned at 1 MiB (blocks
that large are mapped and unmapped on their own, as glibc does before its first adjustment), and a second after
large bodies were read, one malloc_trim hands the heaps' free pages back. Other C libraries have neither call, and
nothing is done there.

A body of many small values (500,000 stop strings) leaves Python's own small-object arenas fragmented: an arena goes
back to the system only once all of it is free, and a few long-lived objects allocated meanwhile keep most of them.
So frontends run with PYTHONMALLOC=malloc, where malloc_trim reaches those pages too, and with two malloc arenas
(MALLOC_ARENA_MAX) instead of one per thread that ever allocated, each keeping its own free pages: `flare run`
starts them so, and a frontend started on its own starts itself again so.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys

from common.supervisor import SYSTEM_ALLOCATOR

TRIM_DELAY = 1.0  # seconds: the bodies' requests have usually finished, and a burst costs one trim
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


def use_system_allocator(module: str) -> None:
    """Start `python -m module` with this process's arguments again on the C library's allocator, unless this
    process already runs on it (or runs where malloc_trim does not exist)."""
    if os.environ.get("PYTHONMALLOC") == "malloc" or _glibc("malloc_trim") is None:
        return
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], {**os.environ, **SYSTEM_ALLOCATOR})


def _glibc(name: str) -> ctypes._CFuncPtr | None:
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


class HeapTrim:
    def __init__(self) -> None:
        self._trim = _glibc("malloc_trim")
        self._scheduled = False
        mallopt = _glibc("mallopt")
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)

    def after_large_body(self) -> None:
        """Called once a large body has been read: trim a little later, once for all bodies read meanwhile."""
        if self._trim is None or self._scheduled:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_later(TRIM_DELAY, self._run)

    def _run(self) -> None:
        self._scheduled = False
        self._trim(0)
