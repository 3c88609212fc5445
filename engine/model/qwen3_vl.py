"""Qwen3-VL in the engine (docs/design.md, Images): the generic decoder (engine/model/decoder.py) with multimodal rotary
positions, plus the vision tower (engine/model/qwen3_vl_vision.py) whose features replace the image tokens'
embeddings and whose deepstack features add to the first layers' outputs at those tokens.

Qwen3.5 and Qwen3.5-MoE with images are this model over their hybrid decoder (Gated DeltaNet layers beside gated
attention, docs/design.md, Hybrid models): the same tower without deepstack mergers, and the same interleaved M-RoPE,
turning only the rotated part of each attention head (mrope_section spans its frequencies, 11/11/10 of 32).
A hybrid runs the torch reference eagerly on every device, its tower included, so the graphs below are Qwen3-VL's.

On a GPU the model's backend (engine/model/backends/triton.py) runs the text model on the kernel path (Triton
attention, fused norms and projections), and the tower too (its attention one Triton launch over every image), which
the GraphExecutor replays from graphs at patch capacities (engine/executor/vision_graphs.py). A step holding image
tokens runs its text model eagerly (GraphExecutor falls back for it: it carries the tower's features and deepstack
additions at its image rows), its rotary table made of each token's own (t, h, w) angles, one row per token. Every
other step, the decode steps included, is text after the images, where t = h = w: plain rope at the position plus
the images' shift (Row.rope_shift), so it replays the same captured graphs as a text model's.
"""

from __future__ import annotations

import numpy as np
import torch

from common.protocol import ImageInput
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
from engine.model.image_features import Tower
from engine.model.qwen3_vl_vision import VisionConfig, VisionTower
from engine.model.rotary import signed_sine


class VisionLanguageLM(CausalLM):
    def __init__(self, c: DecoderConfig, vision: VisionConfig) -> None:
        super().__init__(c)
        self.visual = VisionTower(vision)

    def set_rope(self, device: torch.device | None = None) -> None:
        super().set_rope(device)
        if hasattr(self, "visual"):  # CausalLM's constructor sets the text rope before the tower exists
            self.visual.set_rope(device)

    def mrope_angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, T] (t, h, w) -> angles [T, D/2]: frequency i turns by h where i % 3 == 1 and by w where
        i % 3 == 2, within 3 × mrope_section of each, by t elsewhere (transformers' interleaved M-RoPE)."""
        freqs = positions.float()[..., None] * self.inv_freqs[0]  # [3, T, D/2]
        mixed = freqs[0].clone()
        for axis in (1, 2):
            turned = slice(axis, 3 * self.config.mrope_section[axis], 3)
            mixed[:, turned] = freqs[axis][:, turned]
        return mixed

    def rotations(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if positions.dim() == 1:  # plain positions (text after the images, shifted): t = h = w
            return super().rotations(positions)
        dtype = self.model.embed_tokens.weight.dtype
        angles = self.mrope_angles(positions)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return [(angles.cos().to(dtype), signed_sine(angles.sin().to(dtype)))] * len(self.config.ropes)

    def rope_inputs(self, positions: torch.Tensor, tables: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Plain positions read the backend's tables (a graph's steps); M-RoPE positions [3, T] a table of one row
        per token, made of its own (t, h, w) angles, token i reading row i."""
        if positions.dim() == 1:
            return super().rope_inputs(positions, tables)
        angles = self.mrope_angles(positions)
        table = torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()
        return [table] * len(self.config.ropes), torch.arange(table.shape[0], device=table.device)

    def encode_images(self, images: list[ImageInput], tower: Tower | None = None
                      ) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """Each image's features [tokens, E] and its deepstack features, from one tower call over all of them:
        `tower` (patches, grids) -> (features, deepstack): by default the model's own as its backend runs it, or
        its captured graphs."""
        device, dtype = self.visual.pos_embed.weight.device, self.visual.pos_embed.weight.dtype
        patches = torch.from_numpy(np.concatenate([np.frombuffer(image.patches, np.float32) for image in images]))
        grids = [tuple(image.grid) for image in images]
        tower = tower or self.backend.tower(self.visual)
        features, deepstack = tower(patches.reshape(-1, self.visual.patch_dim).to(device, dtype), grids)
        sizes = [t * h * w // self.visual.config.merge_size ** 2 for t, h, w in grids]
        per_layer = [layer.split(sizes) for layer in deepstack]
        return [(embeds, tuple(layer[i] for layer in per_layer)) for i, embeds in enumerate(features.split(sizes))]
