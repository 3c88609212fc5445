"""The KV cache's element type (`--kv-cache-dtype`, docs/design.md, KV cache dtype): the model's own (auto), or FP8
e4m3 with fp32 scales per (layer, KV head) for keys and for values.

An FP8 cache holds value / scale rounded to nearest e4m3 and clamped to +-448; attention reads value * scale and
computes in fp32. The scales are the checkpoint's where it carries them (`k_scale`, `v_scale` of each attention
layer, per head or one per layer, which ignition writes per head), 1.0 otherwise. These are the torch forms; the
kernels' are engine/kernels/triton/kv_store.py (writing) and the attention kernels (reading).
"""

from __future__ import annotations

import torch

from engine.model.fp8 import E4M3_MAX

FP8 = torch.float8_e4m3fn
KV_NAMES = {FP8: "fp8 e4m3"}  # the cache's dtype as the startup log names it
MIN_CAPABILITY = (8, 9)  # the kernels' e4m3 conversions: Ada, Hopper and later
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # an attention layer's scales in a core, [KVH] each (ignition/fp8.py)


def unsupported(device: torch.device) -> str | None:
    """Why `device` cannot hold an FP8 cache, or None: a GPU needs e4m3 conversions, which Triton has from compute
    capability 8.9 on; the CPU's torch path has them everywhere."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= MIN_CAPABILITY:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., KVH, D] over its heads' scales [KVH] -> e4m3."""
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values [..., KVH, D] times their heads' scales [KVH], in `dtype`."""
    return (values.float() * scale[:, None]).to(dtype)
