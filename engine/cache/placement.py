"""Where the host tier places the entries a step spills in its least-recently-used order (docs/design.md, Host
retention).

As the most recently used, the tier keeps whatever came back soonest: right while conversations return within what
the tier holds. When they return after more traffic than it holds (a service revisiting more conversations than fit),
that order gives up every entry before its reuse and keeps almost none: each miss computes a history again, whose
spills push out the next conversation waiting for its turn. Placed as the least recently used instead (the next
spills push them out first), the tier keeps a stable part of the conversations until their return ("bimodal
insertion": one step in `PERIOD` still places its entries as the most recent, so that a changed workload is noticed).

Neither is right for every workload, so the tier follows two shadow directories of keys, as large as the tier, each
placing one way, through the same spills and lookups, and places as the one whose lookups found more of late (set
dueling: Qureshi et al., "Adaptive insertion policies for high performance caching", ISCA 2007). Keys only: the
shadows cost a few hundred bytes a slot.
"""

from __future__ import annotations

from collections import OrderedDict

PERIOD = 32  # one spilling step in this many places its entries as the most recent even while the duel says oldest
DECAY = 0.98  # each lookup's weight against the next one's: the duel remembers about the last fifty lookups


def place(order: OrderedDict[bytes, object], keys: list[bytes], oldest: bool) -> None:
    """Move `keys` (a step's spills, parents first, each held in `order`) to the least recently used end of `order`
    (`oldest`) or to the most recently used end, either way with the deepest given up first."""
    for key in keys if oldest else reversed(keys):
        order.move_to_end(key, last=not oldest)


class _Shadow:
    """The keys a tier of `capacity` entries would hold, placing new ones as the most or the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def spilled(self, keys: list[bytes], oldest: bool) -> None:
        """`keys`, parents first; a key held already stays where it is, as in the tier."""
        new = [key for key in keys if key not in self.keys]
        self.keys.update(dict.fromkeys(new))
        place(self.keys, new, oldest)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def found(self, keys: list[bytes]) -> int:
        """How many of `keys` from the first are held (now the most recently used)."""
        run = 0
        for key in keys:
            if key not in self.keys:
                break
            self.keys.move_to_end(key)
            run += 1
        return run


class PlacementDuel:
    def __init__(self, capacity: int) -> None:
        self._recent, self._bimodal = _Shadow(capacity), _Shadow(capacity)
        self._found = [0.0, 0.0]  # decayed keys found by lookups: (placing as the most recent, bimodal)
        self._steps = 0

    @property
    def bimodal(self) -> bool:
        """Whether bimodal placement found more of late."""
        return self._found[1] > self._found[0]

    def spilled(self, keys: list[bytes]) -> bool:
        """A step's spilled keys, parents first: whether the tier places those it takes as the least recently used."""
        self._steps += 1
        periodic = self._steps % PERIOD == 0
        self._recent.spilled(keys, oldest=False)
        self._bimodal.spilled(keys, oldest=not periodic)
        return self.bimodal and not periodic

    def looked_up(self, keys: list[bytes]) -> None:
        """A request looked for `keys` (the blocks beyond the device's prefix) in the tier."""
        self._found = [self._found[0] * DECAY + self._recent.found(keys),
                       self._found[1] * DECAY + self._bimodal.found(keys)]
