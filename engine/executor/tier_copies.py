"""HostPages: the host tier's memory, and the spills and restores a plan names (docs/design.md, Host retention).

A slot holds one KV page of every layer, contiguous ([layers, 2, page_size, kv_heads, head_dim]), so that a slot is
one block of bytes to move. On a GPU the slots are pinned and the copies run on the copy stream: behind what the model
stream has queued so far (the step that last used the pages), and ahead of the step's forward, which waits for them.
Spills go first: an evicted page may be handed out by the very step whose forward writes it.
"""

from __future__ import annotations

import torch

from engine.model.config import DecoderConfig


def slot_shape(config: DecoderConfig, page_size: int) -> tuple[int, ...]:
    """A host slot: one page of every layer's K and V (the KV cache's layout, engine/executor/eager.py, one page)."""
    return len(config.kv_layers), 2, page_size, config.num_kv_heads, config.head_dim


def host_slot_bytes(config: DecoderConfig, page_size: int, dtype: torch.dtype) -> int:
    return torch.Size(slot_shape(config, page_size)).numel() * dtype.itemsize


class HostPages:
    def __init__(self, config: DecoderConfig, slots: int, page_size: int, dtype: torch.dtype, pinned: bool) -> None:
        self.page_size = page_size
        self.slots = torch.empty((slots, *slot_shape(config, page_size)), dtype=dtype, pin_memory=pinned)

    def copy(self, kv_cache: torch.Tensor, spills: tuple[tuple[int, int], ...],
             restores: tuple[tuple[int, int], ...], stream: torch.cuda.Stream | None = None) -> None:
        """Spills (device page, host slot), then restores (host slot, device page); on `stream` when given, ordered
        after the current stream's work so far and before its next."""
        if not (spills or restores):
            return
        if stream is None:
            self._copy(kv_cache, spills, restores)
            return
        current = torch.cuda.current_stream(kv_cache.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self._copy(kv_cache, spills, restores)
        current.wait_stream(stream)

    def _copy(self, kv_cache: torch.Tensor, spills: tuple[tuple[int, int], ...],
              restores: tuple[tuple[int, int], ...]) -> None:
        size, async_ = self.page_size, kv_cache.is_cuda
        for page, slot in spills:
            self.slots[slot].copy_(kv_cache[:, :, page * size:(page + 1) * size], non_blocking=async_)
        for slot, page in restores:
            kv_cache[:, :, page * size:(page + 1) * size].copy_(self.slots[slot], non_blocking=async_)
