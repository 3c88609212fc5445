"""Rotary embedding of the new tokens' queries and keys, fused with writing their K and V into the paged cache.

Reads the fused q/k/v projection output once; cos and sin come from a float32 table built once per model
(`rope_table`), so the angles are the reference's. A token whose cache slot is negative (graph padding) writes
nothing to the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rope_table(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """[positions, head_dim] float32: cos of each angle in the first half of a row, sin in the second."""
    angles = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


@triton.jit
def _rope_store(qkv_ptr, pos_ptr, table_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, stride_qkv, stride_qt, stride_qh,
                stride_ks, stride_kh, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cos = tl.load(table_ptr + pos * HEAD_DIM + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(table_ptr + pos * HEAD_DIM + HALF + j, mask=jm, other=0.0)[None, :]
    row = qkv_ptr + t * stride_qkv
    h = tl.arange(0, BLOCK_H)
    hm = (h < HEADS)[:, None] & jm[None, :]
    src = row + h[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(src, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=hm, other=0.0).to(tl.float32)
    dst = q_ptr + t * stride_qt + h[:, None] * stride_qh + j[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=hm)
    kh = tl.arange(0, BLOCK_KH)
    # The slot test broadcast over a tensor: the interpreter takes no scalar inside a mask.
    km = ((kh < KV_HEADS) & (kh * 0 + slot >= 0))[:, None] & jm[None, :]
    src = row + (HEADS + kh)[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(src, mask=km, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=km, other=0.0).to(tl.float32)
    dst = k_ptr + slot * stride_ks + kh[:, None] * stride_kh + j[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=km)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=km)
    src = row + (HEADS + KV_HEADS + kh)[:, None] * HEAD_DIM + j[None, :]
    dst = v_ptr + slot * stride_ks + kh[:, None] * stride_kh + j[None, :]
    tl.store(dst, tl.load(src, mask=km, other=0.0), mask=km)
    tl.store(dst + HALF, tl.load(src + HALF, mask=km, other=0.0), mask=km)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D]; rotated k and v go to cache slot slot_mapping[t]."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert k_cache.stride() == v_cache.stride() and qkv.stride(-1) == 1
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_store[(tokens,)](qkv, positions, table, slot_mapping, q, k_cache, v_cache, qkv.stride(0), q.stride(0),
                           q.stride(1), k_cache.stride(0), k_cache.stride(1), HEADS=heads, KV_HEADS=kv_heads,
                           HEAD_DIM=head_dim, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                           BLOCK_KH=triton.next_power_of_2(kv_heads),
                           BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=4)
    return q


def rope_and_store_reference(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                             slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                             kv_heads: int) -> torch.Tensor:
    head_dim = k_cache.shape[-1]
    half = head_dim // 2
    q, k, v = qkv.view(qkv.shape[0], heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=1)
    rows = table[positions.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep].long()] = rotate(k)[keep]
    v_cache[slot_mapping[keep].long()] = v[keep]
    return rotate(q)
