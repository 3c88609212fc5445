"""Images in a chat, from the dialects' parts to the wire (docs/design.md, Images).

Each dialect turns its image parts into the neutral part `{"type": "image", "url": ...}` inside a message's content
list, where the chat template finds it (Qwen's templates write `<|vision_start|><|image_pad|><|vision_end|>` for
it). Here: the request's images are checked against the model and the limits, fetched (remote, on the event loop:
it is I/O) and decoded and prepared on the worker pool; after tokenization each `<|image_pad|>` becomes as many
tokens as its image has, and the wire carries the patches, the grid, the identity and that position.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from common.errors import InvalidRequest
from common.protocol import ImageInput
from common.vision import ImageProcessing
from frontend.images.decode import ImageLimits
from frontend.images.prepare import PreparedImage, prepare
from frontend.images.source import data_url_bytes, fetch
from frontend.model import EncodedChat
from frontend.server import Frontend


def image_part(url: object) -> dict:
    return {"type": "image", "url": url}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def content_of(parts: list[dict]) -> str | list[dict]:
    """Text alone stays a string (every template reads that); with an image the parts stay in order."""
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def image_urls(messages: list[dict]) -> Iterator[object]:
    for message in messages:
        if isinstance(message.get("content"), list):
            yield from (part["url"] for part in message["content"] if part["type"] == "image")


def _source_and_prepare(url: str, settings: ImageProcessing, limits: ImageLimits, where: str) -> PreparedImage:
    return prepare(data_url_bytes(url, limits, where), settings, limits, where)


async def _one(frontend: Frontend, url: object, settings: ImageProcessing, where: str) -> PreparedImage:
    limits = frontend.image_limits
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        raise InvalidRequest(f"{where}: the image URL must be a base64 data: URL or an http(s) URL",
                             param="messages")
    if url.startswith("data:"):  # base64 of megabytes is CPU work too
        return await frontend.on_pool(_source_and_prepare, url, settings, limits, where)
    return await frontend.on_pool(prepare, await fetch(url, limits, where), settings, limits, where)


async def prepare_images(frontend: Frontend, messages: list[dict]) -> list[PreparedImage]:
    """The request's images, prepared in order; a text-only model refuses them, naming itself."""
    urls = list(image_urls(messages))
    if not urls:
        return []
    settings = frontend.model.manifest.vision
    if settings is None:
        raise InvalidRequest(f"the model '{frontend.model.name}' does not accept images (it is text only)",
                             param="messages")
    if len(urls) > frontend.image_limits.max_images:
        raise InvalidRequest(f"{len(urls)} images in one request; this server takes at most "
                             f"{frontend.image_limits.max_images}", param="messages")
    tasks = [asyncio.ensure_future(_one(frontend, url, settings, f"image {i + 1}")) for i, url in enumerate(urls)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def expand(ids: list[int], ends: list[int], images: list[PreparedImage], settings: ImageProcessing
           ) -> tuple[list[int], list[int], list[int]]:
    """Each image's one placeholder becomes its `tokens` placeholders: (ids, message ends, each image's first
    token position)."""
    places = [i for i, token in enumerate(ids) if token == settings.image_token_id]
    if len(places) != len(images):
        raise InvalidRequest(f"the chat template placed {len(places)} image placeholders for {len(images)} images",
                             param="messages")
    out: list[int] = []
    offsets: list[int] = []
    start = 0
    for place, image in zip(places, images):
        out += ids[start:place]
        offsets.append(len(out))
        out += [settings.image_token_id] * image.tokens
        start = place + 1
    out += ids[start:]
    shifted = [end + sum(image.tokens - 1 for place, image in zip(places, images) if place < end) for end in ends]
    return out, shifted, offsets


def wire_images(images: list[PreparedImage], offsets: list[int]) -> list[ImageInput]:
    return [ImageInput(image.identity, offset, list(image.grid), image.patches.tobytes())
            for image, offset in zip(images, offsets)]


async def encode_chat(frontend: Frontend, messages: list[dict], tools: list[dict] | None,
                      add_generation_prompt: bool, extra: dict, continue_final: bool = False) -> EncodedChat:
    """ServedModel.encode_chat with the conversation's images: placeholders expanded, images for the wire."""
    images = await prepare_images(frontend, messages)

    def encode() -> EncodedChat:
        encoded = frontend.model.encode_chat(messages, tools, add_generation_prompt, extra, continue_final)
        if not images:
            return encoded
        ids, ends, offsets = expand(encoded.ids, encoded.message_ends, images, frontend.model.manifest.vision)
        return encoded._replace(ids=ids, message_ends=ends, images=wire_images(images, offsets))
    return await frontend.on_pool(encode)
