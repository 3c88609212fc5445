"""Image decoding and preparation (frontend/images/decode.py, frontend/images/prepare.py) against transformers'
`Qwen2VLImageProcessorPil` configured as Qwen3-VL's processor: patches and grids must be identical."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from common.errors import InvalidRequest
from common.vision import ImageProcessing
from frontend.images.decode import ImageLimits, decode
from frontend.images.prepare import prepare, smart_resize
from tests.support.image_samples import encode, oriented, picture, png_header_only, samples

# Qwen3-VL's preprocessor_config.json, and a small one whose max-pixels boundary is cheap to reach.
QWEN3_VL = ImageProcessing(image_token_id=1, vision_start_token_id=2, vision_end_token_id=3,
                           min_pixels=65536, max_pixels=16777216)
SMALL = ImageProcessing(image_token_id=1, vision_start_token_id=2, vision_end_token_id=3,
                        min_pixels=32 * 32, max_pixels=32 * 32 * 24)
LIMITS = ImageLimits()


def reference(data: bytes, settings: ImageProcessing) -> tuple[np.ndarray, list[int]]:
    """transformers: load_image's EXIF transpose, then the processor as the model's config sets it."""
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
        patch_size=settings.patch_size, temporal_patch_size=settings.temporal_patch_size,
        merge_size=settings.merge_size, image_mean=list(settings.image_mean), image_std=list(settings.image_std))
    out = processor(images=[ImageOps.exif_transpose(Image.open(__import__("io").BytesIO(data)))],
                    return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"][0].tolist()


def assert_identical(data: bytes, settings: ImageProcessing) -> None:
    ours = prepare(data, settings, LIMITS, "image 1")
    patches, grid = reference(data, settings)
    assert list(ours.grid) == grid
    assert ours.patches.dtype == np.float32 and ours.patches.shape == patches.shape
    assert np.abs(ours.patches - patches).max() == 0.0
    assert ours.tokens == grid[0] * grid[1] * grid[2] // 4


@pytest.mark.parametrize("name", sorted(samples()))
def test_every_mode_and_format_matches_transformers(name: str) -> None:
    assert_identical(samples()[name][0], QWEN3_VL)


@pytest.mark.parametrize("size", [(1, 1), (20, 3999), (3999, 20), (2, 3), (1023, 17)])
def test_odd_sizes_match_transformers(size: tuple[int, int]) -> None:
    assert_identical(encode(picture(*size), "PNG"), QWEN3_VL)


@pytest.mark.parametrize("size", [(17, 4000), (4000, 17)])
def test_aspect_ratios_over_200_are_refused_as_transformers_refuses_them(size: tuple[int, int]) -> None:
    data = encode(picture(*size), "PNG")
    with pytest.raises(ValueError, match="aspect ratio"):
        reference(data, QWEN3_VL)
    with pytest.raises(InvalidRequest, match="image 1: absolute aspect ratio must be smaller than 200"):
        prepare(data, QWEN3_VL, LIMITS, "image 1")


@pytest.mark.parametrize("size", [(192, 128), (193, 128), (160, 160), (161, 161), (176, 176), (31, 31), (16, 64)])
def test_max_and_min_pixels_boundaries_match_transformers(size: tuple[int, int]) -> None:
    h, w = smart_resize(size[1], size[0], SMALL.factor, SMALL.min_pixels, SMALL.max_pixels)
    assert SMALL.min_pixels <= h * w <= SMALL.max_pixels
    assert_identical(encode(picture(*size), "PNG"), SMALL)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations_give_the_upright_picture(orientation: int) -> None:
    upright = picture(37, 23, seed=orientation)
    decoded = decode(oriented(upright, orientation), LIMITS, "image 1")
    assert decoded.size == upright.size
    assert np.array_equal(np.asarray(decoded), np.asarray(upright))


def test_transparency_goes_onto_white() -> None:
    clear = Image.new("RGBA", (8, 8), (10, 200, 30, 0))
    assert np.all(np.asarray(decode(encode(clear, "PNG"), LIMITS, "image 1")) == 255)


def test_a_bomb_is_refused_from_its_header() -> None:
    with pytest.raises(InvalidRequest, match="20000×20000 pixels, over this server's limit"):
        decode(png_header_only(20000, 20000), LIMITS, "image 2")


def test_identity_depends_on_bytes_and_settings() -> None:
    data = encode(picture(40, 40), "PNG")
    other = encode(picture(40, 40, seed=9), "PNG")
    assert prepare(data, SMALL, LIMITS, "i").identity == prepare(data, SMALL, LIMITS, "i").identity
    assert prepare(data, SMALL, LIMITS, "i").identity != prepare(other, SMALL, LIMITS, "i").identity
    assert SMALL.identity(data) != QWEN3_VL.identity(data)
