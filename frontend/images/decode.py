"""Image bytes to an upright RGB picture, with Pillow-SIMD, on a worker thread (docs/design.md, Images).

Limits come before pixels: `Image.open` reads only the header, so the size of a decompression bomb is known (and
refused) before anything is allocated for it. Then, as transformers does before its processors (`load_image`'s
`exif_transpose`, then `convert_to_rgb`): the EXIF orientation (1–8) is applied, transparency is composited onto
white, and palette, grayscale, CMYK and 16-bit pictures become RGB.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps

from common.errors import InvalidRequest

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
MEDIA_TYPES = frozenset(FORMATS.values()) | {"image/jpg"}
EXIF_ORIENTATION = 0x0112
# Pillow's own bomb check refuses at open() without saying the size; ours (ImageLimits.max_pixels, lower) runs
# after the header is read and before anything is decoded, and names the size.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class ImageLimits:
    """What one request may ask of a frontend; `flare-frontend` flags set them."""

    max_images: int = 16  # per request
    max_bytes: int = 16 << 20  # encoded, per image
    max_pixels: int = 32 << 20  # decoded (width × height), per image, read from the header
    allowed_domains: tuple[str, ...] = ()  # hosts remote image URLs may name (and their subdomains); none: no URLs
    fetch_timeout: float = 10.0  # seconds for one remote image, connection to last byte


def open_checked(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    """The picture's header, checked: a supported still format within the pixel limit. Nothing decoded yet."""
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError, EOFError):
        raise InvalidRequest(f"{where}: the bytes are not a PNG, JPEG or WebP image", param="messages") from None
    if getattr(image, "is_animated", False):
        raise InvalidRequest(f"{where}: animated images are not supported (send one frame as PNG, JPEG or WebP)",
                             param="messages")
    if image.format not in FORMATS:
        raise InvalidRequest(f"{where}: image format {image.format} is not supported (PNG, JPEG or WebP)",
                             param="messages")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise InvalidRequest(f"{where}: the image is {width}×{height} pixels, over this server's limit of "
                             f"{limits.max_pixels} pixels", param="messages")
    if width < 1 or height < 1:
        raise InvalidRequest(f"{where}: the image has no pixels", param="messages")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: alpha (or a transparent palette entry) over white, everything else RGB."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def decode(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    """Encoded bytes to an upright RGB picture; every failure is a 400 naming the image."""
    image = open_checked(data, limits, where)
    try:
        image.load()
        if image.getexif().get(EXIF_ORIENTATION, 1) != 1:
            image = ImageOps.exif_transpose(image)
        return to_rgb(image)
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        reason = "truncated" if "truncated" in str(exc) else "corrupt"
        raise InvalidRequest(f"{where}: the image could not be decoded ({reason} data)", param="messages") from None
