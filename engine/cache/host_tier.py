"""HostTier: which prefix checkpoints' pages are held in host memory once the device's prefix cache evicted them.

Metadata only, as the device's PrefixCheckpointCache is: a key (the same BLAKE2b block key, seeded with the core's
identity) maps to a host slot that holds one page of K and V for every layer; the executor owns the slots' memory
(engine/executor/tier_copies.py) and carries out the copies the plans name (docs/design.md, Host retention).

A hybrid model's exact checkpoint keeps its recurrent-state snapshot beside its page, in a host snapshot row: the
entry holds both and gives both up at once (pages alone are no place to continue a recurrent state from), and the
tier indexes such entries by their parent's key (`exact_ends`), as the device's cache does.

Entries give way least recently used first (a step's spills placed in that order as the most recently used, or as
the least while that keeps more: engine/cache/placement.py), keeping a reserve of slots (and of snapshot rows) free
or on their way to be, so that a step's evictions find them. A slot given up is reusable once the step committed
after that completes (the executor may still copy it to the device for a restore sent earlier); with a disk tier
below, a slot given up is held until its file is written (`release`), and held slots count as on their way to be
free, so that a slow disk makes spills wait for room rather than the tier give up more. A slot that a planned
restore reads is pinned (its entry, snapshot row included, stays) until that restore is committed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from engine.cache.exact_ends import ExactEnds
from engine.cache.placement import PlacementDuel, place


@dataclass(frozen=True)
class HostEntry:
    slot: int
    length: int  # tokens the checkpoint covers (a block's end, or an exact checkpoint's message end)
    snapshot: int | None = None  # a hybrid model's snapshot row at exactly `length`
    parent: bytes = b""  # the key of the block before the checkpoint's own (b"": none), for exact_ends


class _Rows:
    """Slots (or snapshot rows) of the tier: free, given up since the last committed step, or retiring until the
    step committed after that completes."""

    def __init__(self, count: int) -> None:
        self.reserve = max(count // 8, 1)
        self.free = list(range(count - 1, -1, -1))
        self.held: set[int] = set()  # given up, until their files are written
        self.dropping: list[int] = []
        self.retiring: list[tuple[int, int]] = []  # heap of (fence, slot)

    def short(self, wanted: int | None = None) -> bool:
        """Fewer than the reserve (or `wanted`) free or on their way to be."""
        on_their_way = len(self.held) + len(self.dropping) + len(self.retiring)
        return len(self.free) + on_their_way < (self.reserve + 1 if wanted is None else wanted)

    def give_up(self, slot: int, hold: bool) -> None:
        if hold:
            self.held.add(slot)
        else:
            self.dropping.append(slot)

    def committed(self, fence: int) -> None:
        for slot in self.dropping:
            heapq.heappush(self.retiring, (fence, slot))
        self.dropping = []

    def completed(self, fence: int) -> None:
        while self.retiring and self.retiring[0][0] <= fence:
            self.free.append(heapq.heappop(self.retiring)[1])


class HostTier:
    def __init__(self, slots: int, snapshots: int = 0) -> None:
        """`snapshots`: a hybrid model's snapshot rows."""
        self.slots = slots
        self.snapshot_rows = snapshots
        self._slots = _Rows(slots)
        self._rows = _Rows(snapshots)
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # slot -> planned restores that read it
        self._exact_ends = ExactEnds()  # entries with a snapshot
        self.dropped: list[tuple[bytes, HostEntry]] = []  # entries given up, for the disk tier and announcements
        self.holds_dropped = False  # a disk tier below: what is given up keeps its slot until `release`
        self.placement = PlacementDuel(slots)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        return list(self._entries)

    @property
    def snapshots(self) -> int:
        return len(self._exact_ends)

    def get(self, key: bytes) -> HostEntry | None:
        """The entry of `key`, now the most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def place(self, offered: list[bytes], stored: list[bytes]) -> bool:
        """A step's spills: of the evicted checkpoints' keys `offered` (parents first), the tier took `stored`. They
        are placed as the most recently used, or as the least (the placement duel decides), either way with the
        deepest given up first; whether as the least."""
        oldest = self.placement.spilled(offered)
        place(self._entries, stored, oldest)
        return oldest

    def exact_ends(self, parent: bytes) -> list[int]:
        """The lengths of the entries with a snapshot whose parent key is `parent` (b"": the root)."""
        return list(self._exact_ends.under(parent).values())

    def take_slot(self) -> int | None:
        """A free slot (least recently used entries give way to keep the reserve); None when none is free."""
        while self._slots.short() and self._drop_oldest():
            pass
        return self._slots.free.pop() if self._slots.free else None

    def free(self, rows: bool = False) -> int:
        """Slots (snapshot rows) free now."""
        return len((self._rows if rows else self._slots).free)

    def give_way(self, slots: int, rows: int) -> bool:
        """Give up the least recently used entries until `slots` slots and `rows` snapshot rows are free or on
        their way to be (as many as there are at most); whether any was given up."""
        dropped = len(self.dropped)
        while self._slots.short(min(slots, self.slots)) and self._drop_oldest():
            pass
        while self._rows.short(min(rows, self.snapshot_rows)) and self._drop_oldest(with_snapshot=True):
            pass
        return len(self.dropped) > dropped

    def take_row(self) -> int | None:
        """A free snapshot row (least recently used entries with one give way to keep the reserve); None when none
        is free."""
        while self._rows.short() and self._drop_oldest(with_snapshot=True):
            pass
        return self._rows.free.pop() if self._rows.free else None

    def store(self, key: bytes, length: int, snapshot: bool = False, parent: bytes = b"") -> HostEntry | None:
        """An entry for `key`'s page (and, with `snapshot`, a snapshot row); None when no slot (or row) is free,
        or the key is held already."""
        if key in self._entries or not self.slots:
            return None
        row = self.take_row() if snapshot else None
        if snapshot and row is None:
            return None
        slot = self.take_slot()
        if slot is None:
            if row is not None:
                self._rows.free.append(row)
            return None
        self._add(key, HostEntry(slot, length, row, parent))
        return self._entries[key]

    def _add(self, key: bytes, entry: HostEntry) -> None:
        self._entries[key] = entry
        if entry.snapshot is not None:
            self._exact_ends.add(entry.parent, key, entry.length)

    def adopt(self, key: bytes, entry: HostEntry) -> None:
        """A slot (and snapshot row) taken (take_slot, take_row) and filled from disk becomes `key`'s entry."""
        if key in self._entries:
            self.give_back(entry.slot, entry.snapshot)
        else:
            self._add(key, entry)

    def give_back(self, slot: int, row: int | None = None) -> None:
        """A slot (and snapshot row) taken and not filled (its file was unreadable), or filled twice."""
        self._slots.dropping.append(slot)
        if row is not None:
            self._rows.dropping.append(row)

    def forget(self, slot: int) -> None:
        """The entry in `slot`, whose page never arrived (its step failed), is given up."""
        key = next((k for k, e in self._entries.items() if e.slot == slot), None)
        if key is not None:
            self._remove(key)

    def _drop_oldest(self, with_snapshot: bool = False) -> bool:
        victim = next((k for k, e in self._entries.items()
                       if e.slot not in self._pins and (e.snapshot is not None or not with_snapshot)), None)
        if victim is None:
            return False
        self.dropped.append((victim, self._remove(victim, hold=self.holds_dropped)))
        return True

    def unhold(self, slot: int, row: int | None = None) -> None:
        """A slot (and snapshot row) held since its entry was given up is not written after all: reusable once the
        step committed next completes, as a slot given up without a disk tier below."""
        self._slots.held.remove(slot)
        self._slots.dropping.append(slot)
        if row is not None:
            self._rows.held.remove(row)
            self._rows.dropping.append(row)

    def release(self, slot: int, row: int | None = None) -> None:
        """A slot (and snapshot row) held since its entry was given up is free: its file is written, or need not be."""
        self._slots.held.remove(slot)
        self._slots.free.append(slot)
        if row is not None:
            self._rows.held.remove(row)
            self._rows.free.append(row)

    def _remove(self, key: bytes, hold: bool = False) -> HostEntry:
        entry = self._entries.pop(key)
        self._slots.give_up(entry.slot, hold)
        if entry.snapshot is not None:
            self._rows.give_up(entry.snapshot, hold)
            self._exact_ends.remove(entry.parent, key)
        return entry

    def committed(self, fence: int) -> None:
        """A step was committed: the slots given up before it are reusable once it completes."""
        self._slots.committed(fence)
        self._rows.committed(fence)

    def completed(self, fence: int) -> None:
        self._slots.completed(fence)
        self._rows.completed(fence)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] == 1:
            del self._pins[slot]
        else:
            self._pins[slot] -= 1
