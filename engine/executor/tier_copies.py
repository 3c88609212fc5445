"""HostPages: the host tier's memory, and the spills and restores a plan names (docs/design.md, Host retention).

A slot holds one KV page of every layer, contiguous ([layers, 2, page_size, kv_heads, head_dim]), so that a slot is
one block of bytes to move; a hybrid model's host snapshot row, a recurrent-state row of every linear layer
(engine/model/recurrent_state.py), contiguous too. On a GPU both are pinned and the copies run on the copy stream:
behind what the model stream has queued so far (the step that last used the pages and rows), and ahead of the step's
forward, which waits for them. Spills go first: an evicted page or snapshot row may be handed out by the very step
whose forward (or state copies) writes it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from pathlib import Path

import torch

from engine.cache import disk_files
from engine.model.config import DecoderConfig
from engine.model.recurrent_state import RecurrentState
from engine.scheduler.plan import DiskWork, Plan

log = logging.getLogger("flare.engine")


def slot_shape(config: DecoderConfig, page_size: int) -> tuple[int, ...]:
    """A host slot: one page of every layer's K and V (the KV cache's layout, engine/executor/eager.py, one page)."""
    return len(config.kv_layers), 2, page_size, config.num_kv_heads, config.head_dim


def host_slot_bytes(config: DecoderConfig, page_size: int, dtype: torch.dtype) -> int:
    return torch.Size(slot_shape(config, page_size)).numel() * dtype.itemsize


def host_memory(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """The tier's host memory; `pinned`: page-locked where it lies, for the copy engine, of exactly its bytes. (torch's
    pinned allocator rounds an allocation up to a power of two: a 40 GiB tier would lock 64 GiB of the machine.)

    Resident from the start either way: registering it faults every page in, and unpinned memory is written once
    here. Otherwise the first spill into each slot would fault its pages in (on the CPU, milliseconds a page: many
    times the copy itself), a cost no restore pays but the learned page copy time, which restores are weighed by, would
    count until every slot had been used once."""
    tensor = torch.empty(shape, dtype=dtype)
    if pinned and tensor.numel():
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
        weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    elif tensor.numel():
        tensor.view(torch.uint8).zero_()
    return tensor


def moves(plan: Plan) -> bool:
    """Whether the plan copies anything to or from the host tier (a snapshot's spill goes with its page's)."""
    return bool(plan.spills or plan.restores or plan.state_restores)


class HostPages:
    def __init__(self, config: DecoderConfig, slots: int, page_size: int, dtype: torch.dtype, pinned: bool,
                 disk: tuple[Path, bytes] | None = None, snapshots: int = 0,
                 state_dtype: torch.dtype | None = None) -> None:
        """`dtype`: the KV cache's; `disk`: the disk tier's directory and the core's cache identity, which its files
        carry; `snapshots`: a hybrid model's host snapshot rows, their conv state in `state_dtype` (the model's;
        `dtype` when not given)."""
        self.page_size = page_size
        self.slots = host_memory((slots, *slot_shape(config, page_size)), dtype, pinned)
        conv, delta = RecurrentState.row_shapes(config) if snapshots else ((0,), (0,))
        self.conv = host_memory((snapshots, *conv), state_dtype or dtype, pinned)
        self.delta = host_memory((snapshots, *delta), torch.float32, pinned)
        self.directory = disk[0] if disk is not None else None
        snapshot_bytes = RecurrentState.row_bytes(config, state_dtype or dtype) if snapshots else 0
        self.layout = disk_files.Layout(disk[1], str(dtype), slot_shape(config, page_size), snapshot_bytes) \
            if disk else None

    def disk_work(self, work: DiskWork, stop: threading.Event | None = None) -> tuple[int, ...]:
        """Deletions, writes and reads of the disk tier's files, once the step's copies are done (the caller waits
        for them); the slots of the reads that found no servable file, each logged. Deletions come first: they make
        the room the writes were given, and a key given up and written again in one step keeps its new file. Once
        `stop` is set the writes left are not made: a clean stop's last step writes the host's entries, minutes of a
        slow disk's time."""
        for key in work.erasures:
            (self.directory / disk_files.file_name(key)).unlink(missing_ok=True)
        for write in work.writes:
            if stop is not None and stop.is_set():
                break
            entry = disk_files.DiskEntry(write.length, write.snapshot >= 0, write.parent)
            try:
                disk_files.write(self.directory, write.key, entry, self.layout, self._bytes(write.slot),
                                 self._snapshot_bytes(write.snapshot) if write.snapshot >= 0 else None)
            except OSError as exc:
                log.warning("disk cache: writing %s failed: %s", disk_files.file_name(write.key), exc)
        unreadable = []
        for read in work.reads:
            try:
                page, snapshot = disk_files.read(self.directory, read.key, self.layout)
                if (snapshot is not None) != (read.snapshot >= 0):
                    raise disk_files.UnreadableFile("a snapshot where none was expected, or none where one was")
            except disk_files.UnreadableFile as exc:
                log.warning("disk cache: skipping %s: %s", disk_files.file_name(read.key), exc)
                unreadable.append(read.slot)
                continue
            self._bytes(read.slot)[:] = page
            if snapshot is not None:
                conv = self.conv[read.snapshot].nbytes
                self._row_bytes(self.conv, read.snapshot)[:] = snapshot[:conv]
                self._row_bytes(self.delta, read.snapshot)[:] = snapshot[conv:]
        return tuple(unreadable)

    def _bytes(self, slot: int) -> memoryview:
        return self._row_bytes(self.slots, slot)

    @staticmethod
    def _row_bytes(rows: torch.Tensor, row: int) -> memoryview:
        return memoryview(rows[row].view(torch.uint8).numpy()).cast("B")

    def _snapshot_bytes(self, row: int) -> bytes:
        """A host snapshot row as a file holds it: its conv inputs, then its delta-rule state."""
        return bytes(self._row_bytes(self.conv, row)) + bytes(self._row_bytes(self.delta, row))

    def copy(self, kv_cache: torch.Tensor, state: RecurrentState | None, plan: Plan,
             stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The plan's spills (device page, host slot; device state row, host snapshot row), then its restores (host
        slot, device page; host snapshot row, device state row); on `stream` when given, ordered after the current
        stream's work so far and before its next, between the two timing events returned."""
        if stream is None:
            self._copy(kv_cache, state, plan)
            return None
        current = torch.cuda.current_stream(kv_cache.device)
        stream.wait_stream(current)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            self._copy(kv_cache, state, plan)
            end.record(stream)
        current.wait_stream(stream)
        return start, end

    def _copy(self, kv_cache: torch.Tensor, state: RecurrentState | None, plan: Plan) -> None:
        size, async_ = self.page_size, kv_cache.is_cuda
        for page, slot in plan.spills:
            self.slots[slot].copy_(kv_cache[:, :, page * size:(page + 1) * size], non_blocking=async_)
        for row, host_row in plan.state_spills:
            self.conv[host_row].copy_(state.conv[:, row], non_blocking=async_)
            self.delta[host_row].copy_(state.delta[:, row], non_blocking=async_)
        for slot, page in plan.restores:
            kv_cache[:, :, page * size:(page + 1) * size].copy_(self.slots[slot], non_blocking=async_)
        for host_row, row in plan.state_restores:
            state.conv[:, row].copy_(self.conv[host_row], non_blocking=async_)
            state.delta[:, row].copy_(self.delta[host_row], non_blocking=async_)
