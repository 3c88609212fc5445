"""What a vision core's frontends and engine agree on about images (docs/design.md, Images): the image processor's
settings, as `ignition export` reads them from the checkpoint's preprocessor config, and the placeholder tokens.
No torch here: frontends prepare patches with numpy."""

from __future__ import annotations

import hashlib

import msgspec


class ImageProcessing(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Qwen2-VL-style processing: smart resize to multiples of patch_size * merge_size within [min, max] pixels,
    bicubic, rescale, normalize, patches of temporal_patch_size frames."""

    image_token_id: int  # <|image_pad|>: the template writes one; the frontend expands it to the image's tokens
    vision_start_token_id: int
    vision_end_token_id: int
    min_pixels: int
    max_pixels: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor × factor pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch row on the wire: RGB × temporal × patch × patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def tokens(self, grid: tuple[int, int, int] | list[int]) -> int:
        """Placeholder tokens of an image with this (t, h, w) patch grid."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    def identity(self, source: bytes) -> bytes:
        """BLAKE2b-256 of the image's source bytes and these settings: the prefix cache keys on it (32 bytes, as
        common/prefix_history.py's events are)."""
        digest = hashlib.blake2b(digest_size=32)
        digest.update(msgspec.msgpack.encode(self))
        digest.update(source)
        return digest.digest()
