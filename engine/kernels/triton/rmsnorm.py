"""Fused residual add + RMSNorm: one pass over each row instead of the eight kernels the torch expression takes.

The rounding follows the torch reference (engine/model/norms.py): the sum rounds to the activations' dtype, the
variance is taken in float32, the normalised row rounds before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, size, eps, stride_x, stride_r, stride_o, stride_ro,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + c, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x [T, E]; with no residual, (rms_norm(x), x)."""
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    size = x.shape[-1]
    _add_rms_norm[(x.shape[0],)](x, residual if residual is not None else x, weight, out, summed, size, eps,
                                 x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
                                 summed.stride(0), HAS_RESIDUAL=residual is not None,
                                 BLOCK=triton.next_power_of_2(size), num_warps=4 if size <= 2048 else 8)
    return out, summed


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else x + residual
    x32 = summed.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed
