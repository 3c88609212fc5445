"""HostTier: which prefix checkpoints' pages are held in host memory once the device's prefix cache evicted them.

Metadata only, as the device's PrefixCheckpointCache is: a key (the same BLAKE2b block key, seeded with the core's
identity) maps to a host slot that holds one page of K and V for every layer; the executor owns the slots' memory
(engine/executor/tier_copies.py) and carries out the copies the plans name (docs/design.md, Host retention).

Slots are reused least recently used first. A slot that a planned restore reads is pinned until that restore is
committed; after that, the executor's in-order copies make its reuse safe (a later spill into it runs after the
restore that read it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class HostEntry:
    slot: int
    length: int  # tokens the checkpoint covers (a block's end, or an exact checkpoint's message end)


class HostTier:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # slot -> planned restores that read it
        self._dropped: list[bytes] = []  # keys given up since the last take_dropped (for the routing announcements)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> HostEntry | None:
        """The entry of `key`, now the most recently used."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def store(self, key: bytes, length: int) -> int | None:
        """A slot for `key`'s page (the least recently used unpinned entry gives way); None when every slot is
        pinned, or the key is held already."""
        if key in self._entries or not self.slots:
            return None
        if not self._free:
            victim = next((k for k, e in self._entries.items() if e.slot not in self._pins), None)
            if victim is None:
                return None
            self._free.append(self._entries.pop(victim).slot)
            self._dropped.append(victim)
        slot = self._free.pop()
        self._entries[key] = HostEntry(slot, length)
        return slot

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def take_dropped(self) -> list[bytes]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] == 1:
            del self._pins[slot]
        else:
            self._pins[slot] -= 1
