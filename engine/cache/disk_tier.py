"""DiskTier: which checkpoint pages the disk cache directory holds (docs/design.md, Host retention).

Metadata only: the executor reads and writes the files (engine/cache/disk_files.py, engine/executor/tier_copies.py)
as plans say. Entries leave least recently used first once `capacity` files are held; a file is an entry once the
step that writes it has completed.
"""

from __future__ import annotations

from collections import OrderedDict


class DiskTier:
    def __init__(self, capacity: int, found: list[tuple[bytes, int]]) -> None:
        """`found`: the (key, length) of the files already there (disk_files.scan), least recently written first."""
        self.capacity = capacity
        self._entries: OrderedDict[bytes, int] = OrderedDict(found)
        self.erased: list[bytes] = []  # entries dropped whose files are to be deleted
        self._trim()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def get(self, key: bytes) -> int | None:
        """The tokens `key`'s checkpoint covers, now the most recently used; None when no file holds it."""
        length = self._entries.get(key)
        if length is not None:
            self._entries.move_to_end(key)
        return length

    def add(self, key: bytes, length: int) -> None:
        self._entries[key] = length
        self._entries.move_to_end(key)
        self._trim()

    def remove(self, key: bytes) -> None:
        self._entries.pop(key, None)

    def _trim(self) -> None:
        while len(self._entries) > self.capacity:
            self.erased.append(self._entries.popitem(last=False)[0])
