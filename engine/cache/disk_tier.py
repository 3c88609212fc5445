"""DiskTier: which checkpoint pages the disk cache directory holds (docs/design.md, Host retention).

Metadata only: the executor reads and writes the files (engine/cache/disk_files.py, engine/executor/tier_copies.py)
as plans say. Entries leave least recently used first once `capacity` files are held, counting the files on their way
(`make_room`, before a step's writes are sent), so that the directory never holds more; a file is an entry once the
step that writes it has completed. Entries with a snapshot (a hybrid model's exact checkpoints) are indexed by their
parent block's key, as the host tier's are.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container

from engine.cache.disk_files import DiskEntry
from engine.cache.exact_ends import ExactEnds


class DiskTier:
    def __init__(self, capacity: int, found: list[tuple[bytes, DiskEntry]]) -> None:
        """`found`: the files already there (disk_files.scan), least recently written first."""
        self.capacity = capacity
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()
        self._exact_ends = ExactEnds()  # entries with a snapshot
        self.erased: list[bytes] = []  # entries dropped whose files are to be deleted
        for key, entry in found:
            self.add(key, entry)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def get(self, key: bytes) -> DiskEntry | None:
        """`key`'s entry, now the most recently used; None when no file holds it."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def exact_ends(self, parent: bytes) -> dict[bytes, int]:
        """The keys and lengths of the entries with a snapshot whose parent key is `parent` (b"": the root)."""
        return self._exact_ends.under(parent)

    def add(self, key: bytes, entry: DiskEntry) -> None:
        self.remove(key)
        self._entries[key] = entry
        if entry.snapshot:
            self._exact_ends.add(entry.parent, key, entry.length)
        self.make_room(0)

    def make_room(self, incoming: int, keep: Container[bytes] = (), spare: Container[bytes] = ()) -> None:
        """Give up least recently used entries but those in `keep` (files being read) until `incoming` more files
        fit in the capacity, those in `spare` first (keys the host tier holds too: their pages outlive the file,
        which is written again if the host gives them up); their files are deleted before the writes that follow."""
        excess = len(self._entries) + incoming - self.capacity
        if excess <= 0:
            return
        victims = list(itertools.islice((key for key in self._entries if key in spare and key not in keep), excess))
        if len(victims) < excess:
            chosen = set(victims)
            victims += itertools.islice((key for key in self._entries if key not in keep and key not in chosen),
                                        excess - len(victims))
        for key in victims:
            self.remove(key)
            self.erased.append(key)

    def remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.snapshot:
            self._exact_ends.remove(entry.parent, key)
