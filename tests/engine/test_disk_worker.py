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


def slow_disk_executor(directory: Path, disk_free: threading.Event,
                       under_way: threading.Event | None = None) -> object:
    """An eager executor with a host tier of two slots over a disk whose work waits for `disk_free` (and sets
    `under_way` once it has begun)."""
    executor = make_executor(tiny_model(), 8, PAGE, 2, torch.device("cpu"), 512, 48, False, host_slots=2,
                             disk=(directory, b"i" * 32))
    write_files = executor.host_pages.disk_work

    def slow_disk(work: DiskWork) -> tuple[int, ...]:  # a disk busy with other writes
        if under_way is not None:
            under_way.set()
        disk_free.wait(10)
        return write_files(work)

    executor.host_pages.disk_work = slow_disk
    return executor


def spill_and_write(page: int, slot: int, key: bytes) -> Plan:
    return Plan((), spills=((page, slot),), disk=DiskWork(writes=(DiskWrite(slot, key, PAGE),)))


def test_a_step_completes_before_its_disk_work_ends(tmp_path: Path) -> None:
    disk_free = threading.Event()
    executor = slow_disk_executor(tmp_path, disk_free)
    key = bytes(range(16))
    try:
        executor.submit(spill_and_write(2, 0, key))
        [(_, completion)] = wait_for(executor, executor.poll)
        assert completion.error is None and executor.can_submit()
        assert executor.disk_done() == [] and not (tmp_path / disk_files.file_name(key)).exists()
        disk_free.set()
        assert wait_for(executor, executor.disk_done) == [DiskDone(1)]
        assert (tmp_path / disk_files.file_name(key)).is_file()
    finally:
        disk_free.set()
        executor.close()


def test_a_stop_drops_the_disk_work_queued_behind_the_work_under_way(tmp_path: Path) -> None:
    """Files not written are only a colder next start; a stop held up by a slow disk past its deadline is killed."""
    disk_free, under_way = threading.Event(), threading.Event()
    executor = slow_disk_executor(tmp_path, disk_free, under_way)
    first, second = bytes(range(16)), bytes(range(1, 17))
    executor.submit(spill_and_write(2, 0, first))
    executor.submit(spill_and_write(3, 1, second))
    assert under_way.wait(10)
    threading.Timer(0.5, disk_free.set).start()  # the first write is under way when the stop comes
    executor.close()  # (its steps end first: the second step's disk work is queued before the stop)
    assert (tmp_path / disk_files.file_name(first)).is_file()
    assert not (tmp_path / disk_files.file_name(second)).exists()
