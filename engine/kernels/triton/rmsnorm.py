"""Fused residual add + RMSNorm: one pass over each row instead of the eight kernels the torch expression takes.

The rounding follows the torch reference (engine/model/norms.py): the sum rounds to the activations' dtype, the
variance is taken in float32, the normalised row rounds before the weight multiplies it. Before an FP8 product of
many rows the kernel writes the row quantized per token instead (add_rms_norm_e4m3: the product's activation
quantization, engine/kernels/triton/fp8_linear.py, without a pass of its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.dependent_launch import NONE, launch_options, release, wait
from engine.kernels.triton.fp8_linear import E4m3Rows, store_e4m3_row


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, size, eps, stride_x, stride_r, stride_o,
                  stride_ro, HAS_RESIDUAL: tl.constexpr, E4M3: tl.constexpr, BLOCK: tl.constexpr,
                  DEPENDENT: tl.constexpr):
    wait(DEPENDENT)  # a program per row, over at once
    release(DEPENDENT)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < size
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + c, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / size + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(x_ptr.dtype.element_ty)
    if E4M3:  # the row as quantize_rows makes it from the rounded one
        store_e4m3_row(y.to(tl.float32), out_ptr + row * stride_o + c, mask, scale_ptr + row)
    else:
        tl.store(out_ptr + row * stride_o + c, y, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, dependent: int = NONE) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x [T, E]; with no residual, (rms_norm(x), x). `dependent`: launched
    as a dependent launch (engine/kernels/triton/dependent_launch.py)."""
    return _launch(x, residual, weight, eps, dependent, torch.empty_like(x), None)


def add_rms_norm_e4m3(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[E4m3Rows, torch.Tensor]:
    """add_rms_norm with the normalised rows as an FP8 product reads them: quantize_rows of them, in the same pass."""
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _, summed = _launch(x, residual, weight, eps, NONE, values, scales)
    return E4m3Rows(values, scales, x.dtype), summed


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, dependent: int,
            out: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.empty_like(x) if residual is not None else x
    size = x.shape[-1]
    _add_rms_norm[(x.shape[0],)](x, residual if residual is not None else x, weight, out, summed,
                                 scales if scales is not None else x, size, eps, x.stride(0),
                                 (residual if residual is not None else x).stride(0), out.stride(0), summed.stride(0),
                                 HAS_RESIDUAL=residual is not None, E4M3=scales is not None,
                                 BLOCK=triton.next_power_of_2(size), DEPENDENT=dependent,
                                 num_warps=4 if size <= 2048 else 8, **launch_options(dependent))
    return out, summed


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else x + residual
    x32 = summed.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed


@triton.jit
def _gated_rms_norm(x_ptr, gate_ptr, w_ptr, out_ptr, eps, stride_g, HEADS: tl.constexpr, SIZE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK)
    mask = (h < HEADS)[:, None] & (c < SIZE)[None, :]
    at = h[:, None] * SIZE + c[None, :]
    x = tl.load(x_ptr + row * HEADS * SIZE + at, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / SIZE + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < SIZE, other=0.0).to(tl.float32)
    scaled = (w[None, :] * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HEADS * SIZE + at, (scaled * gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty),
             mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A linear-attention layer's output norm (engine/model/linear_attention.py, GatedRMSNorm) in one pass: x [T, H, D]
    contiguous, each head normalised, times the weight [D] and SiLU of gate [T, H * D] (rows may be strided: a column
    slice of the fused input product) -> [T, H * D] in x's dtype."""
    tokens, heads, size = x.shape
    assert x.is_contiguous() and gate.stride(1) == 1
    out = torch.empty(tokens, heads * size, dtype=x.dtype, device=x.device)
    _gated_rms_norm[(tokens,)](x, gate, weight, out, eps, gate.stride(0), HEADS=heads, SIZE=size,
                               BLOCK_H=triton.next_power_of_2(heads), BLOCK=triton.next_power_of_2(size),
                               num_warps=4 if heads * size <= 2048 else 8)
    return out
