"""Recurrent-state row copies on the device (Plan.state_copies: snapshots of slot rows for exact checkpoints, and
restores of snapshots into slot rows), from a fixed-capacity list of (source, destination) row pairs and a device
count, so that a captured graph can run them: past the count, or where its source is negative, a pair is padding
and copies nothing.

The pairs apply in order (a snapshot of a slot may precede a restore into the same slot): each program owns a slice
of every row of every layer and walks the pairs one after another over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _copy_rows(data_ptr, pairs_ptr, count_ptr, stride_layer, stride_row, ROW: tl.constexpr, BLOCK: tl.constexpr):
    layer = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = data_ptr + layer * stride_layer + offsets
    for p in range(tl.load(count_ptr)):
        source = tl.load(pairs_ptr + 2 * p).to(tl.int64)
        destination = tl.load(pairs_ptr + 2 * p + 1).to(tl.int64)
        mask = (offsets < ROW) & (offsets * 0 + source >= 0)
        values = tl.load(base + source * stride_row, mask=mask)
        tl.store(base + destination * stride_row, values, mask=mask)
        tl.debug_barrier()


def copy_state_rows(tensors: tuple[torch.Tensor, ...], pairs: torch.Tensor, count: torch.Tensor) -> None:
    """tensors: [layers, rows, ...] each, contiguous (RecurrentState's conv and delta); pairs [P, 2] int32 on the
    device, (source row, destination row), a negative source for padding; count [1] int32 on the device: the
    pairs that apply."""
    for data in tensors:
        assert data.is_contiguous()
        row = data[0, 0].numel()
        grid = (data.shape[0], triton.cdiv(row, BLOCK))
        _copy_rows[grid](data, pairs, count, data.stride(0), data.stride(1), ROW=row, BLOCK=BLOCK, num_warps=4)


def copy_state_rows_reference(tensors: tuple[torch.Tensor, ...], pairs: torch.Tensor, count: torch.Tensor) -> None:
    for source, destination in pairs[:int(count[0])].tolist():
        if source >= 0:
            for data in tensors:
                data[:, destination] = data[:, source]
