"""Apply a step's page-table changes on the device: (flat index, page) pairs, as many as a device counter says.

The graph executor keeps one page-table row per request slot on the device and uploads only the entries that
changed; this kernel runs first in every captured graph, so the count can differ from step to step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
PROGRAMS = 8


@triton.jit
def _apply_patches(table_ptr, patch_ptr, count_ptr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    count = tl.load(count_ptr)
    for first in range(tl.program_id(0) * BLOCK, count, PROGRAMS * BLOCK):
        i = first + tl.arange(0, BLOCK)
        mask = i < count
        index = tl.load(patch_ptr + 2 * i, mask=mask, other=0)
        page = tl.load(patch_ptr + 2 * i + 1, mask=mask, other=0)
        tl.store(table_ptr + index, page, mask=mask)


def apply_patches(table: torch.Tensor, patches: torch.Tensor, count: torch.Tensor) -> None:
    """table (any shape, contiguous int32); patches [2n] int32 pairs; count [1] int32 on the device."""
    _apply_patches[(PROGRAMS,)](table, patches, count, BLOCK=BLOCK, PROGRAMS=PROGRAMS, num_warps=4)


def apply_patches_reference(table: torch.Tensor, patches: torch.Tensor, count: torch.Tensor) -> None:
    n = int(count[0])
    pairs = patches[: 2 * n].view(n, 2).long()
    table.view(-1)[pairs[:, 0]] = pairs[:, 1].to(table.dtype)
