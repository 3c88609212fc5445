"""Which executor runs the model, and how much device memory its KV cache gets."""

from __future__ import annotations

import logging

import torch

from engine.executor.base import Executor
from engine.executor.eager import EagerExecutor
from engine.model.decoder import CausalLM

log = logging.getLogger("flare.engine")

GPU_RESERVE_FRACTION = 0.08  # of total memory, for graph scratch, cuBLAS workspaces and the allocator's slack
SAMPLER_BYTES_PER_LOGIT = 40  # logits, probabilities, their sort (values and int64 order), noise: per row and id
# Prompt tokens one GPU step may carry, by the GPU's memory: the scheduler's cost model then picks, step by step,
# the chunk (page_size << i up to this) with the most value per learned second (engine/scheduler/policy.py); small
# chunks keep decoders flowing, large ones run the prefill GEMMs near peak.
GPU_STEP_TOKENS = ((60 << 30, 8192), (30 << 30, 4096), (0, 2048))


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
                  context_limit: int, prefill_chunk: int, graphs: bool, snapshots: int = 0) -> Executor:
    """Captured graphs on CUDA unless told otherwise; the eager executor elsewhere. `snapshots`: a hybrid model's
    state rows beyond the slots'."""
    if device.type != "cuda" or not graphs:
        return EagerExecutor(model, num_pages, page_size, max_active, device, snapshots)
    from engine.executor.graph import GraphExecutor

    executor = GraphExecutor(model, num_pages, page_size, max_active, device, context_limit, prefill_chunk,
                             snapshots)
    log.info("captured %d CUDA graphs in %.1fs", executor.graph_count, executor.capture_seconds)
    return executor
