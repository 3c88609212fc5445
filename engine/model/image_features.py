"""What a vision-language step hands the text decoder (engine/model/qwen3_vl.py): the image tokens' features, and
the type of a vision tower call. Their own module, so that the decoder, the vision-language model and the backends
share them without importing one another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (patches [rows, patch_dim], grids) -> (features [tokens, E], deepstack features): the tower module, the kernel
# path's (engine/model/backends/triton.py) or its captured graphs (engine/executor/vision_graphs.py).
Tower = Callable[[torch.Tensor, list[tuple[int, int, int]]], tuple[torch.Tensor, list[torch.Tensor]]]


@dataclass(frozen=True)
class ImageFeatures:
    """One step's image tokens: which rows hold them, their embeddings, and per deepstack layer what adds to them."""

    rows: torch.Tensor  # [N] step rows
    embeds: torch.Tensor  # [N, E]
    deepstack: tuple[torch.Tensor, ...]  # [N, E] after layer 0, 1, ...

    def splice(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[self.rows] = self.embeds.to(x.dtype)
        return x

    def after_layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer >= len(self.deepstack):
            return x
        x = x.clone()
        x[self.rows] += self.deepstack[layer].to(x.dtype)
        return x
