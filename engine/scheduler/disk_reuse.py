"""Disk reuse for the scheduler: what the host tier gives up is written to the disk tier, and a waiting prompt that
extends checkpoints found only on disk has them read into host slots before it takes a slot, so that its placement
restores them from the host as any host hit (docs/design.md, Host retention).

The work is planned (Plan.disk) and done by the executor's disk thread after the step's copies, apart from the step:
a write's file joins the disk tier (and the host slot it was written from is free), and a read's slot the host tier,
once the executor reports the step's disk work done (DiskDone). A read whose file turned out unreadable (on any rank
of a tensor-parallel group) gives its slot back and its key up, and its file is deleted. A failed step's disk work
did not happen.

A disk is slow beside the GPU (the H200 machine's wrote about 200 MB/s: 2.5 s for the pages of a 4,000-token history
of an 8B model, which it prefills in 70 ms), and its reads queue behind the writes sent before them, so a prompt waits
for reads only while the learned costs say it beats computing the tokens again: the median seconds a file took in
recent disk work, times the files ahead of the reads and the reads, against the learned prefill cost of the tokens.
For the same reason an entry the host gives up is written only while reading its file back is expected to beat
computing its tokens again; otherwise its slot is free at once, as without a disk tier.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from common.prefix_history import PrefixHistory
from engine.cache.checkpoint_cache import PrefixCheckpointCache
from engine.cache.disk_files import DiskEntry
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostEntry, HostTier
from engine.scheduler.plan import DiskRead, DiskWork, DiskWrite
from engine.scheduler.policy import beats_recomputing


class DiskReuse:
    def __init__(self, disk: DiskTier, host: HostTier, cache: PrefixCheckpointCache, counters: Counter[str],
                 page_size: int, page_bytes: int, snapshot_bytes: int = 0, hybrid: bool = False) -> None:
        """`hybrid`: a hybrid model's tier, whose files hold its exact checkpoints' snapshots (of `snapshot_bytes`)."""
        self.disk = disk
        self.host = host
        self.cache = cache
        self.counters = counters
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.snapshot_bytes = snapshot_bytes
        self.hybrid = hybrid
        self._writes: list[DiskWrite] = []  # not yet sent
        self._reads: list[DiskRead] = []  # not yet sent
        self._loading: dict[bytes, tuple[DiskRead, DiskEntry]] = {}  # planned or in flight
        self._sent: dict[int, DiskWork] = {}  # committed work by fence, until it is done
        self._releases: dict[int, int | None] = {}  # host slots given up -> snapshot row: free once written
        self.gone: list[bytes] = []  # keys neither the host nor the disk holds any more (for announcements)
        self.file_seconds: deque[float] = deque(maxlen=9)  # what a file (written or read) took in recent disk work
        host.holds_dropped = True

    def held(self) -> set[bytes]:
        """The keys the disk tier holds or will once the writes to plan, planned and sent complete, and those it gave
        up whose files are not deleted yet (gone once their deletion is sent)."""
        return {*self.disk.keys(), *(key for key, _ in self.host.dropped), *(w.key for w in self._writes),
                *(w.key for work in self._sent.values() for w in work.writes), *self.disk.erased}

    @property
    def pending(self) -> bool:
        """Disk work to send with the next step."""
        return bool(self._writes or self._reads or self.disk.erased or self.host.dropped)

    @property
    def in_flight(self) -> bool:
        """Disk work sent and not done yet."""
        return bool(self._sent)

    def planned(self, recompute: Callable[[int], float]) -> DiskWork | None:
        """The next step's disk work: the host tier's dropped entries written (unless a file holds them already, or
        one is on its way from the same slot, or reading it back would take longer than computing its tokens
        again: `recompute(tokens)`, seconds, 0.0 unknown), the reads planned, the files given up deleted."""
        if self.host.dropped:  # (most steps drop nothing: the writes in flight are looked at only when some did)
            writing = {w.slot for w in self._writes} | {w.slot for work in self._sent.values() for w in work.writes}
            for key, entry in self.host.dropped:
                if entry.slot in writing:  # its file is on its way: the slot is free once it is written
                    self._releases[entry.slot] = entry.snapshot
                elif key in self.disk:
                    self.disk.get(key)
                    self.host.release(entry.slot, entry.snapshot)
                elif self._worth_writing(entry, recompute):
                    self._write(key, entry)
                    self._releases[entry.slot] = entry.snapshot
                else:
                    self.host.unhold(entry.slot, entry.snapshot)
                    self.counters["disk_unwritten"] += 1
                    if key not in self.cache:
                        self.gone.append(key)
            self.host.dropped = []
        if not (self._writes or self._reads or self.disk.erased):
            return None
        # Room for every file on its way (the work deletes before it writes): the directory stays within its budget,
        # giving up first the files of pages the host holds too.
        self.disk.make_room(self._incoming(), self._loading, self.host)
        return DiskWork(tuple(self._writes), tuple(self._reads), tuple(self.disk.erased))

    def write_host(self, recompute: Callable[[int], float]) -> None:
        """Every host entry without a file (or one on its way) that is worth writing (`planned`) to be written with
        the next step's disk work."""
        writing = self.held()
        unwritten = [key for key in self.host.keys()
                     if key not in writing and self._worth_writing(self.host.get(key), recompute)]
        for key in unwritten[-self.disk.capacity:]:  # (the most recently used, as many as the disk holds)
            self._write(key, self.host.get(key))
        self.disk.make_room(self._incoming(), self._loading)  # (none spared: the host's pages end with the process)

    def _incoming(self) -> int:
        """Files planned or sent to be written, not yet entries."""
        return len(self._writes) + sum(len(work.writes) for work in self._sent.values())

    def _worth_writing(self, entry: HostEntry, recompute: Callable[[int], float]) -> bool:
        """Whether reading the entry's file back is expected to beat computing what it saves again: a page's tokens,
        or for a hybrid's exact checkpoint every token up to it (its recurrent state is no page to recompute alone).
        A disk far slower than the accelerator's prefill (the H200 machine's: 40 ms a file of an 8B model's page,
        whose 64 tokens it prefills in about a millisecond) is then not written to, and its slots are not held up."""
        tokens = entry.length if entry.snapshot is not None else self.page_size
        return beats_recomputing(self.file_seconds, 1, recompute(tokens))

    def _write(self, key: bytes, entry: HostEntry) -> None:
        self._writes.append(DiskWrite(entry.slot, key, entry.length, -1 if entry.snapshot is None else entry.snapshot,
                                      entry.parent))

    def committed(self, work: DiskWork | None, fence: int) -> None:
        if work is None:
            return
        self._writes = self._writes[len(work.writes):]
        self._reads = self._reads[len(work.reads):]
        self.disk.erased = self.disk.erased[len(work.erasures):]
        self.gone.extend(key for key in work.erasures if key not in self.host and key not in self.cache)
        self._sent[fence] = work

    def done(self, fence: int, unreadable: tuple[int, ...] | None, seconds: float = 0.0) -> None:
        """The disk work sent with the step of `fence` ended, having taken `seconds`; `unreadable` None: the step
        failed, and none of it happened."""
        work = self._sent.pop(fence, None)
        if work is None:
            return
        if seconds and (files := len(work.writes) + len(work.reads)):
            self.file_seconds.append(seconds / files)
        for write in work.writes:
            if unreadable is not None:
                self.disk.add(write.key, DiskEntry(write.length, write.snapshot >= 0, write.parent))
                self.counters["disk_writes"] += 1
                self.counters["disk_bytes_out"] += self.page_bytes + (write.snapshot >= 0) * self.snapshot_bytes
            elif write.key not in self.host and write.key not in self.cache:
                self.gone.append(write.key)
            if write.slot in self._releases:
                self.host.release(write.slot, self._releases.pop(write.slot))
        for read in work.reads:
            _, entry = self._loading.pop(read.key)
            row = read.snapshot if read.snapshot >= 0 else None
            if unreadable is None or read.slot in unreadable:  # (its file goes, on every rank, with the next step)
                self.host.give_back(read.slot, row)
                self.disk.remove(read.key)
                self.disk.erased.append(read.key)
                self.counters["disk_unreadable"] += unreadable is not None
            else:
                self.host.adopt(read.key, HostEntry(read.slot, entry.length, row, entry.parent))
                self.counters["disk_reads"] += 1
                self.counters["disk_bytes_in"] += self.page_bytes + (row is not None) * self.snapshot_bytes

    def awaits_load(self, history: PrefixHistory, limit: int, message_ends: list[int], size: int,
                    recompute: Callable[[int], float]) -> bool:
        """Whether a waiting prompt had better wait for checkpoints that extend its cached prefix to be read from
        disk (reads planned here), rather than take a slot and compute them again: the blocks after those the
        device and the host hold, then the latest message end just beyond them (an exact checkpoint); for a hybrid
        model, the blocks up to its deepest exact checkpoint on disk and that checkpoint. Not when the reads would
        take longer than computing their tokens (`recompute(tokens)`: seconds, 0.0 unknown) again."""
        if not (len(self.disk) or self._loading):
            return False
        keys = history.block_keys[: limit // size]
        depth = 0
        while depth < len(keys) and (keys[depth] in self.cache or self.host.get(keys[depth]) is not None):
            depth += 1  # (the host's entries touched, so that reads below do not push them out)
        on_disk = depth
        while on_disk < len(keys) and (keys[on_disk] in self.disk or keys[on_disk] in self._loading):
            on_disk += 1
        if self.hybrid:
            wanted = self._exact_on_disk(history, keys, depth, on_disk, limit, size)
        else:
            wanted = keys[depth:on_disk] + self._end_on_disk(history, on_disk, limit, message_ends, size)
        reads = [key for key in wanted if key not in self._loading]
        if reads and not self._reading_pays(len(reads), len(wanted) * size, recompute):
            self.counters["disk_declined"] += 1
            return False
        planned = 0
        for key in reads:
            if not self._read(key):
                break
            planned += 1
        if planned:
            self.counters["disk_hits"] += 1
        return any(key in self._loading for key in wanted)

    def _reading_pays(self, reads: int, tokens: int, recompute: Callable[[int], float]) -> bool:
        """Whether `reads` more files, behind the disk work planned and sent, are expected to be read sooner than
        `tokens` computed again (taken while either is unmeasured)."""
        ahead = len(self._writes) + len(self._reads) + sum(len(w.writes) + len(w.reads) for w in self._sent.values())
        return beats_recomputing(self.file_seconds, ahead + reads, recompute(tokens))

    def _end_on_disk(self, history: PrefixHistory, depth: int, limit: int, message_ends: list[int],
                     size: int) -> list[bytes]:
        """The exact checkpoint of the latest message end in the block after `depth`, when only the disk has it."""
        for end in sorted(message_ends, reverse=True):
            if depth * size < end <= limit and end // size == depth:
                key = history.key_at(end)
                if key in self.cache or key in self.host:
                    return []
                if key in self.disk or key in self._loading:
                    return [key]
        return []

    def _exact_on_disk(self, history: PrefixHistory, keys: list[bytes], depth: int, on_disk: int, limit: int,
                       size: int) -> list[bytes]:
        """A hybrid's reads: the blocks up to its deepest exact checkpoint that the prompt extends, within the
        `depth` blocks the device and the host hold and the `on_disk` blocks the disk extends them with, and that
        checkpoint, when only the disk holds it (blocks without one are no place to continue from)."""
        for blocks in range(on_disk, -1, -1):
            parent = keys[blocks - 1] if blocks else b""
            on_file = self.disk.exact_ends(parent)
            for end in sorted({*on_file.values(), *self.host.exact_ends(parent)}, reverse=True):
                if end > limit or end // size > on_disk:
                    continue
                key = history.key_at(end)
                held, hosted = self.cache.lookup(key), self.host.get(key)
                # (at a block's end the key names the block's checkpoint too, which may hold no snapshot)
                if held is not None and held.snapshot is not None or hosted is not None and hosted.snapshot is not None:
                    return []  # held (or read already)
                if hosted is not None:
                    continue  # the block's page is on the host without the snapshot: the file cannot join it
                if on_file.get(key) == end:
                    before = keys[depth: end // size]
                    return before if key in before else before + [key]  # (at a block's end, the block's own)
        return []

    def _read(self, key: bytes) -> bool:
        """Plan `key`'s read into a host slot (and snapshot row); False when the host has none free."""
        entry = self.disk.get(key)
        slot = self.host.take_slot()
        if slot is None:
            return False
        row = self.host.take_row() if entry.snapshot else None
        if entry.snapshot and row is None:
            self.host.give_back(slot)
            return False
        read = DiskRead(key, slot, -1 if row is None else row)
        self._reads.append(read)
        self._loading[key] = (read, entry)
        return True
