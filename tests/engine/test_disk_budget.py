"""The disk tier's directory never holds more files than its budget: room for the files on their way is made
before they are written, their deletions sent with them and made first (docs/design.md, Host retention). At the
scheduler's level, the files followed as the executor makes them."""

from __future__ import annotations

from engine.cache.disk_files import DiskEntry
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.scheduler.plan import Plan
from engine.scheduler.scheduler import RequestScheduler
from tests.engine.test_hybrid_host_tier import CHUNK, FIRST, PAGE, PAGES, SLOTS, add, run

FILES = 5


def follow(plans: list[Plan], files: set[bytes]) -> int:
    """The files after each plan's disk work (deletions, then writes); the most the directory held."""
    most = len(files)
    for plan in plans:
        if plan.disk is not None:
            files.difference_update(plan.disk.erasures)
            files.update(write.key for write in plan.disk.writes)
            most = max(most, len(files))
    return most


def test_given_up_host_entries_never_take_the_directory_past_its_budget() -> None:
    s = RequestScheduler(SLOTS, 4, PAGES, PAGE, CHUNK, host=HostTier(8), page_bytes=10, disk=DiskTier(FILES, []))
    files: set[bytes] = set()
    most = 0
    for base in range(8):
        add(s, [base * 50 + t for t in FIRST])
        most = max(most, follow(run(s), files))
        s.prefix.free_pages(PAGES)
        most = max(most, follow(run(s), files))
    assert s.counters["disk_writes"] > FILES  # the budget was passed many times over
    assert most <= FILES and files == set(s.prefix.tiers.disk.disk.keys())
    s.prefix.tiers.disk.write_host(lambda tokens: 0.0)  # a clean stop's: the host holds more than the disk
    assert len(s.prefix.host) > FILES
    assert follow(run(s), files) <= FILES and files == set(s.prefix.tiers.disk.disk.keys())


def test_room_is_made_from_files_the_host_holds_too_then_the_least_recently_used() -> None:
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    disk = DiskTier(4, [(key, DiskEntry(PAGE)) for key in (a, b, c, d)])  # a least recently used
    disk.make_room(1, spare={c})
    assert disk.erased == [c]
    disk.make_room(3, keep={a}, spare={c})  # a is being read
    assert disk.erased == [c, b, d] and list(disk.keys()) == [a]
