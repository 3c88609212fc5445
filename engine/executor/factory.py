"""Which executor runs the model, and how much device memory its KV cache gets."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine.executor.base import Executor
from engine.executor.eager import EagerExecutor
from engine.executor.tier_copies import HostPages
from engine.model.decoder import CausalLM

log = logging.getLogger("flare.engine")

GPU_RESERVE_FRACTION = 0.08  # of total memory, for graph scratch, cuBLAS workspaces and the allocator's slack
SAMPLER_BYTES_PER_LOGIT = 40  # logits, probabilities, their sort (values and int64 order), noise: per row and id
# Prompt tokens one GPU step may carry, by the GPU's memory: the scheduler's cost model then picks, step by step,
# the chunk (page_size << i up to this) with the most value per learned second (engine/scheduler/policy.py); small
# chunks keep decoders flowing, large ones run the prefill GEMMs near peak.
GPU_STEP_TOKENS = ((60 << 30, 8192), (30 << 30, 4096), (0, 2048))
HOST_SHARE = 4  # the host tier takes 1/HOST_SHARE of the host memory available at start, by default
HOST_LIMIT = 0.9  # and at most this share of it when given


def gpu_kv_budget(model: CausalLM, max_active: int, device: torch.device,
                  memory_fraction: float | None = None) -> int:
    """What may still be filled of the GPU (`memory_fraction` of it, by default all but a reserve for graph
    scratch and workspaces) after the weights, less what sampling will take."""
    free, total = torch.cuda.mem_get_info(device)
    limit = (memory_fraction or 1 - GPU_RESERVE_FRACTION) * total
    sampler = max_active * model.config.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return max(int(limit - (total - free) - sampler), 0)


def gpu_step_tokens(device: torch.device, core_chunk: int) -> int:
    """The default token budget of one step on this GPU, never below the core's own prefill chunk."""
    total = torch.cuda.get_device_properties(device).total_memory
    return max(core_chunk, next(tokens for memory, tokens in GPU_STEP_TOKENS if total >= memory))


def make_executor(model: CausalLM, num_pages: int, page_size: int, max_active: int, device: torch.device,
                  context_limit: int, prefill_chunk: int, graphs: bool, snapshots: int = 0,
                  host_slots: int = 0, disk: tuple[Path, bytes] | None = None, host_snapshots: int = 0) -> Executor:
    """Captured graphs on CUDA unless told otherwise; the eager executor elsewhere. `snapshots`: a hybrid model's
    state rows beyond the slots'; `host_slots`: the host tier's pages (engine/executor/tier_copies.py), pinned on a
    GPU, and `host_snapshots` its snapshot rows (a hybrid model's); `disk`: the disk tier's directory and the core's
    cache identity."""
    executor = _make_executor(model, num_pages, page_size, max_active, device, context_limit, prefill_chunk, graphs,
                              snapshots)
    if host_slots:
        executor.host_pages = HostPages(model.config, host_slots, page_size, model.cache_dtype,
                                        pinned=device.type == "cuda", disk=disk, snapshots=host_snapshots,
                                        state_dtype=model.model.embed_tokens.weight.dtype)
    return executor


def host_budget(device: torch.device) -> int:
    """The host tier's default bytes: none on the CPU, whose KV cache is host memory already; on a GPU machine a
    share of the memory available now."""
    if device.type != "cuda":
        return 0
    return available_memory() // HOST_SHARE


def available_memory() -> int:
    """The host memory that can be had now without swapping: the kernel's estimate (free memory plus the page
    cache and the slabs it can reclaim), else the free pages alone."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _make_executor(model: CausalLM, num_pages: int, page_size: int, max_active: int, device: torch.device,
                   context_limit: int, prefill_chunk: int, graphs: bool, snapshots: int) -> Executor:
    if device.type != "cuda" or not graphs:
        return EagerExecutor(model, num_pages, page_size, max_active, device, snapshots)
    from engine.executor.graph import GraphExecutor

    executor = GraphExecutor(model, num_pages, page_size, max_active, device, context_limit, prefill_chunk,
                             snapshots)
    log.info("captured %d CUDA graphs in %.1fs", executor.graph_count, executor.capture_seconds)
    return executor
