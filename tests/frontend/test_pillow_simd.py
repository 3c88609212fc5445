"""The `PIL` that frontends decode with is Pillow-SIMD (the Makefile installs it over Pillow), with the codecs the
image path accepts (docs/design.md, Frontends and dialects)."""

from __future__ import annotations

import importlib.metadata

import PIL
from PIL import features


def test_pil_is_pillow_simd() -> None:
    owners = importlib.metadata.packages_distributions()["PIL"]
    assert [name.lower() for name in owners] == ["pillow-simd"], f"PIL comes from {owners}; run make install"
    assert PIL.__version__ == importlib.metadata.version("pillow-simd")
    assert ".post" in PIL.__version__  # Pillow-SIMD's versions are Pillow's base version plus a post release


def test_pillow_simd_has_the_codecs_images_need() -> None:
    assert all(features.check(codec) for codec in ("jpg", "zlib", "webp"))
