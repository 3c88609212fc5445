"""SiLU-and-mul over the fused gate/up projection: one kernel instead of three, rounding as torch does. Before an FP8
product of many rows it writes the result quantized per token instead (silu_and_mul_e4m3: the product's activation
quantization, engine/kernels/triton/fp8_linear.py, without a pass of its own)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.e4m3 import to_e4m3
from engine.kernels.triton.fp8_linear import E4m3Rows, row_scale

BLOCK = 1024


@triton.jit
def _silu_mul(x_ptr, c, mask, size):
    """SiLU(gate) * up of columns c of a [gate | up] row, rounded as torch rounds it, in the row's dtype."""
    gate = tl.load(x_ptr + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + size + c, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, size, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < size
    tl.store(out_ptr + row * stride_o + c, _silu_mul(x_ptr + row * stride_x, c, mask, size), mask=mask)


@triton.jit
def _silu_and_mul_e4m3(x_ptr, out_ptr, scale_ptr, size, stride_x, stride_o, BLOCK: tl.constexpr):
    """A program per row: its largest magnitude first, then its values over their scale (computed twice: the row
    is read again from the L2 cache rather than held)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    largest = tl.zeros([BLOCK], tl.float32)
    for start in range(0, size, BLOCK):
        c = start + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.abs(_silu_mul(x_row, c, c < size, size).to(tl.float32)))
    scale = row_scale(tl.max(largest, 0))
    for start in range(0, size, BLOCK):
        c = start + tl.arange(0, BLOCK)
        y = _silu_mul(x_row, c, c < size, size).to(tl.float32)
        tl.store(out_ptr + row * stride_o + c, to_e4m3(y, scale, out_ptr.dtype.element_ty), mask=c < size)
    tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    size = x.shape[-1] // 2
    out = torch.empty(x.shape[0], size, dtype=x.dtype, device=x.device)
    _silu_and_mul[(x.shape[0], triton.cdiv(size, BLOCK))](x, out, size, x.stride(0), out.stride(0), BLOCK=BLOCK,
                                                           num_warps=4)
    return out


def silu_and_mul_e4m3(x: torch.Tensor) -> E4m3Rows:
    """silu_and_mul(x) as an FP8 product reads it: quantize_rows of it, in the same kernel."""
    size = x.shape[-1] // 2
    values = torch.empty(x.shape[0], size, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _silu_and_mul_e4m3[(x.shape[0],)](x, values, scales, size, x.stride(0), values.stride(0), BLOCK=BLOCK,
                                      num_warps=4)
    return E4m3Rows(values, scales, x.dtype)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
