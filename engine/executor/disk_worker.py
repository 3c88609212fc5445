"""DiskWorker: the disk tier's file work on a thread of its own (docs/design.md, Host retention).

A disk writes a few hundred MB a second where the copy engine moves tens of GB: a step whose completion waited for
its files would hold up every request's next token for as long as the files take. So a step hands its disk work
here once its copies are done and completes without it; the work is done in the order handed over, each step's
end reported as a DiskDone that the engine loop collects, the executor's wake pipe waking it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from engine.executor.tier_copies import HostPages
from engine.scheduler.plan import DiskDone, DiskWork

log = logging.getLogger("flare.engine")


class DiskWorker:
    def __init__(self, wake_write: int) -> None:
        """`wake_write`: the executor's wake pipe, written once a step's disk work is done."""
        self._wake_write = wake_write
        self._work: queue.SimpleQueue[tuple[int, DiskWork, HostPages] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[DiskDone] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the first work
        self._closing = threading.Event()

    def queue(self, fence: int, work: DiskWork, pages: HostPages) -> None:
        """The disk work of the step of `fence`, whose copies are done."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="disk-tier", daemon=True)
            self._thread.start()
        self._work.put((fence, work, pages))

    def done(self) -> list[DiskDone]:
        """The steps whose disk work ended since the last call."""
        ready = []
        while True:
            try:
                ready.append(self._done.get_nowait())
            except queue.Empty:
                return ready

    def close(self) -> None:
        """Finish the file under way and stop; the rest of its step's writes and the work queued behind are dropped
        (a clean stop waits for the disk work in flight up to its deadline: past it, fewer files are written rather
        than the stop held up)."""
        if self._thread is not None:
            self._closing.set()
            self._work.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if self._closing.is_set():
                continue
            fence, work, pages = item
            started = time.perf_counter()
            try:
                unreadable = pages.disk_work(work, self._closing)
            except Exception:  # (bad files are handled inside: this is a fault of ours, which must not end the thread)
                log.exception("the disk work of step %d failed", fence)
                unreadable = tuple(read.slot for read in work.reads)  # (writes not made read as missing files later)
            self._done.put(DiskDone(fence, unreadable, time.perf_counter() - started))
            os.write(self._wake_write, b"x")
