"""How many threads torch's CPU kernels use (docs/design.md, Models and kernels)."""

from __future__ import annotations

import os

import torch


def set_threads(requested: int | None = None) -> int:
    """`--threads`, else OMP_NUM_THREADS, else one per core this process may run on (its affinity, which a
    container or `taskset` narrows; torch's own default counts the machine's cores instead)."""
    count = requested or int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
    torch.set_num_threads(count)
    return count
