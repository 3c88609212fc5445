"""Paged decode attention: one new token per sequence against its cached keys, split over the context (split-KV).

The cache of one layer is `[slots, kv_heads, head_dim]` for K and again for V, slot = page * page_size + offset.
`page_tables[seq_table[b]]` lists sequence b's pages: the graph executor keeps one table row per request slot, so a
step names rows instead of uploading tables. One program takes one (sequence, kv head, split) and every query head
of that group, so each key is read once per group; a second kernel merges the splits by their log-sum-exp. Short
batches use many splits so that the GPU's multiprocessors all have work.

An FP8 cache (engine/model/kv_quant.py) is read as e4m3 (half the bytes of a bfloat16 one) and widened in registers
(kv_store.widened: float16 for a 16-bit model, with its queries), which holds every e4m3 value exactly; the program's
KV head has one key scale and one value scale, so the key scale joins the softmax scale and the value scale multiplies
the program's output: value * scale, with the sums in fp32 as for any cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.dependent_launch import NONE, launch_options, release, wait
from engine.kernels.triton.kv_store import is_fp8, widened
from engine.kernels.triton.rotary import NORM_STYLES, rope_angles, rotated_heads, store_new_kv
from engine.model.kv_quant import dequantize

LOG2E = 1.4426950408889634
BLOCK_N = 64
MAX_SPLITS = 32
NO_WINDOW = 1 << 30


@triton.jit
def _decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, seq_table_ptr, ctx_ptr, part_ptr, lse_ptr, out_ptr, kv_scale_ptr,
                  qkv_ptr, pos_ptr, rope_ptr, slot_ptr, q_norm_ptr, k_norm_ptr, norm_eps, stride_qkv,
                  stride_qt, stride_qh, stride_ks, stride_kh, stride_table, stride_ot, stride_oh, scale_log2, window,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLITS: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                  ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, WIDE: tl.constexpr,
                  DEPENDENT: tl.constexpr):
    """ROPE: q_ptr is scratch [SPLITS * B, H, D] for the rotated queries of the step's tokens, which come from their
    q/k/v product (qkv_ptr; the other ROPE arguments as rotary.py's _rope_store takes them)."""
    wait(DEPENDENT)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    table = tables_ptr + tl.load(seq_table_ptr + seq).to(tl.int64) * stride_table
    lo = tl.maximum(ctx - window, 0)  # the sliding window: keys before it are never read
    per_split = tl.cdiv(tl.cdiv(ctx - lo, BLOCK_N), SPLITS) * BLOCK_N
    begin = lo + split * per_split
    end = tl.minimum(begin + per_split, ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    if ROPE:
        # Each split rotates the group's queries into rows of its own (then reads them back whole); the split whose
        # keys end with the new token stores its key and value first.
        q_rows = q_ptr + (split * tl.num_programs(0) + seq).to(tl.int64) * stride_qt
        _rotate_and_store(qkv_ptr + seq.to(tl.int64) * stride_qkv, pos_ptr + seq, rope_ptr, slot_ptr + seq,
                          q_norm_ptr, k_norm_ptr, norm_eps, q_rows, stride_qh, k_ptr, v_ptr, kv_scale_ptr, stride_ks,
                          stride_kh, heads, g < GROUP, kv_head, (ctx - 1 >= begin) & (ctx - 1 < end), HEADS,
                          KV_HEADS, HEAD_DIM, HEAD_DIM // 2, BLOCK_HALF, NORM, FP8)
        tl.debug_barrier()
    else:
        q_rows = q_ptr + seq * stride_qt
    q = tl.load(q_rows + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0).to(WIDE)
    if FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + KV_HEADS + kv_head)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        pos = start + n
        valid = pos < end
        page = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
        offs = (page * PAGE + pos % PAGE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    release(DEPENDENT)
    out = acc / tl.maximum(l, 1e-30)[:, None]  # an empty split (or an empty padding row) leaves zeros
    if FP8:
        out = out * v_scale
    if SPLITS == 1:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq * HEADS + heads) * SPLITS + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.maximum(l, 1e-30)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _rotate_and_store(row, pos_ptr, rope_ptr, slot_ptr, q_norm_ptr, k_norm_ptr, eps, q_rows, stride_qh, k_ptr, v_ptr,
                      kv_scale_ptr, stride_ks, stride_kh, heads, live, kv_head, stores, HEADS: tl.constexpr,
                      KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      NORM: tl.constexpr, FP8: tl.constexpr):
    """A token's q/k/v product `row`: query heads `heads` (where `live`) normalised and rotated into `q_rows`, and,
    where `stores`, the key and value of `kv_head` into the token's cache slot, as rope_and_store does."""
    dtype = row.dtype.element_ty
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cos, sin = rope_angles(rope_ptr, tl.load(pos_ptr).to(tl.int64), j, jm, HEAD_DIM, HALF)
    hm = live[:, None] & jm[None, :]
    q1, q2 = rotated_heads(row, heads, hm, j, jm, cos, sin, q_norm_ptr, eps, HEAD_DIM, HALF, NORM, dtype)
    tl.store(q_rows + heads[:, None] * stride_qh + j[None, :], q1, mask=hm)
    tl.store(q_rows + heads[:, None] * stride_qh + HALF + j[None, :], q2, mask=hm)
    if stores:
        slot = tl.load(slot_ptr).to(tl.int64)
        one = tl.arange(0, 2)  # the program's KV head, in a block of two (a block of one is not a tensor everywhere)
        km = ((one < 1) & (one * 0 + slot >= 0))[:, None] & jm[None, :]
        store_new_kv(row, slot, kv_head + one, km, j, jm, cos, sin, k_ptr, v_ptr, k_norm_ptr, kv_scale_ptr, eps,
                     stride_ks, stride_kh, HEADS, KV_HEADS, HEAD_DIM, HALF, NORM, FP8, dtype)


@triton.jit
def _decode_merge(part_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, DEPENDENT: tl.constexpr):
    wait(DEPENDENT)  # a program per (sequence, head), over at once
    release(DEPENDENT)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    row = (seq * HEADS + head) * SPLITS + s
    lse = tl.load(lse_ptr + row)
    top = tl.maximum(tl.max(lse, 0), -1e30)  # finite even when every split is empty
    weight = tl.exp2(lse - top)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_splits(batch: int, kv_heads: int, multiprocessors: int) -> int:
    """Enough (sequence, head, split) programs for two waves over the multiprocessors, as a power of two."""
    want = max(1, -(-2 * multiprocessors // max(batch * kv_heads, 1)))
    return min(MAX_SPLITS, triton.next_power_of_2(want))


def dot_precision(dtype: torch.dtype) -> str:
    # float32 models keep float32 products (the CPU reference's numbers); half types use the tensor cores anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class NewTokens:
    """The step's tokens, one a sequence, as their q/k/v product [B, (H + 2 KVH) D], for decode_attention to rotate
    and store (rotary.py's rope_and_store, inside the attention kernel: a launch a layer fewer). The arguments are
    rope_and_store's."""
    qkv: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    slot_mapping: torch.Tensor
    heads: int
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6
    norm_style: str = "llama"


def decode_attention(q: torch.Tensor | NewTokens, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_tables: torch.Tensor, seq_table: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                     scale: float, splits: int, window: int = 0, kv_scale: torch.Tensor | None = None,
                     block_n: int = BLOCK_N, dependent: int = NONE) -> torch.Tensor:
    """q [B, H, D] (token b is sequence b), or the tokens before their rotary and cache store; caches [slots, KVH,
    D]; returns [B, H, D]. context_lens 0 gives zeros. window > 0: the token at position p sees keys
    p - window < k <= p (transformers' sliding window). An FP8 cache needs `kv_scale` [2, KVH] (keys', values').
    `block_n`: keys a tile (benchmarks sweep it). `dependent`: the kernels launched as dependent launches
    (engine/kernels/triton/dependent_launch.py)."""
    new = q if isinstance(q, NewTokens) else None
    kv_heads, head_dim = k_cache.shape[1:]
    if new is not None:
        assert new.qkv.stride(-1) == 1 and (new.q_norm is None) == (new.k_norm is None)
        batch, heads = new.qkv.shape[0], new.heads
        q = torch.empty(splits * batch, heads, head_dim, dtype=new.qkv.dtype, device=new.qkv.device)  # scratch
    else:
        batch, heads, _ = q.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = heads // kv_heads
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    part = torch.empty(batch * heads * splits * head_dim if splits > 1 else 1, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch * heads * splits if splits > 1 else 1, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    fp8 = is_fp8(k_cache)
    rope = (new.qkv, new.positions, new.table, new.slot_mapping, new.q_norm if new.q_norm is not None else q,
            new.k_norm if new.k_norm is not None else q, new.norm_eps, new.qkv.stride(0)) if new is not None else \
        (q, q, q, q, q, q, 0.0, 0)
    _decode_split[(batch, kv_heads, splits)](
        q, k_cache, v_cache, page_tables, seq_table, context_lens, part, lse, out, kv_scale if fp8 else q,
        *rope, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, window if window > 0 else NO_WINDOW,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page_size, BLOCK_N=block_n, SPLITS=splits,
        PRECISION=dot_precision(q.dtype), FP8=fp8, ROPE=new is not None,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        NORM=NORM_STYLES[new.norm_style if new is not None and new.q_norm is not None else None],
        WIDE=widened(k_cache, q.dtype), DEPENDENT=dependent, num_warps=4, num_stages=2, **launch_options(dependent))
    if splits > 1:
        _decode_merge[(batch, heads)](part, lse, out, out.stride(0), out.stride(1), HEADS=heads, HEAD_DIM=head_dim,
                                      BLOCK_D=block_d, SPLITS=splits, DEPENDENT=dependent, num_warps=4,
                                      **launch_options(dependent))
    return out


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_tables: torch.Tensor, seq_table: torch.Tensor, context_lens: torch.Tensor,
                               page_size: int, scale: float, window: int = 0,
                               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same function in float32 torch, one sequence at a time."""
    batch, heads, head_dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        pos = torch.arange(max(ctx - window, 0) if window > 0 else 0, ctx, device=q.device)
        slots = page_tables[int(seq_table[b])][pos // page_size].long() * page_size + pos % page_size
        keys = float_keys(k_cache[slots], kv_scale, 0).repeat_interleave(group, dim=1)  # [ctx, H, D]
        values = float_keys(v_cache[slots], kv_scale, 1).repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), keys) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", weights, values)
    return out.to(q.dtype)


def float_keys(rows: torch.Tensor, kv_scale: torch.Tensor | None, part: int) -> torch.Tensor:
    """Cache rows [..., KVH, D] as the references read them, in float32: an FP8 cache's times its heads' scales
    (kv_scale[part]: 0 keys, 1 values)."""
    return rows.float() if not is_fp8(rows) else dequantize(rows, kv_scale[part], torch.float32)
