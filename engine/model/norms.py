"""RMSNorm as Llama-style models (weight times the rounded normalised row) and Gemma (the row times 1 + weight,
rounded once) compute it: the two round differently in bfloat16, and each family's reference is its own."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        # The variance is taken in fp32 whatever the weights' dtype, as the reference implementations do.
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One operator for the steps below, bit for bit the same in fp32 (a decode step runs two a layer).
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * self.normalise(x).to(x.dtype)

    def kernel_weight(self) -> torch.Tensor:
        """The weight the fused add-RMSNorm ops multiply by (engine/kernels/triton/rmsnorm.py, and the C++ ops'
        flare_cpu::add_rms_norm): the residual-stream backends' (engine/model/backends/residual.py)."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """Gemma's checkpoints store w for a scale of (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalise(x) * (1.0 + self.weight.float())).to(x.dtype)

    def fold(self) -> None:
        """Compute the kernel's weight once (a residual-stream backend's weight preparation): 1 + w in float32, so
        that it is not rounded to the activations' dtype; the kernel multiplies in float32."""
        self.plus_one = 1.0 + self.weight.float()

    def kernel_weight(self) -> torch.Tensor:
        return self.plus_one


def rms_norm(gemma: bool, size: int, eps: float) -> RMSNorm:
    return GemmaRMSNorm(size, eps) if gemma else RMSNorm(size, eps)
