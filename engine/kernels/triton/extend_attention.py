"""Paged prefill/extend attention: several new tokens per sequence against its cached prefix and, causally, each
other, optionally within a sliding window. The new tokens' K and V are already in the cache, so every key is read
through the page table.

FlashAttention-style: the host lists blocks of BLOCK_M new tokens of one sequence (`extend_blocks`), so a captured
graph launches a fixed grid and padding blocks (sequence -1, listed last) exit at once. A program takes TILE_M query
rows of one block and one query head and walks its keys in BLOCK_N tiles with an online softmax: tiles every row sees
whole run without a mask; only the causal diagonal and the window's lower edge are masked, and keys below the window
are never read. When the live blocks are too few to fill the GPU (a short chunk after a long cached prefix, decode
rows of a mixed step), each block's keys are split over several programs and a second kernel merges their partial
results by log-sum-exp. The split count depends only on the live blocks (their count and sizes, read once per
call by a one-program kernel) and each block's own keys, never on the grid, so a captured graph and an eager step
compute the same numbers. Decode rows of a mixed step are one-token
sequences here.

An FP8 cache is read as decode attention reads it (engine/kernels/triton/decode_attention.py): e4m3 widened in
registers (kv_store.widened), the program's KV head's key scale joined to the softmax scale and its value scale
multiplying the tile's output.

Blocks come in three sizes, each in a launch of its own whose programs exit at once on the others' blocks: full
blocks (more than MEDIUM rows) take one head per tile; short blocks (a prompt's tail, 64 new tokens after a long
cached prefix) and narrow ones (at most NARROW rows: decode rows, verify rows) pack a KV head's whole group of query
heads into each tile (4 tokens x 4 heads in a 16-row tile for Llama-3.1-8B), so each key is read once per group, as
decode attention does, instead of once per head with most rows idle.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from engine.kernels.triton.decode_attention import LOG2E, NO_WINDOW, dot_precision, float_keys
from engine.kernels.triton.kv_store import is_fp8, widened

BLOCK_M = 128  # new tokens per listed block
NARROW = 16  # blocks of at most this many rows run in 16-row tiles
MEDIUM = 64  # blocks of at most this many rows (and more than NARROW) pack their heads into the wide tiles
SIZES = ("full", "medium", "narrow")
# 64 new tokens after 16k / 32k cached: 0.086 / 0.143 ms a layer at 8 splits, 0.113 / 0.172 at 16 (H200, graphs;
# `bench.lab.gpu.kernels --only splits`): more splits write and merge more partial rows than their keys save.
MAX_SPLITS = 8
MIN_SPLIT_TILES = 4  # a split walks at least this many key tiles


@triton.jit
def _tile_keys(q, acc, m, l, k_ptr, v_ptr, table, kv_offset, begin, end, key_end, qpos, window, stride_ks, d, dmask,
               scale_log2, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               PRECISION: tl.constexpr):
    """Online softmax over the key tiles in [begin, end) (tile-aligned); keys at or past key_end are not read."""
    n = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        pos = start + n
        if PAGE % BLOCK_N == 0:  # a tile lies inside one page: one page-table read, contiguous keys
            slot = tl.load(table + start // PAGE).to(tl.int64) * PAGE + start % PAGE + n
        else:
            slot = tl.load(table + pos // PAGE, mask=pos < key_end, other=0).to(tl.int64) * PAGE + pos % PAGE
        offs = slot[:, None] * stride_ks + kv_offset + d[None, :]
        if MASKED:
            kv_mask = (pos < key_end)[:, None] & dmask[None, :]
        else:
            kv_mask = dmask[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if MASKED:
            visible = (pos < key_end)[None, :] & (pos[None, :] <= qpos[:, None]) & \
                (pos[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays empty
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _split_plan(block_seq_ptr, block_first_ptr, qlen_ptr, plan_ptr, num_blocks, programs, heads, split_items,
                BLOCKS_POW2: tl.constexpr, MAX_SPLITS: tl.constexpr, NARROW: tl.constexpr, MEDIUM: tl.constexpr,
                PACK_NARROW: tl.constexpr, PACK_MEDIUM: tl.constexpr):
    """One program writes (live blocks, splits per block): enough programs to fill the GPU, decided on the device.
    A packed block takes heads / PACK programs per split, so long-context decode rows get about the splits the
    decode kernel gives them, as far as the partial results' buffer (split_items) holds. Once per call, not in
    every program of the launches that read it: at a 256-row mixed step those are thousands of programs, each of
    which would otherwise reduce over every block."""
    b = tl.arange(0, BLOCKS_POW2)
    seq = tl.load(block_seq_ptr + b, mask=b < num_blocks, other=-1)
    rows = tl.load(qlen_ptr + seq, mask=seq >= 0, other=0) - tl.load(block_first_ptr + b, mask=seq >= 0, other=0)
    pack = tl.where(rows <= NARROW, PACK_NARROW, tl.where(rows <= MEDIUM, PACK_MEDIUM, 1))
    live = tl.sum((seq >= 0).to(tl.int32), 0)
    work = tl.sum(tl.where(seq >= 0, heads // pack, 0), 0)
    tl.store(plan_ptr, live)
    splits = tl.minimum(MAX_SPLITS, tl.cdiv(programs, tl.maximum(work, 1)))
    tl.store(plan_ptr + 1, tl.maximum(tl.minimum(splits, split_items // tl.maximum(live, 1)), 1))


@triton.jit
def _tile_range(ctx, qlen, row0, rows_here, window, splits, BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """For `rows_here` query rows from row0 on: (first key, aligned down to a tile; key end; splits these rows'
    keys take; key tiles)."""
    end = ctx - qlen + row0 + rows_here  # the last row's position + 1
    lo = tl.maximum(ctx - qlen + row0 - window + 1, 0) // BLOCK_N * BLOCK_N
    tiles = tl.cdiv(end - lo, BLOCK_N)
    return lo, end, tl.maximum(tl.minimum(splits, tiles // MIN_SPLIT_TILES), 1), tiles


@triton.jit
def _extend(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, tables_ptr, seq_table_ptr, qstart_ptr, qlen_ptr,
            ctx_ptr, block_seq_ptr, block_first_ptr, plan_ptr, kv_scale_ptr, heads, stride_qt, stride_qh, stride_ot,
            stride_oh, stride_ks, stride_kh, stride_table, scale_log2, window, GROUP: tl.constexpr,
            PACK: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
            BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, NARROW: tl.constexpr, MEDIUM: tl.constexpr,
            SIZE: tl.constexpr, PRECISION: tl.constexpr, KV_HEADS: tl.constexpr, FP8: tl.constexpr,
            WIDE: tl.constexpr):
    """One program: TILE_M rows of one block, each row a (new token, query head) pair: TILE_M // PACK tokens times
    PACK heads of one group (PACK 1: one head). A narrow block's program walks all its tokens, TILE_M // PACK at a
    time: most narrow blocks are decode rows of one token, and a program per token group would mostly launch only to
    exit (at a 256-row mixed step, thousands of them a layer)."""
    item = tl.program_id(0)
    live, splits = tl.load(plan_ptr), tl.load(plan_ptr + 1)
    block = item // splits
    split = item % splits
    if block >= live:
        return
    seq = tl.load(block_seq_ptr + block)
    first = tl.load(block_first_ptr + block)
    TOKENS: tl.constexpr = TILE_M // PACK
    qlen = tl.load(qlen_ptr + seq)
    rows_in_block = qlen - first
    size = tl.where(rows_in_block <= NARROW, 2, tl.where(rows_in_block <= MEDIUM, 1, 0))  # an index of SIZES
    row0 = first + tl.program_id(2) * TOKENS
    if (row0 >= qlen) | (size != SIZE):
        return
    ctx = tl.load(ctx_ptr + seq)
    # The key range and its splits are the merge's: for a short or narrow block, those of its whole block (the merge's
    # tile holds all of it) even where this program takes only some of its tokens.
    range_first = row0 if SIZE == 0 else first
    lo, end, tile_splits, tiles = _tile_range(ctx, qlen, range_first, tl.minimum(qlen - range_first, TILE_M),
                                              window, splits, BLOCK_N, MIN_SPLIT_TILES)
    if split >= tile_splits:
        return
    chunk = tl.cdiv(tiles, tile_splits) * BLOCK_N
    begin = lo + split * chunk
    stop = tl.minimum(begin + chunk, end)
    qstart = tl.load(qstart_ptr + seq)
    table = tables_ptr + tl.load(seq_table_ptr + seq).to(tl.int64) * stride_table
    last = qlen if SIZE == 2 else row0 + 1
    v_scale = 1.0
    if FP8:  # the program's KV head's scales
        kv_head = tl.program_id(1) * PACK // GROUP
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + KV_HEADS + kv_head)
    for row in range(row0, last, TOKENS):
        _attend_tile(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, table, row, first, qlen, qstart, ctx, lo, end,
                     begin, stop, block * splits + split, tile_splits, heads, stride_qt, stride_qh, stride_ot,
                     stride_oh, stride_ks, stride_kh, scale_log2, v_scale, window, GROUP, PACK, HEAD_DIM, BLOCK_D,
                     PAGE, BLOCK_M, TILE_M, BLOCK_N, PRECISION, FP8, WIDE)


@triton.jit
def _attend_tile(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, table, row0, first, qlen, qstart, ctx, lo, end,
                 begin, stop, part_item, tile_splits, heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_ks,
                 stride_kh, scale_log2, v_scale, window, GROUP: tl.constexpr, PACK: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                 TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                 WIDE: tl.constexpr):
    """The tile of rows from row0 on over keys [begin, stop): its output, or its split's partial result. WIDE: the
    dtype the queries, keys and values are multiplied in (kv_store.widened)."""
    r = tl.arange(0, TILE_M)
    i = row0 + r // PACK
    head = tl.program_id(1) * PACK + r % PACK
    rows = i < qlen
    qpos = ctx - qlen + i
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + (qstart + i).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rows[:, None] & dmask[None, :], other=0.0).to(WIDE)
    m = tl.full([TILE_M], float("-inf"), tl.float32)
    l = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, BLOCK_D], tl.float32)
    kv_offset = (tl.program_id(1) * PACK // GROUP) * stride_kh
    # Tiles below `clear_from` hold keys older than the window for some row; from `diagonal` on, keys newer than the
    # first row. Tiles in between are seen whole by every row.
    qpos0 = ctx - qlen + row0
    clear_from = lo + tl.cdiv(tl.maximum(end - window - lo, 0), BLOCK_N) * BLOCK_N
    diagonal = lo + tl.maximum(tl.minimum(qpos0 + 1, end) - lo, 0) // BLOCK_N * BLOCK_N
    u0 = tl.minimum(tl.maximum(clear_from, begin), stop)
    u1 = tl.minimum(tl.maximum(diagonal, u0), stop)
    acc, m, l = _tile_keys(q, acc, m, l, k_ptr, v_ptr, table, kv_offset, begin, u0, stop, qpos, window, stride_ks,
                           d, dmask, scale_log2, PAGE, BLOCK_N, True, PRECISION)
    acc, m, l = _tile_keys(q, acc, m, l, k_ptr, v_ptr, table, kv_offset, u0, u1, stop, qpos, window, stride_ks,
                           d, dmask, scale_log2, PAGE, BLOCK_N, False, PRECISION)
    acc, m, l = _tile_keys(q, acc, m, l, k_ptr, v_ptr, table, kv_offset, u1, stop, stop, qpos, window, stride_ks,
                           d, dmask, scale_log2, PAGE, BLOCK_N, True, PRECISION)
    out = acc / tl.maximum(l, 1e-30)[:, None]
    if FP8:
        out = out * v_scale
    mask = rows[:, None] & dmask[None, :]
    if tile_splits == 1:
        o_offs = (qstart + i).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (part_item * heads + head).to(tl.int64) * BLOCK_M + i - first
        tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=mask)
        tl.store(lse_ptr + part, tl.where(l > 0, m + tl.log2(tl.maximum(l, 1e-30)), float("-inf")), mask=rows)


@triton.jit
def _extend_merge(out_ptr, part_ptr, lse_ptr, qstart_ptr, qlen_ptr, ctx_ptr, block_seq_ptr, block_first_ptr, plan_ptr,
                  stride_ot, stride_oh, window, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    live, splits = tl.load(plan_ptr), tl.load(plan_ptr + 1)
    if (splits == 1) | (block >= live):
        return
    seq = tl.load(block_seq_ptr + block)
    first = tl.load(block_first_ptr + block)
    row0 = first + tl.program_id(2) * TILE_M
    qlen = tl.load(qlen_ptr + seq)
    if row0 >= qlen:
        return
    ctx = tl.load(ctx_ptr + seq)
    rows_here = tl.minimum(qlen - row0, TILE_M)
    lo, end, tile_splits, tiles = _tile_range(ctx, qlen, row0, rows_here, window, splits, BLOCK_N, MIN_SPLIT_TILES)
    if tile_splits == 1:
        return
    i = row0 + tl.arange(0, TILE_M)
    rows = i < qlen
    d = tl.arange(0, BLOCK_D)
    mask = rows[:, None] & (d < HEAD_DIM)[None, :]
    top = tl.full([TILE_M], -1e30, tl.float32)  # finite even when every split of a row is empty
    for split in range(0, tile_splits):
        r = ((block * splits + split) * heads + head).to(tl.int64) * BLOCK_M + i - first
        top = tl.maximum(top, tl.load(lse_ptr + r, mask=rows, other=float("-inf")))
    total = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, BLOCK_D], tl.float32)
    for split in range(0, tile_splits):
        r = ((block * splits + split) * heads + head).to(tl.int64) * BLOCK_M + i - first
        weight = tl.exp2(tl.load(lse_ptr + r, mask=rows, other=float("-inf")) - top)
        total += weight
        acc += weight[:, None] * tl.load(part_ptr + r[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = acc / tl.maximum(total, 1e-30)[:, None]
    o_offs = (tl.load(qstart_ptr + seq) + i).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def extend_blocks(lengths: list[int]) -> tuple[list[int], list[int]]:
    """(sequence, first new token) of every BLOCK_M-token block of the given query lengths, full blocks (more than
    MEDIUM rows) first: the full launch's grid then covers only as many blocks as the step's tokens can fill."""
    seqs, firsts, short_seqs, short_firsts = [], [], [], []
    for seq, length in enumerate(lengths):
        for first in range(0, length, BLOCK_M):
            full = length - first > MEDIUM
            (seqs if full else short_seqs).append(seq)
            (firsts if full else short_firsts).append(first)
    return seqs + short_seqs, firsts + short_firsts


def max_blocks(tokens: int, seqs: int) -> int:
    """The most blocks a step of `tokens` new tokens over at most `seqs` sequences can need."""
    return -(-tokens // BLOCK_M) + seqs


@lru_cache
def target_programs(device: torch.device) -> int:
    """Programs that keep every multiprocessor busy; under the CPU interpreter (tests) a small count."""
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def tile_config(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(TILE_M, BLOCK_N, num_warps, num_stages): 128x64 tiles on one warpgroup of four warps for half types up to
    head_dim 128 (on an H200, 2,048 new tokens at 16k context: 1.42 ms a layer against 1.68 on eight warps, and 64
    new tokens 0.215 against 0.250 ms; `bench.lab.gpu.kernels --only tiles`); smaller tiles where float32 or wide
    heads would spill registers. Narrow blocks take NARROW-row tiles on four warps, with the same BLOCK_N."""
    if device.type != "cuda":
        return 64, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if head_dim > 128:
        return 64, 64, 8, 2
    return 128, 64, 4, 3


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     page_tables: torch.Tensor, seq_table: torch.Tensor, query_start: torch.Tensor,
                     query_len: torch.Tensor, context_lens: torch.Tensor, block_seq: torch.Tensor,
                     block_first: torch.Tensor, page_size: int, scale: float, window: int = 0,
                     programs: int | None = None, config: tuple[int, int, int, int] | None = None,
                     kv_scale: torch.Tensor | None = None, max_splits: int = MAX_SPLITS) -> None:
    """Writes out[t] for each new token t of the listed sequences; q, out [T, H, D]; other rows are left alone.
    window > 0: a query at position p sees keys p - window < k <= p (transformers' sliding window). `programs`
    (how many the GPU wants busy), `config` (tile_config's tuple) and `max_splits` (of a block's keys) are for tests
    and benchmarks. An FP8 cache
    needs `kv_scale` [2, KVH] (keys', values')."""
    heads, head_dim = q.shape[1], q.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    if block_seq.numel() == 0:
        return
    tile_m, block_n, warps, stages = config or tile_config(q.dtype, head_dim, q.device)
    programs = programs or target_programs(q.device)
    num_blocks = block_seq.numel()
    # Partial results of split blocks: live blocks * splits <= split_items (_split_plan caps it); unpacked blocks
    # never need more (with splits, live * heads < programs).
    split_items = 2 * -(-programs // heads)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part = torch.empty(split_items * heads * BLOCK_M * head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(split_items * heads * BLOCK_M, dtype=torch.float32, device=q.device)
    window = window if window > 0 else NO_WINDOW
    group = heads // k_cache.shape[1]
    fp8 = is_fp8(k_cache)
    # Tiles of short and narrow blocks hold a whole group of heads where it divides them.
    packs = {"full": 1, "medium": group if tile_m % group == 0 else 1, "narrow": group if NARROW % group == 0 else 1}
    plan = torch.empty(2, dtype=torch.int32, device=q.device)
    _split_plan[(1,)](block_seq, block_first, query_len, plan, num_blocks, programs, heads, split_items,
                      BLOCKS_POW2=triton.next_power_of_2(num_blocks), MAX_SPLITS=max_splits, NARROW=NARROW,
                      MEDIUM=MEDIUM, PACK_NARROW=packs["narrow"], PACK_MEDIUM=packs["medium"])
    # One BLOCK_N for both launches and the merge: a block's key splits are counted in its tiles.
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                  MIN_SPLIT_TILES=MIN_SPLIT_TILES)
    for size, name in enumerate(SIZES):
        tile = NARROW if name == "narrow" else tile_m
        pack = packs[name]
        tiles_per_block = {"full": BLOCK_M // tile, "medium": -(-MEDIUM * pack // tile), "narrow": 1}[name]
        # Full blocks are listed first (extend_blocks), and a step of T tokens holds at most T // (MEDIUM + 1).
        blocks = min(num_blocks, q.shape[0] // (MEDIUM + 1)) if name == "full" else num_blocks
        _extend[(max(blocks, split_items), heads // pack, tiles_per_block)](
            q, k_cache, v_cache, out, part, lse, page_tables, seq_table, query_start, query_len, context_lens,
            block_seq, block_first, plan, kv_scale if fp8 else q, heads, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1),
            k_cache.stride(0), k_cache.stride(1), page_tables.stride(0), scale * LOG2E, window,
            GROUP=group, PACK=pack, PAGE=page_size, TILE_M=tile, NARROW=NARROW, MEDIUM=MEDIUM, SIZE=size,
            PRECISION=dot_precision(q.dtype), KV_HEADS=k_cache.shape[1], FP8=fp8, WIDE=widened(k_cache, q.dtype),
            num_warps=4 if name == "narrow" else warps, num_stages=stages, **common)
    _extend_merge[(min(num_blocks, -(-programs // heads)), heads, BLOCK_M // tile_m)](
        out, part, lse, query_start, query_len, context_lens, block_seq, block_first, plan, out.stride(0),
        out.stride(1), window, TILE_M=tile_m, num_warps=8, **common)


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_tables: torch.Tensor, seq_table: torch.Tensor, query_start: torch.Tensor,
                               query_len: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                               scale: float, window: int = 0, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same function in float32 torch; rows of no sequence come back as zeros."""
    heads = q.shape[1]
    group = heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s in range(seq_table.numel()):
        first, length, ctx = int(query_start[s]), int(query_len[s]), int(context_lens[s])
        if length == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = page_tables[int(seq_table[s])][pos // page_size].long() * page_size + pos % page_size
        keys = float_keys(k_cache[slots], kv_scale, 0).repeat_interleave(group, dim=1)
        values = float_keys(v_cache[slots], kv_scale, 1).repeat_interleave(group, dim=1)
        query_pos = torch.arange(ctx - length, ctx, device=q.device)
        hidden = pos[None, :] > query_pos[:, None]
        if window > 0:
            hidden |= pos[None, :] <= query_pos[:, None] - window
        scores = torch.einsum("qhd,thd->hqt", q[first:first + length].float(), keys) * scale
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[first:first + length] = torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)
