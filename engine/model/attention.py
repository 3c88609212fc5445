"""Paged attention in plain torch: the reference path, and the one the CPU runs.

The KV cache of one layer is a flat array of token slots, `[num_pages * page_size, kv_heads, head_dim]` for K and
again for V; a request's page table lists its pages in order. Model code never sees this layout: it hands
`AttentionMetadata` through to `PagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def gather_pages(cache: torch.Tensor, page_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[slots, H, D] cache and [B, P] tables -> [B, P*page_size, H, D] keys or values, in token order."""
    offsets = torch.arange(page_size, device=page_tables.device)
    slots = (page_tables.unsqueeze(-1) * page_size + offsets).flatten(1)
    return cache[slots]


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5

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
        mask = (positions < meta.decode_context_lens.unsqueeze(1))[:, None, None, :]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan,
                 page_size: int) -> torch.Tensor:
        keys = gather_pages(k_cache, span.page_table[None], page_size)[0, : span.context_len]
        values = gather_pages(v_cache, span.page_table[None], page_size)[0, : span.context_len]
        first = span.context_len - span.length
        query_pos = torch.arange(first, span.context_len, device=q.device)
        mask = torch.arange(span.context_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(0, 1)
