"""PrefixCheckpointCache: immutable prefix checkpoints over KV pages, found by PrefixHistory keys.

Every checkpoint owns exactly one page: a block checkpoint the page of its last complete block, an exact checkpoint
(an endpoint inside a block, e.g. a message end) a private copy of its partial page. Earlier pages are reached through
parent links, so a conversation's checkpoints share their common prefix. This is metadata only: it never touches the
device. Pages come back through `RetiredResources`, which carry the fence of their last GPU use; the page allocator
makes them reusable only once that fence has completed.

A hybrid model's exact checkpoint also owns a snapshot row of recurrent state (`snapshot`: docs/design.md, Scheduler
and prefix checkpoints), and so does a block checkpoint whose end was an endpoint: only such a checkpoint is a place
to continue from, so the cache indexes them by parent (`exact_ends`) for a lookup that tries every endpoint a prompt
may extend, and retires their rows with their pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.cache.exact_ends import ExactEnds


@dataclass(eq=False)
class Checkpoint:
    id: int
    key: bytes
    length: int  # tokens covered
    parent: "Checkpoint | None"
    page: int
    ready_fence: int | None  # None: its page is not yet written (the fence is set when the writing step commits)
    ready: bool = False
    pins: int = 0  # direct pins plus pins of descendants: a pinned checkpoint's pages are in use
    children: int = 0
    last_access: int = 0
    last_use_fence: int = 0
    evicted: bool = False
    snapshot: int | None = None  # a hybrid model's recurrent-state snapshot id at exactly `length`


@dataclass(frozen=True)
class Created:
    checkpoint: Checkpoint  # the proposed page now belongs to the cache


@dataclass(frozen=True)
class Existing:
    checkpoint: Checkpoint  # the caller keeps its proposed page


@dataclass(frozen=True)
class RetiredResources:
    pages: list[int]
    fence: int  # the last GPU use of these pages (and snapshots)
    snapshots: tuple[int, ...] = ()
    key: bytes = b""  # the evicted checkpoint's (its page may move to the host tier: engine/cache/host_tier.py)
    length: int = 0
    parent: bytes = b""  # its parent's key (b"": none)


@dataclass
class CacheStats:
    publications: int = 0
    evictions: int = 0
    pages: int = 0


class PrefixCheckpointCache:
    def __init__(self) -> None:
        self._by_key: dict[bytes, Checkpoint] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._completed_fence = 0
        self._pending: list[Checkpoint] = []
        self.stats = CacheStats()
        # Keys that became visible to lookup, and keys evicted, since the last `take_journal` (for the frontends'
        # routing indexes: engine/telemetry.py announces them).
        self._stored: list[bytes] = []
        self._evicted: list[bytes] = []
        self._exact_ends = ExactEnds()  # checkpoints with a snapshot, by their parent's id (0: no parent)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        """Whether `key` is a ready checkpoint (without touching its recency, as a lookup does)."""
        checkpoint = self._by_key.get(key)
        return checkpoint is not None and checkpoint.ready

    def lookup(self, key: bytes) -> Checkpoint | None:
        found = self.lookup_run([key], 1)
        return found[0] if found else None

    def lookup_run(self, keys: list[bytes], count: int) -> list[Checkpoint]:
        """The ready checkpoints of keys[0], keys[1], ... up to the first miss among the first `count`, each
        accessed in turn: one call and a loop of local names for a long prompt's blocks (1,000 of them after a
        16k-token prefix)."""
        run: list[Checkpoint] = []
        by_key, clock = self._by_key, self._clock
        for key in keys[:count]:
            checkpoint = by_key.get(key)
            if checkpoint is None or not checkpoint.ready:
                break
            checkpoint.last_access = next(clock)
            run.append(checkpoint)
        return run

    def publish(self, key: bytes, length: int, parent: Checkpoint | None, page: int,
                ready_fence: int | None) -> Created | Existing:
        existing = self._by_key.get(key)
        if existing is not None:
            return Existing(existing)
        if parent is not None and parent.evicted:
            raise ValueError("the parent checkpoint was evicted")
        checkpoint = Checkpoint(next(self._ids), key, length, parent, page, ready_fence,
                                last_access=next(self._clock))
        self._by_key[key] = checkpoint
        if parent is not None:
            parent.children += 1
        self.stats.publications += 1
        self.stats.pages += 1
        if ready_fence is None or ready_fence > self._completed_fence:
            self._pending.append(checkpoint)
        else:
            checkpoint.ready = True
            self._stored.append(key)
        return Created(checkpoint)

    def attach_snapshot(self, checkpoint: Checkpoint, snapshot: int) -> None:
        """The checkpoint's state snapshot (a hybrid model's); it retires with the checkpoint."""
        checkpoint.snapshot = snapshot
        parent = checkpoint.parent.id if checkpoint.parent is not None else 0
        self._exact_ends.add(parent, checkpoint.key, checkpoint.length)

    def exact_ends(self, parent: Checkpoint | None) -> list[int]:
        """The lengths of the checkpoints with a snapshot under `parent` (None: the root), deepest first."""
        return sorted(set(self._exact_ends.under(parent.id if parent is not None else 0).values()), reverse=True)

    def pending_snapshots(self) -> list[Checkpoint]:
        """The checkpoints with a snapshot that are not visible yet (the step that makes them has not completed)."""
        return [c for c in self._pending if c.snapshot is not None]

    @property
    def snapshots(self) -> int:
        return len(self._exact_ends)

    def set_ready_fence(self, checkpoint: Checkpoint, fence: int) -> None:
        """The step that writes the checkpoint's page was submitted with this fence."""
        checkpoint.ready_fence = fence
        checkpoint.last_use_fence = max(checkpoint.last_use_fence, fence)

    def advance_completed(self, fence: int) -> list[Checkpoint]:
        """Checkpoints whose page-writing step has completed become visible to lookup."""
        self._completed_fence = fence
        ready = [c for c in self._pending if c.ready_fence is not None and c.ready_fence <= fence]
        if ready:
            self._pending = [c for c in self._pending if not (c.ready_fence is not None and c.ready_fence <= fence)]
            for checkpoint in ready:
                checkpoint.ready = True
                self._stored.append(checkpoint.key)
        return ready

    def take_journal(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) keys since the last call; a key evicted then published again is stored, not evicted."""
        journal = (self._stored, [key for key in self._evicted if key not in self])
        self._stored, self._evicted = [], []
        return journal

    def ready_keys(self) -> list[bytes]:
        return [key for key, checkpoint in self._by_key.items() if checkpoint.ready]

    def pin(self, checkpoint: Checkpoint) -> None:
        node: Checkpoint | None = checkpoint
        while node is not None:
            node.pins += 1
            node = node.parent

    def unpin(self, checkpoint: Checkpoint, last_use_fence: int) -> None:
        """Drop one pin of the checkpoint and its ancestors, whose pages were last used by `last_use_fence`."""
        node: Checkpoint | None = checkpoint
        while node is not None:
            if node.pins <= 0:
                raise ValueError(f"checkpoint {node.id} unpinned more often than pinned")
            node.pins -= 1
            node.last_use_fence = max(node.last_use_fence, last_use_fence)
            node = node.parent

    def pin_child(self, parent: Checkpoint, child: Checkpoint) -> None:
        """Move a pin from `parent` to its `child`: what pin(child) then unpin(parent) do to the pin counts, without
        walking the ancestors (a request that publishes its blocks after a 16k-token prefix would walk 1,000 of
        them twice per block). Their last-use fence is left for the final unpin of the deeper pin, which walks them
        with a fence no earlier than any it could be given now."""
        if child.parent is not parent or parent.pins <= 0:
            raise ValueError(f"checkpoint {child.id} is not a child of pinned checkpoint {parent.id}")
        child.pins += 1

    def evict(self, pages: int, snapshots: int = 0) -> list[RetiredResources]:
        """Retire unpinned, ready leaves in least-recently-used order until `pages` pages and `snapshots` snapshots
        are retired (or none are left to take)."""
        retired: list[RetiredResources] = []
        leaves = sorted((c for c in self._by_key.values() if c.children == 0 and c.pins == 0 and c.ready),
                        key=lambda c: c.last_access)
        while leaves and (len(retired) < pages or sum(len(r.snapshots) for r in retired) < snapshots):
            checkpoint = leaves.pop(0)
            retired.append(self._remove(checkpoint))
            parent = checkpoint.parent
            if parent is not None and parent.children == 0 and parent.pins == 0 and parent.ready:
                index = next((i for i, c in enumerate(leaves) if c.last_access > parent.last_access), len(leaves))
                leaves.insert(index, parent)
        return retired

    def _remove(self, checkpoint: Checkpoint) -> RetiredResources:
        del self._by_key[checkpoint.key]
        checkpoint.evicted = True
        self._evicted.append(checkpoint.key)
        if checkpoint.parent is not None:
            checkpoint.parent.children -= 1
        self.stats.evictions += 1
        self.stats.pages -= 1
        snapshots = ()
        if checkpoint.snapshot is not None:
            parent = checkpoint.parent.id if checkpoint.parent is not None else 0
            self._exact_ends.remove(parent, checkpoint.key)
            snapshots = (checkpoint.snapshot,)
        return RetiredResources([checkpoint.page], checkpoint.last_use_fence, snapshots, checkpoint.key,
                                checkpoint.length, checkpoint.parent.key if checkpoint.parent is not None else b"")
