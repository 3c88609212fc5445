"""What a Submit must satisfy to run on this engine's model (docs/design.md, The engine loop), checked
before a request is planned: a value no step can hold would fail the whole step, and with it every request batched
beside this one. The engine's own state (draining, a full queue, ids in use) it checks itself (engine/core.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from common import protocol as wire
from common.prefix_history import IDENTITY_BYTES
from common.sampling_bounds import sampling_problem
from common.vision import ImageProcessing

MAX_LABELS = 256  # label token ids one query of a scored prefill reads
POOLINGS = ("", "last", "mean")  # Submit.pooling: not an embedding, or how one pools
SHORT_PROMPT = 128  # ids: below this, min() and max() beat packing for numpy (which costs 40 µs cold, 2 hot)


@dataclass(frozen=True)
class ModelBounds:
    """What a request is checked against: the model's vocabulary, context and images, and the KV cache's pages."""
    vocab_size: int
    context_limit: int
    page_size: int
    num_pages: int
    model: str  # the served name, for messages
    vision: ImageProcessing | None = None  # a vision model's image settings


@dataclass(frozen=True)
class Problem:
    """Why a Submit is refused: its HTTP status, the message, and a hint for the operator (may be empty)."""
    status: int
    message: str
    hint: str = ""


def ids_below(ids: list[int], limit: int) -> bool:
    """Whether every id lies in [0, limit), at C speed: min() and max() over a 16k-token prompt take 0.3-0.9 ms."""
    if len(ids) < SHORT_PROMPT:
        return not ids or min(ids) >= 0 and max(ids) < limit
    try:
        packed = array("I", ids)  # refuses negative ids and ids of over 32 bits
    except OverflowError:
        return False
    return not ids or int(np.frombuffer(packed, dtype=np.uint32).max()) < limit


def image_problem(submit: wire.Submit, vision: ImageProcessing | None, model: str) -> str | None:
    """Why a Submit's images cannot be run (the frontend's checks, repeated where a peer could be wrong)."""
    if vision is None:
        return f"the model '{model}' does not accept images (it is text only)"
    end = 0
    for i, image in enumerate(submit.images):
        if len(image.grid) != 3 or min(image.grid) < 1 or image.grid[1] % vision.merge_size \
                or image.grid[2] % vision.merge_size:
            return f"image {i + 1}: grid {image.grid} is not a (t, h, w) grid of merged patches"
        if len(image.identity) != IDENTITY_BYTES:  # it keys the prefix cache (common/prefix_history.py)
            return f"image {i + 1}: its identity is {len(image.identity)} bytes, not {IDENTITY_BYTES}"
        t, h, w = image.grid
        tokens = vision.tokens(image.grid)
        if len(image.patches) != 4 * t * h * w * vision.patch_dim:
            return f"image {i + 1}: {len(image.patches)} bytes of patches for a {t}x{h}x{w} grid"
        if image.offset < end or submit.prompt[image.offset:image.offset + tokens] != [vision.image_token_id] * tokens:
            return f"image {i + 1}: its {tokens} placeholder tokens are not at prompt position {image.offset}"
        end = image.offset + tokens
    return None


def submit_problem(submit: wire.Submit, bounds: ModelBounds) -> Problem | None:
    """The first reason the request cannot run on this model, or None."""
    vocab = bounds.vocab_size
    if not submit.prompt:
        return Problem(400, "the prompt is empty")
    if not ids_below(submit.prompt, vocab):
        return Problem(400, f"prompt token ids must lie in [0, {vocab})")
    if submit.sampling.max_tokens < 1:
        return Problem(400, f"max_tokens must be at least 1, got {submit.sampling.max_tokens}")
    if (problem := sampling_problem(submit.sampling, vocab)) is not None:
        return Problem(400, problem)
    if len(submit.message_ends) > len(submit.prompt) + 1 or \
            any(not 0 <= end <= len(submit.prompt) for end in submit.message_ends):
        return Problem(400, f"message ends must be at most {len(submit.prompt) + 1} prompt positions in "
                            f"[0, {len(submit.prompt)}]")
    if submit.pooling not in POOLINGS:
        return Problem(400, f"pooling must be one of {', '.join(POOLINGS[1:])}, got {submit.pooling!r}")
    if submit.pooling and (submit.label_queries or submit.constraint is not None):
        return Problem(400, "an embedding reads no labels and generates nothing to constrain")
    # A prefill-only request (scored or embedding) holds its prompt and nothing after it.
    total = len(submit.prompt) + (0 if submit.label_queries or submit.pooling else submit.sampling.max_tokens)
    if total > bounds.context_limit:
        return Problem(400, f"This model's maximum context length is {bounds.context_limit} tokens; the request "
                            f"has {len(submit.prompt)} prompt tokens and asks for {submit.sampling.max_tokens} "
                            f"output tokens ({total} in all)", "context_hint: shorten the prompt or lower max_tokens")
    pages = -(-total // bounds.page_size)
    if pages > bounds.num_pages:
        return Problem(400, f"the request needs {pages} KV pages ({total} tokens) and the cache has "
                            f"{bounds.num_pages}", "capacity_hint: raise --kv-cache-bytes")
    for query in submit.label_queries:
        if not 0 <= query.position < len(submit.prompt) or not 0 < len(query.token_ids) <= MAX_LABELS or \
                min(query.token_ids) < 0 or max(query.token_ids) >= vocab:
            return Problem(400, f"a label query reads 1 to {MAX_LABELS} token ids in [0, {vocab}) at a prompt "
                                f"position in [0, {len(submit.prompt)})")
    if submit.images and (problem := image_problem(submit, bounds.vision, bounds.model)):
        return Problem(400, problem)
    return None
