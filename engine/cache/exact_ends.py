"""ExactEnds: exact checkpoints (a hybrid model's, each with a recurrent-state snapshot) indexed by the block before
their own. Pages alone are no place to continue a recurrent state from, so a lookup tries, under each block of a
prompt, every exact end there; the device's prefix cache, the host tier and the disk tier each keep one."""

from __future__ import annotations

from collections.abc import Hashable


class ExactEnds:
    def __init__(self) -> None:
        self._by_parent: dict[Hashable, dict[bytes, int]] = {}  # parent -> checkpoint key -> tokens it covers

    def __len__(self) -> int:
        return sum(map(len, self._by_parent.values()))

    def add(self, parent: Hashable, key: bytes, length: int) -> None:
        self._by_parent.setdefault(parent, {})[key] = length

    def remove(self, parent: Hashable, key: bytes) -> None:
        ends = self._by_parent[parent]
        del ends[key]
        if not ends:
            del self._by_parent[parent]

    def under(self, parent: Hashable) -> dict[bytes, int]:
        """The keys and lengths of the exact checkpoints under `parent`."""
        return self._by_parent.get(parent, {})
