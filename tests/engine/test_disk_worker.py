"""The disk tier's files are written off the step (engine/executor/disk_worker.py): a step completes as soon as its
copies and forward are done, whatever its disk work still takes, and the disk work's end comes after, as a DiskDone
that wakes the loop."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cache import disk_files
from engine.executor.factory import make_executor
from engine.scheduler.plan import DiskDone, DiskWork, DiskWrite, Plan
from tests.support.engine_harness import tiny_model

PAGE = 16


def wait_for(executor: object, ready: Callable[[], list]) -> list:
    deadline = time.monotonic() + 10
    while not (items := ready()) and time.monotonic() < deadline:
        select.select([executor.wake_fd], [], [], 0.1)
    return items


def test_a_step_completes_before_its_disk_work_ends(tmp_path: Path) -> None:
    executor = make_executor(tiny_model(), 8, PAGE, 2, torch.device("cpu"), 512, 48, False, host_slots=2,
                             disk=(tmp_path, b"i" * 32))
    disk_free = threading.Event()
    write_files = executor.host_pages.disk_work

    def slow_disk(work: DiskWork) -> tuple[int, ...]:  # a disk busy with other writes
        disk_free.wait(10)
        return write_files(work)

    executor.host_pages.disk_work = slow_disk
    key = bytes(range(16))
    try:
        executor.submit(Plan((), spills=((2, 0),), disk=DiskWork(writes=(DiskWrite(0, key, PAGE),))))
        [(_, completion)] = wait_for(executor, executor.poll)
        assert completion.error is None and executor.can_submit()
        assert executor.disk_done() == [] and not (tmp_path / disk_files.file_name(key)).exists()
        disk_free.set()
        assert wait_for(executor, executor.disk_done) == [DiskDone(1)]
        assert (tmp_path / disk_files.file_name(key)).is_file()
    finally:
        disk_free.set()
        executor.close()
