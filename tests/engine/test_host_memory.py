"""The host tier's memory is resident from the start (docs/design.md, Host retention): a spill into a slot never used
before pays no page faults, which no restore would pay and which the learned page copy time, that restores are weighed
by against computing their tokens again, would otherwise count."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from engine.executor.tier_copies import HostPages
from tests.support.engine_harness import tiny_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")


def resident_share(tensor: torch.Tensor) -> float:
    """The share of the tensor's memory pages present in memory (mincore(2))."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = -(-length // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    if libc.mincore(start, length, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vector) / pages


def test_an_unpinned_host_tier_is_resident_before_its_first_spill() -> None:
    model = tiny_model()
    host = HostPages(model.config, 8192, 16, torch.float32, pinned=False)  # 64 MiB: fresh pages of its own
    assert host.slots.nbytes >= 64 << 20
    share = resident_share(host.slots)
    assert share > 0.99, f"{share:.2%} of the tier's pages resident"
