"""The vision tower replayed from graphs captured at patch capacities (docs/design.md, Images; docs/gpu.md).

The graph of capacity C runs the tower's body (engine/model/qwen3_vl_vision.py: patch embedding, every block with
its attention as one segment_attention launch, the merger and the deepstack mergers) on C rows of static inputs and
writes C / merge² features into static outputs. What depends on the images' grids is computed eagerly, outside the
graph, and copied into those inputs: the position table resampled to each grid (a bilinear interpolation whose shape
is the grid's), the rotary cos/sin of each patch's (row, col), and each row's segment bounds. Rows past the images
are padding, each its own one-row segment, so real rows never see them; their features are sliced off.

A call takes the smallest capacity that holds its patches; images beyond the largest capacity are split into
several replays, image by image (images never attend to each other, so splitting changes only rounding); an image
larger than the largest capacity alone runs the same body eagerly (still Triton attention), since a graph for it
would hold its scratch memory for the process's life. Capacities are powers of two from 1,024 patches (a 512x512 image)
to the patches of a full prefill chunk of image tokens, at most MAX_PATCHES: the graphs share one memory pool (they
never run at once), sized by the largest (the MLP's 4,304-wide activations, the rotary's float32 temporaries):
758 MiB for Qwen3-VL-8B's tower in bf16 at 1,024 ... 16,384 patches on an H200, captured in 5.0 s; `memory_bytes`
reports what the capture took.

Nothing here is CUDA-specific but the capture: on the CPU (tests) a "replay" runs the captured function eagerly.
"""

from __future__ import annotations

import bisect
import time

import torch

from engine.kernels.triton.segment_attention import segment_bounds
from engine.model.backends.triton import KernelTower
from engine.model.qwen3_vl_vision import TowerInputs

MIN_PATCHES = 1024
MAX_PATCHES = 16384


def vision_capacities(step_tokens: int, merge: int) -> list[int]:
    """Patch capacities: powers of two from MIN_PATCHES up to the first that holds `step_tokens` image tokens (each
    merge² patches), at most MAX_PATCHES."""
    top = min(max(step_tokens * merge * merge, MIN_PATCHES), MAX_PATCHES)
    capacities = [MIN_PATCHES]
    while capacities[-1] < top:
        capacities.append(2 * capacities[-1])
    return capacities


def groups(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """Consecutive runs [i, j) of images whose patches fit in `capacity` together (an image too large for it is a
    run of its own)."""
    runs, first, total = [], 0, 0
    for i, length in enumerate(lengths):
        if i > first and total + length > capacity:
            runs.append((first, i))
            first, total = i, 0
        total += length
    return runs + [(first, len(lengths))] if lengths else runs


class VisionGraphs:
    """Callable like the tower: (patches [rows, patch_dim], grids) -> (features, deepstack)."""

    def __init__(self, tower: KernelTower, capacities: list[int], device: torch.device,
                 pool: tuple[int, int] | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """`tower`: the tower on the kernel path, whose body the graphs capture."""
        started = time.monotonic()
        self.tower = tower
        self.capacities = sorted(capacities)
        top = self.capacities[-1]
        c = tower.module.config
        dtype = tower.module.patch_embed.proj.weight.dtype
        head_dim = c.hidden_size // c.num_heads
        tokens = top // c.merge_size ** 2
        self._patches = torch.zeros(top, tower.module.patch_dim, dtype=dtype, device=device)
        self._positions = torch.zeros(top, c.hidden_size, dtype=dtype, device=device)
        self._cos = torch.ones(top, 1, head_dim, device=device)
        self._sin = torch.zeros(top, 1, head_dim, device=device)
        self._bounds = torch.zeros(2 * top, dtype=torch.int32, device=device)  # [2, C] at the front, per capacity
        self._features = torch.zeros(tokens, c.out_hidden_size, dtype=dtype, device=device)
        self._deepstack = torch.zeros(len(c.deepstack_layers), tokens, c.out_hidden_size, dtype=dtype, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0
        if device.type == "cuda":
            self._capture(pool or torch.cuda.graph_pool_handle(), stream or torch.cuda.Stream(device))
        self.graph_count = len(self._graphs)
        self.capture_seconds = time.monotonic() - started

    def _static(self, capacity: int) -> TowerInputs:
        return TowerInputs(self._positions[:capacity], self._cos[:capacity], self._sin[:capacity], (capacity,),
                           self._bounds[:2 * capacity].view(2, capacity))

    @torch.inference_mode()
    def _body(self, capacity: int) -> None:
        """What the graph of `capacity` runs: the tower's body from the static inputs into the static outputs."""
        features, deepstack = self.tower.body(self._patches[:capacity], self._static(capacity))
        tokens = features.shape[0]
        self._features[:tokens] = features
        for layer, stack in enumerate(deepstack):
            self._deepstack[layer, :tokens] = stack

    def _capture(self, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        """Largest first, into `pool`: each capture reuses the scratch memory the larger ones left. The caching
        allocator's free blocks are released around it, so memory_bytes counts the pool, not the warm-up runs."""
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        for capacity in reversed(self.capacities):
            self._bounds[:2 * capacity].copy_(segment_bounds([], capacity).view(-1))  # every row padding
            with torch.cuda.stream(stream):
                self._body(capacity)  # compiles the kernels and sets up cuBLAS for this shape outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._body(capacity)
            self._graphs[capacity] = graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.memory_bytes = torch.cuda.memory_reserved() - reserved

    def __call__(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lengths = [t * h * w for t, h, w in grids]
        results, row = [], 0
        for first, last in groups(lengths, self.capacities[-1]):
            rows = sum(lengths[first:last])
            results.append(self._run(patches[row:row + rows], grids[first:last]))
            row += rows
        if len(results) == 1:
            return results[0]
        return (torch.cat([features for features, _ in results]),
                [torch.cat(layer) for layer in zip(*(stack for _, stack in results))])

    @torch.inference_mode()
    def _run(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rows = patches.shape[0]
        i = bisect.bisect_left(self.capacities, rows)
        if i == len(self.capacities):
            return self.tower(patches, grids)
        capacity = self.capacities[i]
        inputs = self.tower.inputs(grids, capacity)
        self._patches[:rows] = patches
        self._patches[rows:capacity] = 0
        self._positions[:capacity] = inputs.positions
        self._cos[:capacity] = inputs.cos
        self._sin[:capacity] = inputs.sin
        self._bounds[:2 * capacity] = inputs.bounds.view(-1)
        if capacity in self._graphs:
            self._graphs[capacity].replay()
        else:
            self._body(capacity)
        tokens = rows // self.tower.module.config.merge_size ** 2
        return self._features[:tokens].clone(), [layer[:tokens].clone() for layer in self._deepstack]

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
