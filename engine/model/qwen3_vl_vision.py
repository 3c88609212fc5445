"""The Qwen3-VL vision tower (docs/design.md, Images), with Hugging Face weight names under `model.visual.`: prepared
patches in, one feature per merged token out, plus the deepstack features that go into the first text layers.
Qwen3.5's tower (Qwen3_5VisionModel) is this one without deepstack layers (an empty `deepstack_layers`).

Patch embedding (the Conv3d whose stride equals its kernel is a matmul over the patch row, which the frontend laid
out as (channel, frame, row, col)); the learned square position table resampled bilinearly (corners aligned) to each
image's grid; 2-D rotary (half of the rotated dims by row, half by column); full bidirectional attention within
each image (Qwen3-VL's config has no windows: a config that asks for window attention is refused); LayerNorm and
tanh-GELU MLP blocks; a patch merger that folds merge × merge neighbours into one token, and one more merger per
deepstack layer (normalising after the fold).

A call is two halves: `inputs` computes what depends on the images' grids (the resampled position table, rotary
cos/sin, each patch's image as a segment of rows), eagerly, optionally padded to a row capacity; `body` is the rest
(patch embedding, blocks, mergers), whose shapes depend only on the row count, so the GPU captures it in graphs at
patch capacities (engine/executor/vision_graphs.py). The body takes how each image's rows attend to one another:
per image through torch's SDPA by default (the reference, bitwise what transformers computes), or, on the kernel
path, as one Triton launch over every image (engine/model/backends/triton.py: KernelTower).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.rotary import rotate_half

LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_layers: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf(cls, vision: dict) -> "VisionConfig":
        if vision.get("fullatt_block_indexes") or vision.get("window_size"):
            raise ValueError("window attention in the vision tower is not supported (Qwen3-VL has none)")
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {vision['hidden_act']} is not supported")
        return cls(depth=int(vision["depth"]), hidden_size=int(vision["hidden_size"]),
                   intermediate_size=int(vision["intermediate_size"]), num_heads=int(vision["num_heads"]),
                   patch_size=int(vision["patch_size"]), temporal_patch_size=int(vision["temporal_patch_size"]),
                   merge_size=int(vision["spatial_merge_size"]), out_hidden_size=int(vision["out_hidden_size"]),
                   num_position_embeddings=int(vision["num_position_embeddings"]),
                   deepstack_layers=tuple(int(i) for i in vision.get("deepstack_visual_indexes") or ()),
                   rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class TowerInputs:
    """What a tower call's rows (patches) need from the images' grids, computed eagerly: rows past the images are
    padding (zero positions, no rotation) that attends only to itself."""

    positions: torch.Tensor  # [rows, hidden] in the tower's dtype: the learned table resampled to each grid
    cos: torch.Tensor  # [rows, 1, head_dim] float32
    sin: torch.Tensor  # [rows, 1, head_dim] float32
    lengths: tuple[int, ...]  # rows per image, then the padding rows as one more segment (SDPA's path)
    bounds: torch.Tensor | None  # int32 [2, rows]: each row's segment (segment_bounds), on the kernel path only


# (q, k, v [rows, heads, head_dim], the call's rows) -> [rows, heads, head_dim]: each image's rows attend to its own.
ImageAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TowerInputs], torch.Tensor]


def image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: TowerInputs) -> torch.Tensor:
    """The reference: one SDPA call per image (and one for the padding rows)."""
    # A batch dimension of one: SDPA's flash and memory-efficient kernels take only 4-D inputs, and its 3-D
    # fallback (the math kernel, in float32) made attention 90% of the tower's time on an H200.
    outputs = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qi, ki, vi)))[0]
               for qi, ki, vi in zip(*(t.split(rows.lengths) for t in (q, k, v)))]
    return torch.cat(outputs, dim=1).transpose(0, 1)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = nn.Conv3d(3, config.hidden_size, kernel_size=(t, p, p), stride=(t, p, p), bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class Mlp(nn.Module):
    def __init__(self, size: int, inner: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(size, inner)
        self.linear_fc2 = nn.Linear(inner, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class Attention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, rows: TowerInputs, attend: ImageAttention = image_attention) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, self.heads, -1).unbind(1)  # (n, heads, head_dim) each
        q = (q * rows.cos + rotate_half(q) * rows.sin).to(x.dtype)
        k = (k * rows.cos + rotate_half(k) * rows.sin).to(x.dtype)
        return self.proj(attend(q, k, v, rows).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = Attention(config)
        self.mlp = Mlp(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, rows: TowerInputs, attend: ImageAttention = image_attention) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rows, attend)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge × merge neighbouring patches (adjacent rows of the frontend's layout) into one text-sized token."""

    def __init__(self, config: VisionConfig, norm_after_fold: bool) -> None:
        super().__init__()
        self.folded = config.hidden_size * config.merge_size ** 2
        self.norm_after_fold = norm_after_fold
        self.norm = nn.LayerNorm(self.folded if norm_after_fold else config.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.folded, self.folded)
        self.linear_fc2 = nn.Linear(self.folded, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.folded)) if self.norm_after_fold else self.norm(x).reshape(-1, self.folded)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def grid_coordinates(grid: tuple[int, int, int], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, col) in the frontend's order: merge blocks row-major, row-major inside a block."""
    t, h, w = grid
    rows = torch.arange(h).reshape(h // merge, 1, merge, 1).expand(h // merge, w // merge, merge, merge)
    cols = torch.arange(w).reshape(1, w // merge, 1, merge).expand(h // merge, w // merge, merge, merge)
    return rows.reshape(-1).repeat(t), cols.reshape(-1).repeat(t)


def bilinear_weights(size: int, side: int) -> torch.Tensor:
    """(size, side): output index i reads the table at i * (side - 1) / (size - 1), linearly between taps."""
    source = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    taps = torch.arange(side, dtype=torch.float32)
    return (1 - (source[:, None] - taps[None, :]).abs()).clamp(min=0)


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.side = int(config.num_position_embeddings ** 0.5)
        self.patch_dim = 3 * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_fold=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, norm_after_fold=True)
                                                   for _ in config.deepstack_layers)
        self.set_rope()

    def set_rope(self, device: torch.device | None = None) -> None:
        """The rotary frequencies (not weights: a model built on the meta device sets them again on its own)."""
        head_dim = self.config.hidden_size // self.config.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", (1.0 / self.config.rope_theta ** quarter).to(device), persistent=False)

    def positions(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned table resampled to this grid, in patch order: (t*h*w, hidden)."""
        t, h, w = grid
        table = self.pos_embed.weight.reshape(self.side, self.side, -1).float()  # bilinear weights are float32
        device = table.device
        resampled = torch.einsum("hi,ijc,wj->hwc", bilinear_weights(h, self.side).to(device), table,
                                 bilinear_weights(w, self.side).to(device))
        rows, cols = grid_coordinates(grid, self.config.merge_size)
        return resampled[rows.to(device), cols.to(device)]

    def rotary(self, grids: list[tuple[int, int, int]], padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (n, 1, head_dim): rows turn the first quarter of the frequencies, columns the second;
        `padding` more rows at (0, 0), which turn nothing."""
        coordinates = [grid_coordinates(grid, self.config.merge_size) for grid in grids]
        zeros = torch.zeros(padding, dtype=torch.int64)
        rows = torch.cat([r for r, _ in coordinates] + [zeros]).to(self.inv_freq.device)
        cols = torch.cat([c for _, c in coordinates] + [zeros]).to(self.inv_freq.device)
        angles = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def inputs(self, grids: list[tuple[int, int, int]], rows: int | None = None) -> TowerInputs:
        """The grids' rows, padded to `rows` (a graph's capacity) when given."""
        lengths = [t * h * w for t, h, w in grids]
        total = sum(lengths)
        padding = (total if rows is None else rows) - total
        if padding < 0:
            raise ValueError(f"{total} patches do not fit in {rows} rows")
        dtype = self.patch_embed.proj.weight.dtype
        positions = torch.cat([self.positions(grid) for grid in grids]).to(dtype)
        positions = F.pad(positions, (0, 0, 0, padding))
        cos, sin = self.rotary(grids, padding)
        return TowerInputs(positions, cos, sin, tuple(lengths) + ((padding,) if padding else ()), None)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """patches (sum of t*h*w, patch_dim) for `grids` in order -> (features (tokens, out_hidden), deepstack
        features: one such tensor per deepstack layer)."""
        return self.body(patches, self.inputs(grids))

    def body(self, patches: torch.Tensor, rows: TowerInputs, attend: ImageAttention = image_attention
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What a graph captures: shapes follow the row count alone. A padded call's features past the images'
        tokens are padding's."""
        x = self.patch_embed(patches) + rows.positions
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, rows, attend)
            if index in self.config.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_layers.index(index)](x))
        return self.merger(x), deepstack
