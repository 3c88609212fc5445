"""Paged prefill/extend attention: several new tokens per sequence against its cached prefix and, causally, each
other. The new tokens' K and V are already in the cache, so every key is read through the page table.

Work is cut into blocks of BLOCK_M new tokens of one sequence; the host lists the blocks (`extend_blocks`), so a
captured graph launches a fixed grid and padding blocks (sequence -1) exit at once. One program takes one block and
one query head. Decode rows of a mixed step are one-token sequences here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.decode_attention import LOG2E, dot_precision

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _extend(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_table_ptr, qstart_ptr, qlen_ptr, ctx_ptr, block_seq_ptr,
            block_first_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_table,
            scale_log2, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(block_seq_ptr + block)
    live = seq >= 0
    seq = tl.maximum(seq, 0)
    first = tl.load(block_first_ptr + block)
    qlen = tl.where(live, tl.load(qlen_ptr + seq), 0)
    qstart = tl.load(qstart_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    table = tables_ptr + tl.load(seq_table_ptr + seq).to(tl.int64) * stride_table
    i = first + tl.arange(0, BLOCK_M)
    rows = i < qlen
    qpos = ctx - qlen + i
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_offs = (qstart + i).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=rows[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.where(live, tl.minimum(ctx, ctx - qlen + first + BLOCK_M), 0)  # the block's last query sees up to here
    n = tl.arange(0, BLOCK_N)
    for start in range(0, end, BLOCK_N):
        pos = start + n
        valid = pos < end
        page = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
        offs = (page * PAGE + pos % PAGE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # Every query row sees key 0, so no row is all -inf after the first block.
        s = tl.where(valid[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]
    o_offs = (qstart + i).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & dmask[None, :])


def extend_blocks(lengths: list[int]) -> tuple[list[int], list[int]]:
    """(sequence, first new token) of every BLOCK_M-token block of the given query lengths."""
    seqs, firsts = [], []
    for seq, length in enumerate(lengths):
        for first in range(0, length, BLOCK_M):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def max_blocks(tokens: int, seqs: int) -> int:
    """The most blocks a step of `tokens` new tokens over at most `seqs` sequences can need."""
    return -(-tokens // BLOCK_M) + seqs


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     page_tables: torch.Tensor, seq_table: torch.Tensor, query_start: torch.Tensor,
                     query_len: torch.Tensor, context_lens: torch.Tensor, block_seq: torch.Tensor,
                     block_first: torch.Tensor, page_size: int, scale: float) -> None:
    """Writes out[t] for each new token t of the listed sequences; q, out [T, H, D]; other rows are left alone."""
    heads, head_dim = q.shape[1], q.shape[2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    _extend[(block_seq.numel(), heads)](
        q, k_cache, v_cache, out, page_tables, seq_table, query_start, query_len, context_lens, block_seq,
        block_first, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        page_tables.stride(0), scale * LOG2E, GROUP=heads // k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=2)


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_tables: torch.Tensor, seq_table: torch.Tensor, query_start: torch.Tensor,
                               query_len: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                               scale: float) -> torch.Tensor:
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
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        query_pos = torch.arange(ctx - length, ctx, device=q.device)
        scores = torch.einsum("qhd,thd->hqt", q[first:first + length].float(), keys) * scale
        scores = scores.masked_fill(pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[first:first + length] = torch.einsum("hqt,thd->qhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)
