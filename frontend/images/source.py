"""Where an image's bytes come from (docs/design.md, Images): a base64 `data:` URL, or a remote http(s) URL when the
operator allowed its domain (`--allowed-media-domains`), fetched with size and time limits. The encoded-size limit
holds before anything is decoded: a data URL's length says its size, a download stops at the limit."""

from __future__ import annotations

import asyncio
import base64
import binascii
from urllib.parse import urlsplit

import aiohttp

from common.errors import InvalidRequest
from frontend.images.decode import MEDIA_TYPES, ImageLimits

CHUNK = 1 << 16


def _refuse(where: str, message: str, hint: str = "") -> InvalidRequest:
    return InvalidRequest(f"{where}: {message}", hint, param="messages")


def _media_type(value: str, where: str) -> None:
    if value.lower() not in MEDIA_TYPES:
        raise _refuse(where, f"media type {value[:60]!r} is not supported (image/png, image/jpeg or image/webp)")


def _within(size: int, limits: ImageLimits, where: str) -> None:
    if size > limits.max_bytes:
        raise _refuse(where, f"the image is over {limits.max_bytes} bytes")


def data_url_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    fields = header[len("data:"):].split(";")
    if not comma or "base64" not in fields[1:]:
        raise _refuse(where, "a data: URL must be base64 (data:image/png;base64,...)")
    _media_type(fields[0], where)
    _within(len(payload) * 3 // 4, limits, where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(where, "the data: URL is not valid base64") from None


def base64_data_url(payload: str, where: str) -> str:
    """A bare base64 image (Ollama's `images`) as a data: URL of the type its first bytes show; its size and the
    rest of its base64 are checked with the URL (data_url_bytes)."""
    try:
        head = base64.b64decode(payload[:16], validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(where, "the image is not valid base64") from None
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return f"data:image/png;base64,{payload}"
    if head.startswith(b"\xff\xd8\xff"):
        return f"data:image/jpeg;base64,{payload}"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return f"data:image/webp;base64,{payload}"
    raise _refuse(where, "the image is not a PNG, JPEG or WebP image")


def domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == domain or host.endswith("." + domain) for domain in allowed)


async def fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    """A remote image from an allowed domain: no redirects (they could leave the allowed domains), the size limit
    on the declared length and on the bytes as they arrive, one timeout for the whole exchange."""
    host = urlsplit(url).hostname or ""
    if not domain_allowed(host, limits.allowed_domains):
        raise _refuse(where, f"remote image URLs are not allowed here ({host[:80] or 'no host'})",
                      "media_hint: send the image as a base64 data: URL, or start the server with "
                      "--allowed-media-domains")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limits.fetch_timeout)) as session:
            async with session.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    raise _refuse(where, f"fetching the image gave HTTP {response.status}")
                _media_type(response.content_type, where)
                _within(response.content_length or 0, limits, where)
                body = bytearray()
                async for chunk in response.content.iter_chunked(CHUNK):
                    body += chunk
                    _within(len(body), limits, where)
                return bytes(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
        raise _refuse(where, f"the image could not be fetched ({reason})") from None
