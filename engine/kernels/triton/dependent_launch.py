"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel before it
in the stream finishes; it waits (`gdc_wait`) before it touches memory that kernel may write or read, so what it
does before the wait overlaps that kernel's tail. A decode step at batch 1 is a chain of some 250 short kernels, each
of which would otherwise wait for the one before it to drain before its programs are even placed, then ramp up its
loads. CUDA graphs keep the dependency when they capture such a launch.

A kernel launched this way must wait in every program, before its first access to memory an earlier kernel of the
chain writes or reads: the kernel after it relies on its end to mean the end of the ones before it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Not dependent; dependent, waiting first; dependent, weights read before; the same, and the kernel after a GEMV
# released as soon as the GEMV's programs have all started (their first weight slices in flight) rather than once
# they have all read their weights: its programs then take the multiprocessors the GEMV's last ones leave free.
NONE, WAIT_FIRST, PREFETCH, PREFETCH_EARLY = 0, 1, 2, 3


@functools.cache
def supported(device: torch.device) -> bool:
    """On a GPU of compute capability 9 or later (never under the CPU interpreter, whose tensors are on the CPU)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def wait(DEPENDENT: tl.constexpr):
    """In a dependent launch, wait here until the kernel before has ended and its writes are visible."""
    if DEPENDENT != 0:
        gdc_wait()


@triton.jit
def release(DEPENDENT: tl.constexpr):
    """In a dependent launch, let the next kernel's programs be placed once every program here has come this far."""
    if DEPENDENT != 0:
        gdc_launch_dependents()


def launch_options(dependent: int) -> dict[str, bool]:
    """The launch keyword a dependent kernel takes (none for the others: the interpreter knows no such option)."""
    return {"launch_pdl": True} if dependent != NONE else {}
