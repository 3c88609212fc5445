"""Paged attention: plain torch (the reference path, and the one the CPU runs) and the Triton kernels' dispatch.

The KV cache of one layer is a flat array of token slots, `[num_pages * page_size, kv_heads, head_dim]` for K and
again for V; a request's page table lists its pages in order. Model code never sees this layout: it hands
`AttentionMetadata` (built per step by the eager executor) or `KernelMetadata` (static buffers of a captured
graph) through to the attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """Several new tokens of one request: rows [start, start+length) of the step, ending at `context_len`."""

    start: int
    length: int
    context_len: int
    page_table: torch.Tensor  # [pages] int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    decode_rows: torch.Tensor  # [Bd] int64: step rows that are single-token decodes
    decode_page_tables: torch.Tensor  # [Bd, P] int64, padded with page 0 (masked out by context length)
    decode_context_lens: torch.Tensor  # [Bd] int64
    prefills: tuple[PrefillSpan, ...]
    page_size: int

    @cached_property
    def kernel(self) -> KernelMetadata:
        """The same step as the kernels read it; built once per step, shared by every layer."""
        return kernel_metadata(self)


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with one new token each: token `rows[i]` (token i when rows is None) belongs to sequence i."""

    page_tables: torch.Tensor  # [R, P] pages of each table row
    seq_table: torch.Tensor  # [B] the row of page_tables holding sequence i's pages
    context_lens: torch.Tensor  # [B] 0 for a padding row
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class ExtendBatch:
    """Sequences with any number of new tokens, cut into the kernel's blocks (engine/kernels/extend_attention.py)."""

    page_tables: torch.Tensor
    seq_table: torch.Tensor  # [S]
    query_start: torch.Tensor  # [S] first step row of each sequence
    query_len: torch.Tensor  # [S] 0 for a padding sequence
    context_lens: torch.Tensor  # [S]
    block_seq: torch.Tensor  # [NB] -1 for a padding block
    block_first: torch.Tensor  # [NB]


@dataclass(frozen=True)
class KernelMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token; negative: write nowhere (graph padding)
    page_size: int
    decode: DecodeBatch | None = None
    extend: ExtendBatch | None = None


@lru_cache
def multiprocessors(device: torch.device) -> int:
    # Under the CPU interpreter (tests) any small count will do.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def kernel_metadata(meta: AttentionMetadata) -> KernelMetadata:
    """Decode rows go to the split-KV kernel, prefill spans to the extend kernel; nothing here waits for the
    device (span sizes are host integers)."""
    from engine.kernels.extend_attention import extend_blocks

    device = meta.slot_mapping.device
    decode = extend = None
    count = meta.decode_rows.numel()
    if count:
        decode = DecodeBatch(meta.decode_page_tables, torch.arange(count, device=device), meta.decode_context_lens,
                             meta.decode_rows)
    if meta.prefills:
        width = max(span.page_table.numel() for span in meta.prefills)
        tables = torch.stack([F.pad(span.page_table, (0, width - span.page_table.numel())) for span in meta.prefills])
        lengths = [span.length for span in meta.prefills]
        block_seq, block_first = extend_blocks(lengths)
        ints = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        extend = ExtendBatch(tables, ints(list(range(len(lengths)))), ints([span.start for span in meta.prefills]),
                             ints(lengths), ints([span.context_len for span in meta.prefills]), ints(block_seq),
                             ints(block_first))
    return KernelMetadata(meta.slot_mapping, meta.page_size, decode, extend)


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: KernelMetadata,
                     scale: float, window: int | None = None) -> torch.Tensor:
    """q [T, H, D] of tokens whose K/V are already in the cache -> [T, H, D]; rows of no sequence are undefined.
    With a window, a query sees its own key and the window - 1 before it (sliding-window layers)."""
    from engine.kernels.decode_attention import decode_attention, num_splits
    from engine.kernels.extend_attention import extend_attention

    out = torch.empty_like(q)
    if meta.decode is not None:
        d = meta.decode
        rows = q if d.rows is None else q[d.rows]
        # The split count follows the batch's size only, so a graph and an eager step of one size agree bitwise.
        splits = num_splits(rows.shape[0], k_cache.shape[1], multiprocessors(q.device))
        result = decode_attention(rows, k_cache, v_cache, d.page_tables, d.seq_table, d.context_lens,
                                  meta.page_size, scale, splits, window=window or 0)
        if d.rows is None:
            out = result
        else:
            out[d.rows] = result
    if meta.extend is not None:
        e = meta.extend
        extend_attention(q, k_cache, v_cache, out, e.page_tables, e.seq_table, e.query_start, e.query_len,
                         e.context_lens, e.block_seq, e.block_first, meta.page_size, scale, window=window or 0)
    return out


def gather_pages(cache: torch.Tensor, page_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[slots, H, D] cache and [B, P] tables -> [B, P*page_size, H, D] keys or values, in token order."""
    offsets = torch.arange(page_size, device=page_tables.device)
    slots = (page_tables.unsqueeze(-1) * page_size + offsets).flatten(1)
    return cache[slots]


class PagedAttention(torch.nn.Module):
    """A layer's attention over its cache. With a window W (sliding-window layers), the query at position p sees
    the keys at p - W + 1 .. p, as transformers' sliding-window mask has it; the cache keeps older keys, which the
    mask skips, so prefix reuse works unchanged."""

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the step's new tokens; returns [T, H, D]."""
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, span, meta.page_size)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        keys = gather_pages(k_cache, meta.decode_page_tables, meta.page_size).transpose(1, 2)
        values = gather_pages(v_cache, meta.decode_page_tables, meta.page_size).transpose(1, 2)
        positions = torch.arange(keys.shape[2], device=q.device)
        visible = positions < meta.decode_context_lens.unsqueeze(1)
        if self.window is not None:
            visible &= positions >= meta.decode_context_lens.unsqueeze(1) - self.window
        mask = visible[:, None, None, :]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan,
                 page_size: int) -> torch.Tensor:
        keys = gather_pages(k_cache, span.page_table[None], page_size)[0, : span.context_len]
        values = gather_pages(v_cache, span.page_table[None], page_size)[0, : span.context_len]
        first = span.context_len - span.length
        query_pos = torch.arange(first, span.context_len, device=q.device)
        key_pos = torch.arange(span.context_len, device=q.device)[None, :]
        mask = key_pos <= query_pos[:, None]
        if self.window is not None:
            mask &= key_pos > query_pos[:, None] - self.window
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(0, 1)
