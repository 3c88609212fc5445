"""Quantized weights in a core: groups of 32 with a scale and a minimum, 4- or 8-bit codes (docs/design.md, Cores).

The layout the engine reads is described in engine/model/quant.py. GGUF's Q4_0, Q4_1 and Q8_0 blocks are read
from the file's bytes and kept exactly (`gguf_blocks`); any other weight is quantized here by rounding to the
nearest of 2**bits levels between each group's minimum and maximum (`quantize`). A 4-bit weight is exactly an
8-bit one with the same scales, so `--quant q8` keeps Q4 blocks exact too; `--quant q4` rounds 8-bit ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32


@dataclass(frozen=True)
class Blocks:
    """w[n, k] = scale[n, k // 32] * codes[n, k] + minimum[n, k // 32]."""

    codes: torch.Tensor  # uint8 [N, K], each below 2**bits
    scale: torch.Tensor  # [N, K / 32], float16 where that holds it exactly, else float32
    minimum: torch.Tensor  # [N, K / 32]
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.float().repeat_interleave(GROUP, dim=1)
        return self.codes.float() * scale + self.minimum.float().repeat_interleave(GROUP, dim=1)

    def with_bits(self, bits: int) -> Blocks:
        if bits == self.bits or (bits == 8 and self.bits == 4):
            return Blocks(self.codes, self.scale, self.minimum, bits)
        return quantize(self.dequantize(), bits)

    def core_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The entries of a core's safetensors for weight `name`."""
        codes = self.codes
        if self.bits == 4:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble first
        return {f"{name}.q{self.bits}": codes.contiguous(), f"{name}.scale": self.scale.contiguous(),
                f"{name}.min": self.minimum.contiguous()}


def quantizable(tensor: torch.Tensor) -> bool:
    """Matrices (linear and embedding weights) whose rows split into groups; norms and biases stay dense."""
    return tensor.dim() == 2 and tensor.shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, bits: int) -> Blocks:
    """Round each group of 32 to the nearest of 2**bits evenly spaced levels from its minimum to its maximum."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / (2**bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - low[..., None]) / safe[..., None]).round().clamp(0, 2**bits - 1)
    return Blocks(codes.reshape(rows, cols).to(torch.uint8), scale, low, bits)


def gguf_blocks(data: np.ndarray, kind: str, shape: tuple[int, int]) -> Blocks | None:
    """The blocks of a GGUF tensor of type `kind` (rows of raw bytes), or None for a type not kept as is."""
    rows, cols = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, cols // GROUP, -1)
    if kind in ("Q4_0", "Q4_1"):
        header = 2 if kind == "Q4_0" else 4
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        packed = raw[..., header:header + 16]
        # A block's 16 bytes hold weights 0-15 in their low nibbles and 16-31 in their high ones.
        codes = np.concatenate([packed & 15, packed >> 4], axis=-1)
        minimum = -8 * d.astype(np.float32) if kind == "Q4_0" else raw[..., 2:4].copy().view(np.float16)[..., 0]
        # -8 d is exact in float16 unless it overflows; keep float32 then.
        if kind == "Q4_0" and np.isfinite(minimum.astype(np.float16)).all():
            minimum = minimum.astype(np.float16)
        return Blocks(torch.from_numpy(codes.reshape(rows, cols)), torch.from_numpy(d),
                      torch.from_numpy(np.ascontiguousarray(minimum)), 4)
    if kind == "Q8_0":
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        codes = (raw[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(torch.from_numpy(codes.reshape(rows, cols)), torch.from_numpy(d),
                      torch.from_numpy(-128 * d.astype(np.float32)), 8)
    return None


def unpermute_rows(blocks: Blocks, unpermute) -> Blocks:
    """Apply a row permutation (llama.cpp's q/k interleave undone) to codes, scales and minima alike."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute(t.numpy())))
    return Blocks(rows(blocks.codes), rows(blocks.scale), rows(blocks.minimum), blocks.bits)
