"""Paged attention in plain torch (the reference), and the metadata a step hands the attention: `AttentionMetadata`
for the torch ops, `KernelMetadata` for the Triton kernels (engine/model/backends/triton_layers.py runs them).

The KV cache of one layer is a flat array of token slots, `[num_pages * page_size, kv_heads, head_dim]` for K and
again for V; a request's page table lists its pages in order. Model code never sees this layout: it hands
`AttentionMetadata` (built per step by the eager executor) or `KernelMetadata` (static buffers of a captured
graph) through to the attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from engine.model.kv_quant import FP8, dequantize, quantize
from engine.model.recurrent_state import RecurrentBatch, RecurrentRows


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
    recurrent: RecurrentRows | None = None  # a hybrid model's state rows (engine/model/recurrent_state.py)

    @cached_property
    def kernel(self) -> KernelMetadata:
        """The same step as the kernels read it; built once per step, shared by every layer."""
        return kernel_metadata(self)

    @cached_property
    def decode(self) -> SequenceBatch:
        """The decode rows as the torch path reads them; built once per step, shared by every layer."""
        return decode_batch(self)

    @cached_property
    def prefill(self) -> SequenceBatch:
        return prefill_batch(self)

    @cached_property
    def every_row(self) -> DecodeBatch:
        """Every row of the step as a sequence of its own, as the CPU's C++ attention reads a step with prompt
        rows; built once per step, shared by every layer."""
        return row_batch(self)


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with one new token each: token `rows[i]` (token i when rows is None) belongs to sequence i."""

    page_tables: torch.Tensor  # [R, P] pages of each table row
    seq_table: torch.Tensor  # [B] the row of page_tables holding sequence i's pages
    context_lens: torch.Tensor  # [B] 0 for a padding row
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class ExtendBatch:
    """Sequences with any number of new tokens, cut into the kernel's blocks
    (engine/kernels/triton/extend_attention.py)."""

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
    recurrent: RecurrentBatch | None = None  # a hybrid model's state rows, per sequence of decode or extend


def kernel_metadata(meta: AttentionMetadata) -> KernelMetadata:
    """A step of decode rows only goes to the split-KV decode kernel; a step with prefill spans goes whole to the
    extend kernel, its decode rows as one-token sequences, as a captured extend graph runs it (the extend kernel's
    key splits follow the step's live blocks, so leaving the decode rows out would split the spans' keys
    differently from the graph). Nothing here waits for the device (span sizes are host integers)."""
    from engine.kernels.triton.extend_attention import extend_blocks

    device = meta.slot_mapping.device
    count = meta.decode_rows.numel()
    rec = meta.recurrent
    if not meta.prefills:
        decode = DecodeBatch(meta.decode_page_tables, torch.arange(count, device=device), meta.decode_context_lens,
                             meta.decode_rows) if count else None
        recurrent = None if rec is None else \
            RecurrentBatch(rec.state, rec.decode.to(torch.int32), (meta.decode_context_lens - 1).to(torch.int32))
        return KernelMetadata(meta.slot_mapping, meta.page_size, decode, recurrent=recurrent)
    tables = step_page_tables(meta)
    lengths = [span.length for span in meta.prefills]
    block_seq, block_first = extend_blocks(lengths + [1] * count)
    ints = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    decode_ints = lambda values: values.to(torch.int32)  # noqa: E731  (device tensors of the decode rows)
    extend = ExtendBatch(
        tables, ints(list(range(len(lengths) + count))),
        torch.cat([ints([span.start for span in meta.prefills]), decode_ints(meta.decode_rows)]),
        torch.cat([ints(lengths), ints([1] * count)]),
        torch.cat([ints([span.context_len for span in meta.prefills]), decode_ints(meta.decode_context_lens)]),
        ints(block_seq), ints(block_first))
    recurrent = None
    if rec is not None:  # the spans' rows, then the decode rows', as the extend batch orders its sequences
        recurrent = RecurrentBatch(rec.state, torch.cat([ints(list(rec.spans)), decode_ints(rec.decode)]),
                                   extend.context_lens - extend.query_len)
    return KernelMetadata(meta.slot_mapping, meta.page_size, extend=extend, recurrent=recurrent)


def step_page_tables(meta: AttentionMetadata) -> torch.Tensor:
    """[S + Bd, P]: each prefill span's page table, then each decode row's, padded to one width."""
    width = max([span.page_table.numel() for span in meta.prefills] + [meta.decode_page_tables.shape[1]])
    return torch.cat([torch.stack([F.pad(span.page_table, (0, width - span.page_table.numel()))
                                   for span in meta.prefills]),
                      F.pad(meta.decode_page_tables, (0, width - meta.decode_page_tables.shape[1]))])


def row_batch(meta: AttentionMetadata) -> DecodeBatch:
    """A step with prefill spans, row by row in step order: a span's row sees its request's keys up to its own
    position (the span's page table, shared through seq_table), a decode row its context."""
    rows = meta.slot_mapping.numel()
    seq_table = torch.zeros(rows, dtype=torch.int64)
    context_lens = torch.zeros(rows, dtype=torch.int64)
    for i, span in enumerate(meta.prefills):
        seq_table[span.start:span.start + span.length] = i
        context_lens[span.start:span.start + span.length] = torch.arange(span.context_len - span.length + 1,
                                                                         span.context_len + 1)
    seq_table[meta.decode_rows] = torch.arange(len(meta.prefills), len(meta.prefills) + meta.decode_rows.numel())
    context_lens[meta.decode_rows] = meta.decode_context_lens
    return DecodeBatch(step_page_tables(meta), seq_table, context_lens, torch.arange(rows))


def page_slots(page_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, P] page tables -> [B, P*page_size] cache slots, in token order."""
    offsets = torch.arange(page_size, device=page_tables.device)
    return (page_tables.unsqueeze(-1) * page_size + offsets).flatten(1)


@dataclass(frozen=True)
class SequenceBatch:
    """Sequences padded to one shape, so that one SDPA call serves them all: the step rows of each sequence's
    queries, the cache slots of its keys, and which keys each query sees (None: all of them)."""

    rows: torch.Tensor  # [S, L] step row of each query; padding repeats the sequence's last row
    valid: torch.Tensor | None  # [S, L] False for padding; None when there is none
    slots: torch.Tensor  # [S, C] cache slot of each key; past a sequence's context, any slot (masked out)
    mask: torch.Tensor | None  # [S, 1, L, C]
    query_pos: torch.Tensor  # [S, L] position of each query
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with a sliding window (keys after p - window for the query at p), built once per
        step and window, shared by every layer with that window."""
        if window is None:
            return self.mask
        if window not in self._windowed:
            keys = torch.arange(self.slots.shape[1], device=self.slots.device)
            near = (keys[None, None, :] > self.query_pos[:, :, None] - window)[:, None]
            self._windowed[window] = near if self.mask is None else self.mask & near
        return self._windowed[window]


def decode_batch(meta: AttentionMetadata) -> SequenceBatch:
    lens = meta.decode_context_lens
    width = int(lens.max())
    slots = page_slots(meta.decode_page_tables, meta.page_size)[:, :width]
    # One sequence sees its whole gathered context; several need a mask where their lengths differ.
    mask = None
    if int(lens.min()) != width:
        mask = (torch.arange(width, device=lens.device) < lens.unsqueeze(1))[:, None, None, :]
    return SequenceBatch(meta.decode_rows[:, None], None, slots, mask, (lens - 1)[:, None])


def prefill_batch(meta: AttentionMetadata) -> SequenceBatch:
    spans = meta.prefills
    device = meta.slot_mapping.device
    length = max(span.length for span in spans)
    width = max(span.context_len for span in spans)
    pages = max(span.page_table.numel() for span in spans)
    tables = torch.stack([F.pad(span.page_table, (0, pages - span.page_table.numel())) for span in spans])
    slots = page_slots(tables, meta.page_size)[:, :width]
    starts = torch.tensor([span.start for span in spans], device=device)[:, None]
    lengths = torch.tensor([span.length for span in spans], device=device)[:, None]
    contexts = torch.tensor([span.context_len for span in spans], device=device)[:, None]
    index = torch.arange(length, device=device)[None, :]
    valid = index < lengths
    rows = starts + torch.minimum(index, lengths - 1)
    query_pos = contexts - lengths + torch.minimum(index, lengths - 1)  # [S, L]
    mask = torch.arange(width, device=device)[None, None, :] <= query_pos[:, :, None]
    return SequenceBatch(rows, None if bool(valid.all()) else valid, slots, mask[:, None], query_pos)


class PagedAttention(torch.nn.Module):
    """A layer's attention over its cache. With a window W (sliding-window layers), the query at position p sees
    the keys at p - W + 1 .. p, as transformers' sliding-window mask has it; the cache keeps older keys, which the
    mask skips, so prefix reuse works unchanged. An FP8 cache (engine/model/kv_quant.py) gets the new keys and
    values over their heads' `kv_scale` ([2, KVH]: keys', values'; the loader sets the checkpoint's), and the
    gathered pages are read back times it."""

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.window = window
        self.register_buffer("kv_scale", torch.ones(2, num_kv_heads), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata,
                decode: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the step's new tokens; returns [T, H, D]. Decode rows are one batched
        SDPA call, or `decode`'s ([Bd, 1, H, D]: another implementation of them, the C++ ops backend's one call),
        prefill spans another, whatever the number of sequences."""
        if k_cache.dtype == FP8:
            k, v = quantize(k, self.kv_scale[0]), quantize(v, self.kv_scale[1])
        k_cache[meta.slot_mapping] = k
        v_cache[meta.slot_mapping] = v
        parts = []
        if meta.decode_rows.numel():
            parts.append((meta.decode, self._decode(q, k_cache, v_cache, meta.decode) if decode is None else decode()))
        if meta.prefills:
            parts.append((meta.prefill, self._prefill(q, k_cache, v_cache, meta.prefill)))
        # One part whose rows are the step's rows in order (all decodes, or one prefill): nothing to scatter.
        if len(parts) == 1 and len(meta.prefills) <= 1 and parts[0][0].rows.numel() == q.shape[0]:
            return parts[0][1].reshape(q.shape)
        out = torch.empty_like(q)
        for batch, result in parts:
            if batch.valid is None:
                out[batch.rows.flatten()] = result.flatten(0, 1)
            else:
                out[batch.rows[batch.valid]] = result[batch.valid]
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: SequenceBatch) -> torch.Tensor:
        """One query per sequence: the query heads of a KV group become that group's rows, so SDPA needs no
        GQA expansion. Returns [B, 1, H, D]."""
        count, kv_heads = batch.rows.shape[0], self.num_kv_heads
        queries = (q if count == q.shape[0] else q[batch.rows[:, 0]]).view(count, kv_heads, -1, q.shape[-1])
        keys, values = self._gather(k_cache, v_cache, batch.slots, q.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask_for(self.window),
                                             scale=self.scale)
        return out.reshape(count, 1, self.num_heads, q.shape[-1])

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: SequenceBatch) -> torch.Tensor:
        """Returns [S, L, H, D]."""
        keys, values = self._gather(k_cache, v_cache, batch.slots, q.dtype)
        out = F.scaled_dot_product_attention(q[batch.rows].transpose(1, 2), keys, values,
                                             attn_mask=batch.mask_for(self.window), scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2)

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of cache slots [S, C] as [S, KVH, C, D] in the queries' dtype."""
        keys, values = k_cache[slots], v_cache[slots]
        if k_cache.dtype == FP8:
            keys, values = dequantize(keys, self.kv_scale[0], dtype), dequantize(values, self.kv_scale[1], dtype)
        return keys.transpose(1, 2), values.transpose(1, 2)
