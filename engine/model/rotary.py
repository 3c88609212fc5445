"""Rotary position embedding helpers shared by the text decoder (engine/model/decoder.py), the vision tower
(engine/model/qwen3_vl_vision.py) and the backends that run them (engine/model/backends/)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(D/2, -1) * signed_sine(sin), bit for bit
    (a negation is exact), in two operators where rotate_half takes four."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] with (cos, signed_sine(sin)) of its positions."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
