"""Step input frames: a plan packed into int32 words laid out for one captured graph (docs/design.md, Executors and CUDA graphs).

A frame is what the host uploads per step, in one copy: a header, per-sequence fields, per-token fields, the
attention blocks of an extend step, a hybrid model's recurrent-state row copies (Plan.state_copies as (source,
destination) pairs after their count: engine/kernels/triton/state_copy.py), and last the page-table entries that
changed since the previous frame. A hybrid's state row per sequence is its slot's, so the sequence fields serve it. The
per-sequence fields come first and their offsets depend only on the sequence capacity, so the sampling graph of a
capacity reads the fields whichever model graph wrote the logits. Padding rows point at the padding slot
(`trash`) and write nowhere: context length 0, cache slot -1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, itemgetter, ne

import numpy as np
import torch

from engine.kernels.triton.extend_attention import extend_blocks, max_blocks
from engine.scheduler.plan import (GENERATION, LENGTH, OUTPUT_INDEX, PAGE_TABLE, ROPE_SHIFT, SAMPLE, SAMPLING, SEED,
                                   SLOT, START, TOKENS, DecodeRows, Plan, Row, fields)

HEADER = 16  # words; word 0 is the number of page-table patches
ALIGN = 16  # words: 64-byte sections keep every view aligned for the kernels and for int64 fields
SEQ_FIELDS = (("slot", np.int32), ("query_start", np.int32), ("query_len", np.int32), ("context_len", np.int32),
              ("sample_row", np.int32), ("sample_slot", np.int32), ("output_index", np.int32), ("top_k", np.int32),
              ("temperature", np.float32), ("top_p", np.float32), ("min_p", np.float32), ("seed", np.int64))
TOKEN_FIELDS = (("token", np.int32), ("token_slot", np.int32), ("position", np.int32), ("slot_mapping", np.int32))
BLOCK_FIELDS = (("block_seq", np.int32), ("block_first", np.int32))
COPY_FIELDS = (("state_copy", np.int32),)  # the count of copies, then 2 words a copy
TORCH_TYPES = {np.int32: torch.int32, np.float32: torch.float32, np.int64: torch.int64}
TEMPERATURE = attrgetter("temperature")  # for passes over a step's sampling parameters at C speed
SEEN_KEY = itemgetter(*(Row._fields.index(name) for name in ("generation", "page_table", "sampling", "seed")))
SEEN_FIELDS = (GENERATION, PAGE_TABLE, SAMPLING, SEED)  # SEEN_KEY's, as DecodeRows's columns
# Per-sequence fields that depend only on the row's request (its sampling settings and seed), with their padding:
# PageTableMirror keeps them per slot, so a step gathers them by slot instead of reading every row's. A new such field
# is one more entry here (its dtype comes from SEQ_FIELDS).
REQUEST_FIELDS: tuple[tuple[str, Callable[[Row], float | int], float], ...] = (
    ("temperature", lambda row: row.sampling.temperature, 0.0), ("top_p", lambda row: row.sampling.top_p, 1.0),
    ("top_k", lambda row: row.sampling.top_k, 0), ("min_p", lambda row: row.sampling.min_p, 0.0),
    ("seed", SEED, 0))


@dataclass(frozen=True)
class Layout:
    kind: str  # "decode" (one token per sequence, token i is sequence i) or "extend" (any rows)
    tokens: int
    seqs: int
    blocks: int
    fields: tuple[tuple[str, int, int, type], ...]  # (name, first word, count, dtype)
    patches: int  # first word of the page-table patches: the frame's fixed part ends here
    state_copies: int = 0  # recurrent-state row copies the frame holds (a hybrid model's)


def make_layout(kind: str, tokens: int, seqs: int, state_copies: int = 0) -> Layout:
    blocks = max_blocks(tokens, seqs) if kind == "extend" else 0
    fields, word = [], HEADER
    copy_words = 1 + 2 * state_copies if state_copies else 0
    groups = ((SEQ_FIELDS, seqs), (TOKEN_FIELDS, tokens), (BLOCK_FIELDS, blocks), (COPY_FIELDS, copy_words))
    for group, count in groups:
        for name, dtype in group:
            fields.append((name, word, count, dtype))
            word += -(-count * np.dtype(dtype).itemsize // 4 // ALIGN) * ALIGN
    return Layout(kind, tokens, seqs, blocks, tuple(fields), word, state_copies)


def host_views(frame: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    return {name: frame[first:first + count * np.dtype(dtype).itemsize // 4].view(dtype)
            for name, first, count, dtype in layout.fields}


def device_views(frame: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    return {name: frame[first:first + count * np.dtype(dtype).itemsize // 4].view(TORCH_TYPES[dtype])
            for name, first, count, dtype in layout.fields}


class PageTableMirror:
    """What the device's per-slot page tables hold once every frame packed so far has been applied; and each slot's
    REQUEST_FIELDS as its last row had them, which pack gathers by slot."""

    def __init__(self, slots: int, width: int) -> None:
        self.width = width
        # Per slot, the (generation, page table, SamplingParams, seed) of the last row seen: what the device's table
        # row and the kept fields hold. None: nothing known.
        self._seen: list[tuple | None] = [None] * slots
        self.fields = {name: np.zeros(slots, dict(SEQ_FIELDS)[name]) for name, _, _ in REQUEST_FIELDS}
        # The slots' tables as the last rows seen have them (the first `lengths` pages of each row are the row's):
        # a decode frame's cache slots are one gather from here.
        self.tables = np.zeros((slots, width), np.int64)
        self.lengths = np.zeros(slots, np.int64)

    def changes(self, rows: Sequence[Row], slots: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(flat indices, pages) to write, the rows' fields kept; `slots`: the rows' (a pass saved when the caller
        has them). A request's table only grows, so usually only its new pages are written. A row whose known pages
        changed (another generation, or a page replaced) is rewritten whole.

        A row whose generation, table, SamplingParams and seed equal those last seen for its slot changes nothing
        (the scheduler shares a decode row's table, and always its SamplingParams, from step to step, so the
        comparison is mostly of identical objects): at large batch only the few rows that gained a page, or are new
        to their slot, are looked at one by one, the others in two passes at C speed."""
        slots = list(fields(rows, SLOT)) if slots is None else slots
        keys = list(zip(*(fields(rows, key) for key in SEEN_FIELDS)) if type(rows) is DecodeRows else
                    map(SEEN_KEY, rows))
        index: list[int] = []
        pages: list[int] = []
        for i in compress(range(len(rows)), map(ne, keys, map(self._seen.__getitem__, slots))):
            row = rows[i]
            slot, table, seen = row.slot, row.page_table, self._seen[row.slot]
            if len(table) > self.width:
                raise ValueError(f"a page table of {len(table)} pages exceeds the context's {self.width}")
            known = seen[1] if seen is not None and seen[0] == row.generation else ()
            keep = len(known) if known and len(table) >= len(known) and table[len(known) - 1] == known[-1] else 0
            if len(table) > keep:
                base = slot * self.width
                index.extend(range(base + keep, base + len(table)))
                pages.extend(table[keep:])
                self.tables[slot, keep:len(table)] = table[keep:]
            self.lengths[slot] = len(table)
            for name, read, _ in REQUEST_FIELDS:
                self.fields[name][slot] = read(row)
            self._seen[slot] = keys[i]
        return index, pages

    def forget(self, slots: list[int]) -> None:
        """After a failed step nothing is known: the next use of these slots rewrites their rows."""
        for slot in slots:
            self._seen[slot] = None


def _fill(view: np.ndarray, values: Sequence | np.ndarray, pad: float) -> None:
    view[:len(values)] = values
    view[len(values):] = pad


def pack(plan: Plan, layout: Layout, frame: np.ndarray, views: dict[str, np.ndarray], mirror: PageTableMirror,
         page_size: int, trash: int) -> int:
    """Write the plan into `frame` (whose field views are `views`); return the number of words to upload.

    Each field is one pass over the rows at C speed (map over a field getter) and numpy arithmetic: at 256 rows a
    Python loop over the rows per field was the larger part of the host's step."""
    rows = plan.rows
    count = len(rows)
    slot_list = list(fields(rows, SLOT))
    patch_index, patch_pages = mirror.changes(rows, slot_list)
    slots = np.fromiter(slot_list, np.int64, count)
    starts = _column(rows, START, np.int64)
    lengths = _column(rows, LENGTH, np.int64)
    firsts = np.cumsum(lengths) - lengths  # each row's first token in the step
    sample = _column(rows, SAMPLE, bool)
    _fill(views["slot"], slots, trash)
    _fill(views["query_start"], firsts, 0)
    _fill(views["query_len"], lengths, 0)
    _fill(views["context_len"], starts + lengths, 0)
    _fill(views["sample_row"], firsts + lengths - 1, 0)
    _fill(views["sample_slot"], np.where(sample, slots, trash), trash)
    _fill(views["output_index"], _column(rows, OUTPUT_INDEX, np.int64), 0)
    for name, _, pad in REQUEST_FIELDS:
        _fill(views[name], mirror.fields[name][slots], pad)
    if layout.kind == "decode":  # a row's input is the slot's last sampled token, unless the host gives it
        if plan.kind == "decode":  # every row's input is on the device (a verify step's rows carry theirs)
            _fill(views["token"], np.full(count, -1), 0)
        else:
            _fill(views["token"], [tokens[0] if tokens else -1 for tokens in map(TOKENS, rows)], 0)
        _fill(views["token_slot"], slots, trash)
        _fill(views["position"], starts + _column(rows, ROPE_SHIFT, np.int64), 0)
        index = starts // page_size  # (PageTableMirror.changes has brought the mirror's tables to the rows')
        if (index >= mirror.lengths[slots]).any():
            raise ValueError("a decode row's position lies past its page table")
        _fill(views["slot_mapping"], mirror.tables[slots, index] * page_size + starts % page_size, -1)
    else:
        _pack_tokens(rows, views, page_size, trash)
        block_seq, block_first = extend_blocks(lengths.tolist())
        _fill(views["block_seq"], block_seq, -1)
        _fill(views["block_first"], block_first, 0)
    if layout.state_copies:
        _fill(views["state_copy"], [len(plan.state_copies), *(row for pair in plan.state_copies for row in pair)],
              -1)
    frame[0] = len(patch_index)
    patches = frame[layout.patches:layout.patches + 2 * len(patch_index)]
    patches[0::2] = patch_index
    patches[1::2] = patch_pages
    return layout.patches + 2 * len(patch_index)


def _column(rows: Sequence[Row], getter: Callable[[Row], object], dtype: type) -> np.ndarray:
    """A field of every row as an array (a DecodeRows's start and output_index are arrays already)."""
    column = fields(rows, getter)
    return column if isinstance(column, np.ndarray) else np.fromiter(column, dtype, len(rows))


def _pack_tokens(rows: tuple[Row, ...], views: dict[str, np.ndarray], page_size: int, trash: int) -> None:
    first = 0
    for row in rows:
        end = first + row.length
        if row.tokens is None:  # a decode row: its input is the slot's last sampled token, on the device
            views["token"][first] = -1
            views["token_slot"][first] = row.slot
        else:
            views["token"][first:end] = row.tokens
            views["token_slot"][first:end] = trash
        positions = np.arange(row.start, row.start + row.length)
        views["position"][first:end] = positions + row.rope_shift
        # Only the row's own pages become an array: after a 16k-token prefix its table holds 1,000 more.
        first_page = row.start // page_size
        pages = np.asarray(row.page_table[first_page:])
        views["slot_mapping"][first:end] = pages[positions // page_size - first_page] * page_size + \
            positions % page_size
        first = end
    views["token"][first:] = 0
    views["token_slot"][first:] = trash
    views["position"][first:] = 0
    views["slot_mapping"][first:] = -1


def verify_rows(rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """A verify plan's rows as a decode graph runs them: each verify row (docs/speculative.md) becomes a one-token
    row per position, with its host token, attending over the positions before it as a decode row does (a step
    stores every row's keys before any row attends). Those rows sample into no slot: the step's acceptance
    (graph_step.accept_drafts) writes the slot's next input token."""
    out: list[Row] = []
    for row in rows:
        if not row.draft:
            out.append(row)
            continue
        out.extend(row._replace(start=row.start + i, length=1, tokens=(token,), sample=False,
                                output_index=row.output_index + i, history=None, draft=())
                   for i, token in enumerate(row.tokens))
    return tuple(out)


def sequence_rows(rows: tuple[Row, ...]) -> int:
    """The one-token rows `verify_rows` makes of a verify plan's rows: a row per position of each verify row."""
    return sum(row.length if row.draft else 1 for row in rows)


def verify_spans(rows: tuple[Row, ...]) -> tuple[np.ndarray, int]:
    """int64 [3, R]: each verify row's first one-token row in `verify_rows`, its width and its slot; and the
    widest row's width."""
    spans, first = [], 0
    for row in rows:
        if row.draft:
            spans.append((first, row.length, row.slot))
        first += row.length if row.draft else 1
    return np.asarray(spans, dtype=np.int64).T.reshape(3, -1), max(width for _, width, _ in spans)


def verify_results(rows: tuple[Row, ...], samples: list[int], verdicts: np.ndarray) -> tuple[list[int], list[int]]:
    """Per sampled row of the plan: its token and its accepted drafts, from the one-token rows' samples and the
    verify rows' verdicts (int64 [2, R]: accepted drafts, then the token after them)."""
    tokens, accepted, first, verified = [], [], 0, 0
    for row in rows:
        if row.draft:
            tokens.append(int(verdicts[1, verified]))
            accepted.append(int(verdicts[0, verified]))
            verified += 1
        elif row.sample:
            tokens.append(samples[first])
            accepted.append(0)
        first += row.length if row.draft else 1
    return tokens, accepted
