"""A vision-language step's extra inputs (docs/design.md, Images): M-RoPE positions for every row, and the features of
the image tokens the step's prompt rows hold, from one vision-tower call over their images."""

from __future__ import annotations

import numpy as np
import torch

from common.mrope import mrope_delta, mrope_rows
from common.protocol import ImageInput
from engine.model.image_features import ImageFeatures, Tower
from engine.model.qwen3_vl import VisionLanguageLM
from engine.scheduler.plan import Plan


def vision_step(model: VisionLanguageLM, plan: Plan, device: torch.device, tower: Tower | None = None
                ) -> tuple[torch.Tensor, ImageFeatures | None]:
    """(positions [3, T], the image rows' features or None); `tower` runs the vision tower (the model's own by
    default)."""
    merge = model.visual.config.merge_size
    positions: list[np.ndarray] = []
    wanted: list[tuple[ImageInput, int, int, int]] = []  # image, its first step row, its token range [lo, hi)
    first = 0
    for row in plan.rows:
        start, end = row.start, row.start + row.length
        spans = [(image.offset, image.grid) for image in row.images]
        if row.tokens is None:  # decode: one text position, shifted by what the images moved
            positions.append(np.full((3, 1), start + mrope_delta(spans, merge)))
        else:
            positions.append(mrope_rows(start, end, spans, merge))
            for image in row.images:
                t, h, w = image.grid
                lo, hi = max(image.offset, start), min(image.offset + t * h * w // merge ** 2, end)
                if lo < hi:
                    wanted.append((image, first + lo - start, lo - image.offset, hi - image.offset))
        first += row.length
    position_tensor = torch.from_numpy(np.concatenate(positions, axis=1).astype(np.int64)).to(device)
    if not wanted:
        return position_tensor, None
    encoded = model.encode_images([image for image, *_ in wanted], tower)
    rows = torch.cat([torch.arange(row, row + hi - lo) for _, row, lo, hi in wanted]).to(device)
    embeds = torch.cat([features[lo:hi] for (features, _), (_, _, lo, hi) in zip(encoded, wanted)])
    layers = len(encoded[0][1])
    deepstack = tuple(torch.cat([stack[layer][lo:hi] for (_, stack), (_, _, lo, hi) in zip(encoded, wanted)])
                      for layer in range(layers))
    return position_tensor, ImageFeatures(rows, embeds, deepstack)
