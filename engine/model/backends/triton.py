"""The Triton backend: the kernel path, the GPU's, and what the graph executor captures (engine/executor/graph.py);
the CPU runs it only under TRITON_INTERPRET, in tests. Nothing on it waits for the host.

Chosen at load (select.py), it prepares the weights once: q/k/v and gate/up fused into one product each (a hybrid's
linear-attention inputs too: triton_linear.py), Gemma's norm weights folded, and a rope table per distinct rope up to
the context limit. A step then runs the residual
stream over the Triton ops (residual.py with triton_layers.py), or, for a step of a single token where every layer
allows it, the fused GEMVs of few_rows.py. A vision-language model's tower runs as KernelTower: every image's
attention in one Triton launch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.kernels.triton.gemv import MAX_ROWS as GEMV_MAX_ROWS
from engine.kernels.triton.rotary import rope_table
from engine.kernels.triton.segment_attention import segment_attention, segment_bounds
from engine.model.attention import AttentionMetadata, KernelMetadata
from engine.model.backends import few_rows, triton_layers, triton_linear
from engine.model.backends.residual import prepare_weights, residual_stream
from engine.model.decoder import MLP, Attention, CausalLM
from engine.model.image_features import ImageFeatures
from engine.model.linear_attention import GatedDeltaNet
from engine.model.qwen3_vl_vision import TowerInputs, VisionTower


class Triton:
    """Holds the rope tables it made for its model, and how many tokens a step may have to take the GEMVs."""

    def __init__(self, model: CausalLM, max_positions: int) -> None:
        """Prepares `model`'s weights for the kernel path; its positions go up to `max_positions`."""
        prepare_weights(model)
        # A hybrid's cache holds its attention layers only; its linear-attention layers' inputs are one product.
        self.kv_index = {layer: i for i, layer in enumerate(model.config.kv_layers)}
        self.linear_inputs = {i: triton_linear.fuse_inputs(layer.linear_attn)
                              for i, layer in enumerate(model.model.layers) if layer.linear}
        self.rope_tables = [rope_table(inv_freq, max_positions) for inv_freq in model.inv_freqs]
        # Steps of up to this many tokens take few_rows.forward.
        self.few_rows = GEMV_MAX_ROWS if all(few_rows.runs_few_rows(layer) for layer in model.model.layers) else 0

    def forward(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | KernelMetadata, images: ImageFeatures | None) -> torch.Tensor:
        """An eager step's AttentionMetadata is read as its KernelMetadata; a graph's step brings its own."""
        meta = meta.kernel if isinstance(meta, AttentionMetadata) else meta
        if images is None and input_ids.shape[0] <= self.few_rows:
            return few_rows.forward(model, self.rope_tables, input_ids, positions, kv_cache, meta)
        tables, rope_positions = model.rope_inputs(positions, self.rope_tables)
        # A hybrid's gated attention rotates in torch, from cos and sin made once per step.
        rotations = model.rotations(positions) if model.config.attn_output_gate else None

        def attend(mixer: Attention | GatedDeltaNet, h: torch.Tensor, i: int) -> torch.Tensor:
            if isinstance(mixer, GatedDeltaNet):
                return triton_linear.linear_attention(mixer, self.linear_inputs[i], h, meta)
            kv = self.kv_index[i]
            if rotations is not None:
                cos, sin = rotations[mixer.rope]
                return triton_layers.gated_attention(mixer, h, cos, sin, kv_cache[kv, 0], kv_cache[kv, 1], meta)
            return triton_layers.attention(mixer, h, rope_positions, tables[mixer.rope], kv_cache[kv, 0],
                                           kv_cache[kv, 1], meta)

        def mlp(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
            return triton_layers.mlp(layer, h) if isinstance(layer, MLP) else triton_layers.moe(layer, h)

        return residual_stream(model, input_ids, images, triton_layers.norm_for, attend, mlp)

    def tower(self, visual: VisionTower) -> KernelTower:
        return KernelTower(visual)


def segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: TowerInputs) -> torch.Tensor:
    """Every image's attention in one Triton launch (engine/kernels/triton/segment_attention.py)."""
    return segment_attention(q, k, v, rows.bounds)


class KernelTower:
    """The vision tower on the kernel path, callable like the tower, with its two halves (inputs, body) for the
    vision graphs (engine/executor/vision_graphs.py): each row's image as segment bounds, attention over them."""

    def __init__(self, module: VisionTower) -> None:
        self.module = module

    def inputs(self, grids: list[tuple[int, int, int]], rows: int | None = None) -> TowerInputs:
        inputs = self.module.inputs(grids, rows)
        lengths = [t * h * w for t, h, w in grids]
        bounds = segment_bounds(lengths, inputs.positions.shape[0], inputs.positions.device)
        return replace(inputs, bounds=bounds)

    def body(self, patches: torch.Tensor, rows: TowerInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.module.body(patches, rows, segments)

    def __call__(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.body(patches, self.inputs(grids))
