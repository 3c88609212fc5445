"""An RGB picture to the vision tower's input, in numpy (docs/design.md, Images): Qwen's smart resize, bicubic,
rescale, normalize, and patches of `temporal_patch_size` frames grouped by `merge_size` × `merge_size`.

Step for step what transformers' `Qwen2VLImageProcessorPil` does (the same Pillow resize, the same float64 rescale
then float32 normalize, the same patch order), so the patches are identical to its `pixel_values`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from common.errors import InvalidRequest
from common.vision import ImageProcessing
from frontend.images.decode import ImageLimits, decode

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class PreparedImage:
    identity: bytes  # ImageProcessing.identity of the source bytes
    grid: tuple[int, int, int]  # (t, h, w) in patches
    patches: np.ndarray  # float32, (t*h*w, 3 * temporal * patch * patch)
    tokens: int  # placeholder tokens in the prompt


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of `factor`, about the same aspect ratio, within [min_pixels, max_pixels]
    (transformers' `smart_resize`, which refuses aspect ratios over 200)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalized(image: Image.Image, settings: ImageProcessing) -> np.ndarray:
    """Resized and normalized, float32 (H, W, 3)."""
    height, width = smart_resize(image.height, image.width, settings.factor, settings.min_pixels,
                                 settings.max_pixels)
    pixels = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))
    scaled = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    return (scaled - np.array(settings.image_mean, np.float32)) / np.array(settings.image_std, np.float32)


def patchify(pixels: np.ndarray, settings: ImageProcessing) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(H, W, C) to rows of (C, temporal, patch, patch), merge groups contiguous; a still picture fills every
    temporal frame with itself."""
    height, width, channels = pixels.shape
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, C, p, p)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(grid_h * grid_w, channels * t * p * p)), (1, grid_h, grid_w)


def prepare(source: bytes, settings: ImageProcessing, limits: ImageLimits, where: str) -> PreparedImage:
    """Encoded bytes to the tower's input (CPU work: run it on the frontend's worker pool)."""
    image = decode(source, limits, where)
    try:
        patches, grid = patchify(normalized(image, settings), settings)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}", param="messages") from None
    return PreparedImage(settings.identity(source), grid, patches, settings.tokens(grid))
