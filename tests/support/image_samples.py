"""Test pictures made on the spot (no files shipped): every mode and format the image path must handle, and the
bad inputs it must refuse. Shared by the preparation, API and end-to-end tests."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image

EXIF_ORIENTATION = 0x0112
# The transpose that, applied to an upright picture, gives what a camera stores under each orientation tag.
STORED_AS = {1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
             4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90,
             7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients with noise: resizing it exercises every filter tap."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) * 127 // max(width + height, 1)],
                    axis=-1)
    noise = rng.integers(-40, 40, size=base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def oriented(image: Image.Image, orientation: int, fmt: str = "PNG") -> bytes:
    """`image` stored as a camera would under this EXIF orientation: decoding must give `image` back."""
    stored = image.transpose(STORED_AS[orientation]) if STORED_AS[orientation] is not None else image
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return encode(stored, fmt, exif=exif.tobytes())


def samples() -> dict[str, tuple[bytes, str]]:
    """name -> (encoded bytes, media type): one of each mode and format the path converts."""
    base = picture(83, 61, seed=1)
    rgba = base.convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(83, dtype=np.uint8) * 3, (61, 1))))
    palette = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    gray16 = Image.fromarray((np.asarray(base.convert("L"), np.uint16) * 200).astype(np.uint16))
    return {
        "png-rgb": (encode(base, "PNG"), "image/png"),
        "png-rgba": (encode(rgba, "PNG"), "image/png"),
        "png-la": (encode(rgba.convert("LA"), "PNG"), "image/png"),
        "png-palette-transparent": (encode(palette, "PNG", transparency=3), "image/png"),
        "png-gray": (encode(base.convert("L"), "PNG"), "image/png"),
        "png-gray16": (encode(gray16, "PNG"), "image/png"),
        "jpeg": (encode(base, "JPEG", quality=90), "image/jpeg"),
        "jpeg-cmyk": (encode(base.convert("CMYK"), "JPEG", quality=90), "image/jpeg"),
        "jpeg-exif6": (oriented(base, 6, "JPEG"), "image/jpeg"),
        "webp": (encode(base, "WEBP", quality=90), "image/webp"),
        "webp-rgba": (encode(rgba, "WEBP", lossless=True), "image/webp"),
    }


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width × height RGB pixels and carries one tiny IDAT: a bomb as far as the header
    goes (decoding it would need width * height * 3 bytes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def animated(fmt: str) -> bytes:
    frames = [picture(16, 16, seed=s) for s in range(3)]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


def bad_inputs() -> dict[str, tuple[str, str]]:
    """name -> (image URL, a phrase the 400's message must hold)."""
    good = encode(picture(40, 30), "PNG")
    return {
        "corrupt": (data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "image/png"), "not a PNG, JPEG or WebP"),
        "truncated": (data_url(good[: len(good) // 2], "image/png"), "could not be decoded"),
        "bomb": (data_url(png_header_only(20000, 20000), "image/png"), "20000×20000"),
        "animated-webp": (data_url(animated("WEBP"), "image/webp"), "animated"),
        "animated-gif": (data_url(animated("GIF"), "image/png"), "animated"),
        "unsupported-type": (data_url(encode(picture(8, 8), "BMP"), "image/bmp"), "image/bmp"),
        "not-base64": ("data:image/png;base64,@@@@", "base64"),
        "remote": ("http://127.0.0.1:9/cat.png", "remote image"),
    }
