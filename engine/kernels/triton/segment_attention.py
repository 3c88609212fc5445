"""Bidirectional attention within segments of contiguous rows: the vision tower's (docs/design.md, Images; each image's
patches see every patch of the same image and nothing else), for every image of a call in one launch.

Not a mode of extend_attention.py: that kernel reads its keys through the paged cache, causally, with key splits
for short blocks after long prefixes; here q, k and v are the rows of one projection, every row sees its whole
segment, and segments are long (an image is hundreds to thousands of patches), so one program per (BLOCK_M rows,
head) fills the GPU without splits.

Each row names its segment as [start, end) (`bounds`, int32 [2, rows]), so the grid depends only on the row count:
a captured graph at a patch capacity replays for any set of images, the host writing their bounds. Rows are in
segment order, so a program's keys lie in [first row's start, last row's end); key tiles that every row of the
program sees whole load without a mask, only the tiles at segment edges are masked. A row whose segment is itself
alone (padding) reads one key tile. Head dims that are not a power of two (72 in Qwen3-VL) are padded to the next
one and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.decode_attention import LOG2E, dot_precision

SEGMENT_END = tl.constexpr(1 << 30)  # larger than any row index: the neutral element of a min over segment ends


@triton.jit
def _segment_keys(q, acc, m, l, k_ptr, v_ptr, begin, stop, key_end, row_start, row_end, stride_kt, stride_vt,
                  k_offset, v_offset, d, dmask, scale_log2, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Online softmax over the key tiles in [begin, stop); keys at or past key_end are not read."""
    n = tl.arange(0, BLOCK_N)
    for start in range(begin, stop, BLOCK_N):
        pos = start + n
        if MASKED:
            kv_mask = (pos < key_end)[:, None] & dmask[None, :]
        else:
            kv_mask = dmask[None, :]
        k = tl.load(k_ptr + pos.to(tl.int64)[:, None] * stride_kt + k_offset + d[None, :], mask=kv_mask, other=0.0)
        # The select runs on every tile, masked or not: without it the compiler may fuse the scaling into the
        # exponent's subtraction (one rounding fewer) on unmasked tiles only, and a row's bits would depend on
        # whether its neighbours in the program (padding, in a graph) made the tile a masked one.
        visible = (pos[None, :] >= row_start[:, None]) & (pos[None, :] < row_end[:, None])
        s = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays empty
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + pos.to(tl.int64)[:, None] * stride_vt + v_offset + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _segment_attention(q_ptr, k_ptr, v_ptr, out_ptr, bounds_ptr, rows, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh, stride_ot, stride_oh, scale_log2, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    head = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = i < rows
    row_start = tl.load(bounds_ptr + i, mask=live, other=0)
    row_end = tl.load(bounds_ptr + rows + i, mask=live, other=0)
    lo = tl.min(tl.where(live, row_start, SEGMENT_END), 0) // BLOCK_N * BLOCK_N
    key_end = tl.max(row_end, 0)
    # Keys in [shared_from, shared_to) are in every live row's segment: those tiles need no mask.
    shared_from = lo + tl.cdiv(tl.max(row_start, 0) - lo, BLOCK_N) * BLOCK_N
    shared_to = tl.maximum(lo + tl.maximum(tl.min(tl.where(live, row_end, SEGMENT_END), 0) - lo, 0)
                           // BLOCK_N * BLOCK_N, shared_from)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + i.to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=live[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_offset, v_offset = head * stride_kh, head * stride_vh
    acc, m, l = _segment_keys(q, acc, m, l, k_ptr, v_ptr, lo, shared_from, key_end, row_start, row_end, stride_kt,
                              stride_vt, k_offset, v_offset, d, dmask, scale_log2, BLOCK_N, True, PRECISION)
    acc, m, l = _segment_keys(q, acc, m, l, k_ptr, v_ptr, shared_from, shared_to, key_end, row_start, row_end,
                              stride_kt, stride_vt, k_offset, v_offset, d, dmask, scale_log2, BLOCK_N, False,
                              PRECISION)
    acc, m, l = _segment_keys(q, acc, m, l, k_ptr, v_ptr, shared_to, key_end, key_end, row_start, row_end,
                              stride_kt, stride_vt, k_offset, v_offset, d, dmask, scale_log2, BLOCK_N, True,
                              PRECISION)
    out = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + i.to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None] & dmask[None, :])


def segment_bounds(lengths: list[int], rows: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """int32 [2, rows]: each row's segment [start, end) for consecutive segments of `lengths`; rows past them (up
    to `rows`, a graph's capacity) are padding, each its own one-row segment, so no real row ever sees one."""
    total = sum(lengths)
    rows = total if rows is None else rows
    if rows < total:
        raise ValueError(f"{total} rows of segments do not fit in {rows}")
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    index = torch.arange(rows)
    start, end = index.clone(), index + 1
    if lengths:
        end[:total] = ends.repeat_interleave(torch.tensor(lengths))
        start[:total] = end[:total] - torch.tensor(lengths).repeat_interleave(torch.tensor(lengths))
    return torch.stack([start, end]).to(torch.int32).to(device)


def tile_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); small tiles under the CPU interpreter (tests). On an H200 at
    Qwen3-VL's heads (16 of 72 dims padded to 128), one 4,096-patch image, bf16: 64 x 64 with 4 warps takes 0.82 ms
    a layer; extend_attention's 128 x 64 with 8 warps 1.41 ms; 128 x 128 3.5 ms (cuDNN's SDPA: 0.20 ms)."""
    if device.type != "cuda":
        return 32, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    return 64, 64, 4, 2


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                      out: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q, k, v [T, H, D] (any row and head strides, contiguous last dim); bounds from segment_bounds; returns (or
    writes) out [T, H, D], scaled by D ** -0.5. `config` (tile_config's tuple) is for tests and benchmarks."""
    rows, heads, head_dim = q.shape
    assert k.shape == v.shape == q.shape and bounds.shape == (2, rows) and bounds.dtype == torch.int32
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    if rows == 0:
        return out
    block_m, block_n, warps, stages = config or tile_config(q.dtype, q.device)
    _segment_attention[(triton.cdiv(rows, block_m), heads)](
        q, k, v, out, bounds, rows, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), head_dim ** -0.5 * LOG2E, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype), num_warps=warps, num_stages=stages)
    return out


def segment_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                bounds: torch.Tensor) -> torch.Tensor:
    """The same function in float32 torch, one dense masked softmax."""
    keys = torch.arange(q.shape[0], device=q.device)
    start, end = bounds.long()
    visible = (keys[None, :] >= start[:, None]) & (keys[None, :] < end[:, None])
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)
