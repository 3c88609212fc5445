"""An FP8 KV cache's pages in the host and disk tiers (docs/design.md, Host retention): a spilled page comes back
byte for byte through a host slot and a disk file, whose header records the cache's dtype; a file of another KV dtype
is not served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cache import disk_files
from engine.executor.eager import kv_cache_shape
from engine.executor.tier_copies import HostPages, host_slot_bytes, slot_shape
from engine.model.kv_quant import FP8
from engine.scheduler.plan import DiskRead, DiskWork, DiskWrite, Plan
from tests.support.engine_harness import tiny_model

PAGE = 16


def test_an_fp8_page_goes_to_the_host_and_disk_and_back_byte_for_byte(tmp_path: Path) -> None:
    model = tiny_model()
    identity = b"i" * 32
    host = HostPages(model.config, 2, PAGE, FP8, pinned=False, disk=(tmp_path, identity))
    assert host.slots.dtype == FP8 and host_slot_bytes(model.config, PAGE, FP8) * 4 == \
        host_slot_bytes(model.config, PAGE, torch.float32)
    values = torch.randn(kv_cache_shape(model, 4, PAGE), generator=torch.Generator().manual_seed(1)) * 50
    cache = values.clamp(-448, 448).to(FP8)
    host.copy(cache, None, Plan((), spills=((2, 0),)))
    key = bytes(range(16))
    host.disk_work(DiskWork(writes=(DiskWrite(0, key, PAGE),)))
    layout = disk_files.Layout(identity, str(FP8), slot_shape(model.config, PAGE))
    assert (tmp_path / disk_files.file_name(key)).stat().st_size > layout.payload_bytes
    assert host.disk_work(DiskWork(reads=(DiskRead(key, 1),))) == ()
    host.copy(cache, None, Plan((), restores=((1, 3),)))
    pages = cache.view(torch.uint8).view(*cache.shape[:2], 4, PAGE, *cache.shape[3:])
    assert torch.equal(pages[:, :, 3], pages[:, :, 2]) and pages[:, :, 2].any()
    assert disk_files.scan(tmp_path, layout) == [(key, disk_files.DiskEntry(PAGE))]
    # The same core's identity with a bfloat16 cache: the file is another KV dtype's, skipped and not served.
    other = disk_files.Layout(identity, str(torch.bfloat16), layout.shape)
    assert disk_files.scan(tmp_path, other) == []
    with pytest.raises(disk_files.UnreadableFile, match="layout torch.float8_e4m3fn"):
        disk_files.read(tmp_path, key, other)

