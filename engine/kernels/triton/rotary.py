"""Rotary embedding of the new tokens' queries and keys, fused with writing their K and V into the paged cache.

Reads the fused q/k/v projection output once; cos and sin come from a float32 table built once per model
(`rope_table`), so the angles are the reference's. A token whose cache slot is negative (graph padding) writes
nothing to the cache. Qwen3 and Gemma 3 normalise each query and key head (RMSNorm over head_dim) before the
rotation: given their weights, the same pass does it, rounding where each family's torch norm rounds. An FP8 cache
gets the rotated key and the value rounded to the model's dtype, then over their head's scale to e4m3
(engine/kernels/triton/kv_store.py), as the torch path quantizes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.dependent_launch import NONE, launch_options, release, wait
from engine.kernels.triton.e4m3 import to_e4m3
from engine.kernels.triton.kv_store import is_fp8, store_kv_reference


def rope_table(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """[positions, head_dim] float32: cos of each angle in the first half of a row, sin in the second."""
    angles = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


NORM_STYLES = {None: 0, "llama": 1, "gemma": 2}


@triton.jit
def _head_norm(x1, x2, w_ptr, j, jm, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
               dtype: tl.constexpr):
    """RMSNorm of each head row (halves x1, x2 in float32). NORM 1 (Llama/Qwen3): the normalised row rounds before
    the weight multiplies it; 2 (Gemma 3): times (1 + w) in float32, rounded once."""
    if NORM != 0:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        if NORM == 1:
            x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        else:
            x1 = (x1 * rstd * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * rstd * (1.0 + w2)).to(dtype).to(tl.float32)
    return x1, x2


@triton.jit
def rope_angles(table_ptr, pos, j, jm, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """cos and sin [1, BLOCK_HALF] of position `pos` from the rope table (j: the half's columns, jm: which exist)."""
    cos = tl.load(table_ptr + pos * HEAD_DIM + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(table_ptr + pos * HEAD_DIM + HALF + j, mask=jm, other=0.0)[None, :]
    return cos, sin


@triton.jit
def rotated_heads(row, heads, mask, j, jm, cos, sin, norm_ptr, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  NORM: tl.constexpr, dtype: tl.constexpr):
    """Heads `heads` of a token's q/k/v product `row`, each normalised (NORM) and rotated: their halves in `dtype`,
    the model's."""
    src = row + heads[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    x1, x2 = _head_norm(x1, x2, norm_ptr, j, jm, eps, HEAD_DIM, HALF, NORM, dtype)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def store_new_kv(row, slot, kh, km, j, jm, cos, sin, k_ptr, v_ptr, k_norm_ptr, scale_ptr, eps, stride_ks, stride_kh,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 NORM: tl.constexpr, FP8: tl.constexpr, dtype: tl.constexpr):
    """KV heads `kh` of a token's q/k/v product `row` into cache slot `slot` (where `km`): the key normalised and
    rotated, the value as it is; over their heads' scales to e4m3 in an FP8 cache."""
    k1, k2 = rotated_heads(row, HEADS + kh, km, j, jm, cos, sin, k_norm_ptr, eps, HEAD_DIM, HALF, NORM, dtype)
    src = row + (HEADS + KV_HEADS + kh)[:, None] * HEAD_DIM + j[None, :]
    v1 = tl.load(src, mask=km, other=0.0)
    v2 = tl.load(src + HALF, mask=km, other=0.0)
    if FP8:
        k_scale = tl.load(scale_ptr + kh, mask=kh < KV_HEADS, other=1.0)[:, None]
        v_scale = tl.load(scale_ptr + KV_HEADS + kh, mask=kh < KV_HEADS, other=1.0)[:, None]
        k1, k2 = to_e4m3(k1, k_scale, k_ptr.dtype.element_ty), to_e4m3(k2, k_scale, k_ptr.dtype.element_ty)
        v1, v2 = to_e4m3(v1, v_scale, v_ptr.dtype.element_ty), to_e4m3(v2, v_scale, v_ptr.dtype.element_ty)
    dst = k_ptr + slot * stride_ks + kh[:, None] * stride_kh + j[None, :]
    tl.store(dst, k1, mask=km)
    tl.store(dst + HALF, k2, mask=km)
    dst = v_ptr + slot * stride_ks + kh[:, None] * stride_kh + j[None, :]
    tl.store(dst, v1, mask=km)
    tl.store(dst + HALF, v2, mask=km)


@triton.jit
def _rope_store(qkv_ptr, pos_ptr, table_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, scale_ptr, eps,
                stride_qkv, stride_qt, stride_qh, stride_ks, stride_kh, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
                BLOCK_HALF: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr, DEPENDENT: tl.constexpr):
    wait(DEPENDENT)  # a program per token, over at once: the next kernel may be placed as soon as these are
    release(DEPENDENT)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cos, sin = rope_angles(table_ptr, pos, j, jm, HEAD_DIM, HALF)
    row = qkv_ptr + t * stride_qkv
    h = tl.arange(0, BLOCK_H)
    hm = (h < HEADS)[:, None] & jm[None, :]
    dtype = q_ptr.dtype.element_ty
    q1, q2 = rotated_heads(row, h, hm, j, jm, cos, sin, q_norm_ptr, eps, HEAD_DIM, HALF, NORM, dtype)
    dst = q_ptr + t * stride_qt + h[:, None] * stride_qh + j[None, :]
    tl.store(dst, q1, mask=hm)
    tl.store(dst + HALF, q2, mask=hm)
    kh = tl.arange(0, BLOCK_KH)
    # The slot test broadcast over a tensor: the interpreter takes no scalar inside a mask.
    km = ((kh < KV_HEADS) & (kh * 0 + slot >= 0))[:, None] & jm[None, :]
    store_new_kv(row, slot, kh, km, j, jm, cos, sin, k_ptr, v_ptr, k_norm_ptr, scale_ptr, eps, stride_ks, stride_kh,
                 HEADS, KV_HEADS, HEAD_DIM, HALF, NORM, FP8, dtype)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                   norm_style: str = "llama", kv_scale: torch.Tensor | None = None,
                   dependent: int = NONE) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D]; rotated k and v go to cache slot slot_mapping[t].
    With q_norm and k_norm ([D] weights), each query and key head is RMS-normalised first: norm_style "llama"
    (Qwen3) or "gemma" (Gemma 3's (1 + w)). An FP8 cache needs `kv_scale` [2, KVH] (keys', values').
    `dependent`: launched as a dependent launch (engine/kernels/triton/dependent_launch.py)."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert k_cache.stride() == v_cache.stride() and qkv.stride(-1) == 1
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    assert (q_norm is None) == (k_norm is None)
    norm = NORM_STYLES[norm_style if q_norm is not None else None]
    fp8 = is_fp8(k_cache)
    _rope_store[(tokens,)](qkv, positions, table, slot_mapping, q, k_cache, v_cache,
                           q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
                           kv_scale if fp8 else qkv, norm_eps,
                           qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                           HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
                           BLOCK_H=triton.next_power_of_2(heads), BLOCK_KH=triton.next_power_of_2(kv_heads),
                           BLOCK_HALF=triton.next_power_of_2(head_dim // 2), NORM=norm, FP8=fp8,
                           DEPENDENT=dependent, num_warps=4, **launch_options(dependent))
    return q


def rope_and_store_reference(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                             slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                             kv_heads: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                             norm_eps: float = 1e-6, norm_style: str = "llama",
                             kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    head_dim = k_cache.shape[-1]
    half = head_dim // 2
    q, k, v = qkv.view(qkv.shape[0], heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=1)
    if q_norm is not None and k_norm is not None:
        q = head_rms_norm_reference(q, q_norm, norm_eps, norm_style)
        k = head_rms_norm_reference(k, k_norm, norm_eps, norm_style)
    rows = table[positions.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    store_kv_reference(rotate(k), v, slot_mapping, k_cache, v_cache, kv_scale)
    return rotate(q)


def head_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, norm_style: str) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers' Qwen3RMSNorm ("llama") or Gemma3RMSNorm ("gemma")."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if norm_style == "gemma":
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)
