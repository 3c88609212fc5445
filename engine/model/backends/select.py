"""The one place that chooses how a model computes (engine/model/backends/), and prepares its weights for it."""

from __future__ import annotations

from typing import Literal

import torch

from engine.kernels.cpu import extension
from engine.model.backends.cpu_ops import CpuOps
from engine.model.decoder import CausalLM, Reference

# reference: the layers' own torch forwards, bit for bit transformers'; fused_reference: the same over q/k/v and
# gate/up fused into one product each; cpu_ops: Flare's C++ ops (cpu_ops.py); triton: the kernel path (triton.py).
Kind = Literal["reference", "fused_reference", "cpu_ops", "triton"]


def backend_kind(device: torch.device, quantized: bool, dtype: torch.dtype, hybrid: bool = False,
                 fp8_kv: bool = False) -> Kind:
    """A GPU runs the kernel path. On the CPU a dense core keeps the torch reference (its parity reference); a
    quantized core fuses its products, which saves operators a layer, and runs Flare's C++ ops in fp32 where they
    build (engine/kernels/cpu/extension.py), the torch reference otherwise. A hybrid model (linear-attention layers:
    engine/model/linear_attention.py) has no C++ ops: on the CPU the torch reference, its quantized products
    fused; nor has an FP8 KV cache (engine/model/kv_quant.py), which the C++ attention does not read."""
    if device.type == "cuda":
        return "triton"
    if hybrid or fp8_kv:
        return "fused_reference" if quantized else "reference"
    if not quantized:
        return "reference"
    return "cpu_ops" if dtype == torch.float32 and extension.layer_ops_ready() else "fused_reference"


def use_backend(model: CausalLM, kind: Kind, max_positions: int = 0) -> None:
    """Prepare `model`'s weights for `kind` and have it forward through it: once per model, after its weights are
    in place (the loader does, or whoever built the model by hand). `max_positions` bounds the kernel path's rope
    tables (the core's context limit)."""
    if kind == "triton":
        from engine.model.backends.triton import Triton  # imported here: the CPU's engine runs without triton

        model.backend = Triton(model, max_positions)
    elif kind == "cpu_ops":
        model.backend = CpuOps.prepare(model)
    else:
        if kind == "fused_reference":
            model.fuse_projections()
        model.backend = Reference()
