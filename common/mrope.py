"""Qwen-VL's multimodal rotary positions (M-RoPE), in numpy (docs/design.md, Images): every prompt token gets a
(t, h, w) position. Text counts up on all three; an image's tokens sit on its merged grid, starting where the text
stood, and the text after it resumes at that start plus the grid's longer side. A token after the prompt at index i
has position i + delta on all three axes, where delta is what the images shifted.

As transformers' `Qwen3VLModel.get_rope_index` computes it for images (one frame each)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(length: int, images: Sequence[tuple[int, Sequence[int]]], merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """`images`: (offset of the first placeholder token, (t, h, w) patch grid) in prompt order.
    Returns (positions int64 of shape (3, length), delta for the tokens after the prompt)."""
    positions = np.empty((3, length), dtype=np.int64)
    cursor = 0  # prompt index
    position = 0  # the text position at the cursor
    for offset, (t, h, w) in images:
        text = offset - cursor
        positions[:, cursor:offset] = np.arange(position, position + text)
        position += text
        rows, cols = h // merge_size, w // merge_size
        frame, row, col = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        span = t * rows * cols
        positions[0, offset:offset + span] = position + frame.reshape(-1)
        positions[1, offset:offset + span] = position + row.reshape(-1)
        positions[2, offset:offset + span] = position + col.reshape(-1)
        position += max(rows, cols)
        cursor = offset + span
    positions[:, cursor:] = np.arange(position, position + length - cursor)
    return positions, position - cursor


def mrope_delta(images: Sequence[tuple[int, Sequence[int]]], merge_size: int) -> int:
    """What `mrope_positions` returns as delta, without the positions: each image moves the text on by its grid's
    longer side instead of its token count."""
    return sum(max(h, w) // merge_size - t * (h // merge_size) * (w // merge_size) for _, (t, h, w) in images)


def mrope_rows(start: int, end: int, images: Sequence[tuple[int, Sequence[int]]], merge_size: int) -> np.ndarray:
    """Positions [3, end - start] of the prompt tokens start..end (images after `end` do not matter)."""
    before = [image for image in images if image[0] < end]
    if not before:
        return np.broadcast_to(np.arange(start, end), (3, end - start))
    offset, (t, h, w) = before[-1]  # a row may end inside an image's span: lay out the whole span
    length = max(end, offset + t * (h // merge_size) * (w // merge_size))
    return mrope_positions(length, before, merge_size)[0][:, start:end]
