"""The disk tier's files are written off the step (engine/executor/disk_worker.py): a step completes as soon as its
copies and forward are done, whatever its disk work still takes, and the disk work's end comes after, as a DiskDone
that wakes the loop."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.cache import disk_files
from engine.executor.factory import make_executor
from engine.scheduler.plan import DiskWork, DiskWrite, Plan
from tests.support.engine_harness import tiny_model

PAGE = 16


def wait_for(executor: object, ready: Callable[[], list]) -> list:
    deadline = time.monotonic() + 10
    while not (items := ready()) and time.monotonic() < deadline:
        select.select([executor.wake_fd], [], [], 0.1)
    return items


def slow_disk_executor(directory: Path, disk_free: threading.Event, monkeypatch: pytest.MonkeyPatch,
                       under_way: threading.Event | None = None) -> object:
    """An eager executor with a host tier of two slots over a disk whose every file waits for `disk_free` (and sets
    `under_way` once the first has begun)."""
    write_file = disk_files.write

    def slow_write(*args: object) -> None:  # a disk busy with other writes
        if under_way is not None:
            under_way.set()
        disk_free.wait(10)
        write_file(*args)

    monkeypatch.setattr(disk_files, "write", slow_write)
    return make_executor(tiny_model(), 8, PAGE, 2, torch.device("cpu"), 512, 48, False, host_slots=2,
                         disk=(directory, b"i" * 32))


def spill_and_write(page: int, slot: int, key: bytes) -> Plan:
    return Plan((), spills=((page, slot),), disk=DiskWork(writes=(DiskWrite(slot, key, PAGE),)))


def test_a_step_completes_before_its_disk_work_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk_free = threading.Event()
    executor = slow_disk_executor(tmp_path, disk_free, monkeypatch)
    key = bytes(range(16))
    try:
        executor.submit(spill_and_write(2, 0, key))
        [(_, completion)] = wait_for(executor, executor.poll)
        assert completion.error is None and executor.can_submit()
        assert executor.disk_done() == [] and not (tmp_path / disk_files.file_name(key)).exists()
        disk_free.set()
        [done] = wait_for(executor, executor.disk_done)
        assert done.fence == 1 and done.unreadable == () and done.seconds > 0  # (the disk thread's time)
        assert (tmp_path / disk_files.file_name(key)).is_file()
    finally:
        disk_free.set()
        executor.close()


def test_a_stop_ends_the_disk_work_after_the_file_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files not written are only a colder next start; a stop held up by a slow disk past its deadline is killed.
    The file under way is finished; the step's other writes and the work queued behind it are dropped."""
    disk_free, under_way = threading.Event(), threading.Event()
    executor = slow_disk_executor(tmp_path, disk_free, monkeypatch, under_way)
    first, second, third = bytes(range(16)), bytes(range(1, 17)), bytes(range(2, 18))
    executor.submit(Plan((), spills=((2, 0), (3, 1)),
                         disk=DiskWork(writes=(DiskWrite(0, first, PAGE), DiskWrite(1, second, PAGE)))))
    executor.submit(Plan((), disk=DiskWork(writes=(DiskWrite(0, third, PAGE),))))
    assert under_way.wait(10)
    threading.Timer(0.5, disk_free.set).start()  # the first file is under way when the stop comes
    executor.close()  # (its steps end first: the second step's disk work is queued before the stop)
    assert (tmp_path / disk_files.file_name(first)).is_file()
    assert not (tmp_path / disk_files.file_name(second)).exists()
    assert not (tmp_path / disk_files.file_name(third)).exists()
