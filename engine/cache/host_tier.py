"""HostTier: which prefix checkpoints' pages are held in host memory once the device's prefix cache evicted them.

Metadata only, as the device's PrefixCheckpointCache is: a key (the same BLAKE2b block key, seeded with the core's
identity) maps to a host slot that holds one page of K and V for every layer; the executor owns the slots' memory
(engine/executor/tier_copies.py) and carries out the copies the plans name (docs/design.md, Host retention).

Entries give way least recently used first, keeping `reserve` slots free or on their way to be, so that a step's
evictions find slots. A slot given up is reusable once the step committed after that completes: the executor may
still write it to disk then (a demotion), or copy it to the device for a restore sent earlier. A slot that a planned
restore reads is pinned until that restore is committed.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class HostEntry:
    slot: int
    length: int  # tokens the checkpoint covers (a block's end, or an exact checkpoint's message end)


class HostTier:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.reserve = max(slots // 8, 1)
        self._free = list(range(slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # slot -> planned restores that read it
        self._dropping: list[int] = []  # slots given up since the last committed step
        self._retiring: list[tuple[int, int]] = []  # heap of (fence, slot): reusable once the fence completes
        self.dropped: list[tuple[bytes, HostEntry]] = []  # entries given up, for the disk tier and announcements

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def get(self, key: bytes) -> HostEntry | None:
        """The entry of `key`, now the most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def take_slot(self) -> int | None:
        """A free slot (least recently used entries give way to keep the reserve); None when none is free."""
        while len(self._free) + len(self._dropping) + len(self._retiring) <= self.reserve and self._drop_oldest():
            pass
        return self._free.pop() if self._free else None

    def store(self, key: bytes, length: int) -> int | None:
        """A slot for `key`'s page; None when none is free, or the key is held already."""
        if key in self._entries or not self.slots:
            return None
        slot = self.take_slot()
        if slot is not None:
            self._entries[key] = HostEntry(slot, length)
        return slot

    def adopt(self, key: bytes, length: int, slot: int) -> None:
        """A slot taken (take_slot) and filled from disk becomes `key`'s entry."""
        if key in self._entries:
            self.give_back(slot)
        else:
            self._entries[key] = HostEntry(slot, length)

    def give_back(self, slot: int) -> None:
        """A slot taken and not filled (its file was unreadable), or filled twice."""
        self._dropping.append(slot)

    def forget(self, slot: int) -> None:
        """The entry in `slot`, whose page never arrived (its step failed), is given up."""
        key = next((k for k, e in self._entries.items() if e.slot == slot), None)
        if key is not None:
            del self._entries[key]
            self._dropping.append(slot)

    def _drop_oldest(self) -> bool:
        victim = next((k for k, e in self._entries.items() if e.slot not in self._pins), None)
        if victim is None:
            return False
        entry = self._entries.pop(victim)
        self._dropping.append(entry.slot)
        self.dropped.append((victim, entry))
        return True

    def committed(self, fence: int) -> None:
        """A step was committed: the slots given up before it are reusable once it completes."""
        for slot in self._dropping:
            heapq.heappush(self._retiring, (fence, slot))
        self._dropping = []

    def completed(self, fence: int) -> None:
        while self._retiring and self._retiring[0][0] <= fence:
            self._free.append(heapq.heappop(self._retiring)[1])

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] == 1:
            del self._pins[slot]
        else:
            self._pins[slot] -= 1
