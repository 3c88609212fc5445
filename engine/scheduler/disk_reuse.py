"""Disk reuse for the scheduler: what the host tier gives up is written to the disk tier, and a waiting prompt that
extends checkpoints found only on disk has them read into host slots before it takes a slot, so that its placement
restores them from the host as any host hit (docs/design.md, Host retention).

The work is planned (Plan.disk) and done by the executor after the step's copies, before its completion is reported;
a write's file joins the disk tier, and a read's slot the host tier, once that step completes. A read whose file
turned out unreadable (on any rank of a tensor-parallel group) gives its slot back and its key up, and its file is
deleted.
"""

from __future__ import annotations

from collections import Counter

from common.prefix_history import PrefixHistory
from engine.cache.checkpoint_cache import PrefixCheckpointCache
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.scheduler.plan import DiskWork


class DiskReuse:
    def __init__(self, disk: DiskTier, host: HostTier, cache: PrefixCheckpointCache, counters: Counter[str],
                 page_bytes: int) -> None:
        self.disk = disk
        self.host = host
        self.cache = cache
        self.counters = counters
        self.page_bytes = page_bytes
        self._writes: list[tuple[int, bytes, int]] = []  # (slot, key, tokens) not yet sent
        self._reads: list[tuple[bytes, int]] = []  # (key, slot) not yet sent
        self._loading: dict[bytes, tuple[int, int]] = {}  # key -> (slot, tokens), planned or in flight
        self._sent: list[tuple[int, DiskWork]] = []  # committed work by fence, until its step completes
        self.gone: list[bytes] = []  # keys neither the host nor the disk holds any more (for announcements)

    def held(self) -> set[bytes]:
        """The keys the disk tier holds or will once the writes to plan, planned and sent complete, and those it gave
        up whose files are not deleted yet (gone once their deletion is sent)."""
        return {*self.disk.keys(), *(key for key, _ in self.host.dropped), *(key for _, key, _ in self._writes),
                *(key for _, work in self._sent for _, key, _ in work.writes), *self.disk.erased}

    @property
    def pending(self) -> bool:
        return bool(self._writes or self._reads or self.disk.erased or self.host.dropped)

    def planned(self) -> DiskWork | None:
        """The next step's disk work: the host tier's dropped entries written (unless a file holds them already),
        the reads planned, the files given up deleted."""
        for key, entry in self.host.dropped:
            if key in self.disk or any(k == key for _, k, _ in self._writes):
                self.disk.get(key)
            else:
                self._writes.append((entry.slot, key, entry.length))
        self.host.dropped = []
        if not (self._writes or self._reads or self.disk.erased):
            return None
        return DiskWork(tuple(self._writes), tuple(self._reads), tuple(self.disk.erased))

    def committed(self, work: DiskWork | None, fence: int) -> None:
        if work is None:
            return
        self._writes = self._writes[len(work.writes):]
        self._reads = self._reads[len(work.reads):]
        self.disk.erased = self.disk.erased[len(work.erasures):]
        self.gone.extend(key for key in work.erasures if key not in self.host and key not in self.cache)
        self._sent.append((fence, work))

    def completed(self, fence: int, unreadable: tuple[int, ...]) -> None:
        while self._sent and self._sent[0][0] <= fence:
            _, work = self._sent.pop(0)
            for _, key, length in work.writes:
                self.disk.add(key, length)
                self.counters["disk_writes"] += 1
                self.counters["disk_bytes_out"] += self.page_bytes
            for key, slot in work.reads:
                _, length = self._loading.pop(key)
                if slot in unreadable:  # (its file goes, on every rank, with the next step's disk work)
                    self.host.give_back(slot)
                    self.disk.remove(key)
                    self.disk.erased.append(key)
                    self.counters["disk_unreadable"] += 1
                else:
                    self.host.adopt(key, length, slot)
                    self.counters["disk_reads"] += 1
                    self.counters["disk_bytes_in"] += self.page_bytes

    def awaits_load(self, history: PrefixHistory, limit: int, message_ends: list[int], size: int) -> bool:
        """Whether a waiting prompt had better wait for checkpoints that extend its cached prefix to be read from
        disk (reads planned here), rather than take a slot and compute them again."""
        if not (len(self.disk) or self._loading):
            return False
        keys = history.block_keys[: limit // size]
        depth = 0
        while depth < len(keys) and (keys[depth] in self.cache or self.host.get(keys[depth]) is not None):
            depth += 1  # (the host's entries touched, so that reads below do not push them out)
        wanted = []
        while depth < len(keys) and (keys[depth] in self.disk or keys[depth] in self._loading):
            wanted.append(keys[depth])
            depth += 1
        for end in sorted(message_ends, reverse=True):
            if depth * size < end <= limit and end // size == depth:
                key = history.key_at(end)
                if key in self.cache or key in self.host:
                    break
                if key in self.disk or key in self._loading:
                    wanted.append(key)
                    break
        planned = 0
        for key in wanted:
            if key in self._loading:
                continue
            slot = self.host.take_slot()
            if slot is None:
                break
            self._reads.append((key, slot))
            self._loading[key] = (slot, self.disk.get(key))
            planned += 1
        if planned:
            self.counters["disk_hits"] += 1
        return any(key in self._loading for key in wanted)
