"""The copies a plan makes before its forward, as the scheduler tracks them until the plan that makes them is
committed (engine/scheduler/prefix.py), and the Plan fields they become (docs/design.md, Scheduler and prefix
checkpoints; Host retention). The executor makes them in this order: spills, restores, page copies, state copies."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.checkpoint_cache import Checkpoint
from engine.scheduler.request import Request


@dataclass(frozen=True)
class PageCopy:
    """A KV page copy the next step makes before its forward."""

    source: int
    destination: int
    made: Checkpoint | None  # the exact checkpoint the copy creates (None: a reusing request's private copy)
    reader: Request  # the request whose page table holds the source (or that reuses it)
    source_checkpoint: Checkpoint | None  # the source's owner when the cache owns it: pinned until the copy is sent


@dataclass(frozen=True)
class StateCopy:
    """A recurrent-state row copy the next step makes before its forward (after its page copies): a snapshot of a
    slot's row, or the restore of a snapshot into a slot's row."""

    source: int  # state rows (Plan.state_copies)
    destination: int
    snapshot: int  # the snapshot id written or read
    reader: Request  # the request whose slot row is read or written
    source_checkpoint: Checkpoint | None  # a restore's checkpoint: pinned until the copy is sent
    transit: bool = False  # a restore from a snapshot row that a host snapshot was restored into (SnapshotRestore)


@dataclass(frozen=True)
class Spill:
    """An evicted checkpoint's page copied to a host slot (docs/design.md, Host retention), and a hybrid model's
    snapshot with it. The next step makes it first, before anything may write the page or the snapshot row (each
    was released at its last use and may be handed out at once)."""

    page: int
    slot: int
    state: tuple[int, int] | None = None  # (device state row, host snapshot row): the checkpoint's snapshot


@dataclass(frozen=True)
class Restore:
    """A host slot copied into a request's private page before the next step's forward (after its spills)."""

    slot: int
    page: int
    reader: Request


@dataclass(frozen=True)
class SnapshotRestore:
    """A host snapshot row copied into a device snapshot row (its transit row) with the step's restores; the step's
    state copies then move it into the request's slot row (a StateCopy in transit), after any snapshot of that row
    that the slot's previous request left for the step to take."""

    row: int  # the host snapshot row
    destination: int  # the device state row
    slot: int  # the host slot of the checkpoint's entry: pinned until the restore is sent
    reader: Request


Copy = PageCopy | StateCopy | Spill | Restore | SnapshotRestore


def copy_fields(copies: tuple[Copy, ...]) -> dict[str, tuple[tuple[int, int], ...]]:
    """The fields of a plan that makes `copies` (PrefixReuse.planned_copies): Plan.copies, state_copies, spills,
    restores, state_spills and state_restores, each in the copies' order."""
    spills = [c for c in copies if isinstance(c, Spill)]
    return {"copies": tuple((c.source, c.destination) for c in copies if isinstance(c, PageCopy)),
            "state_copies": tuple((c.source, c.destination) for c in copies if isinstance(c, StateCopy)),
            "spills": tuple((c.page, c.slot) for c in spills),
            "restores": tuple((c.slot, c.page) for c in copies if isinstance(c, Restore)),
            "state_spills": tuple(c.state for c in spills if c.state is not None),
            "state_restores": tuple((c.row, c.destination) for c in copies if isinstance(c, SnapshotRestore))}
