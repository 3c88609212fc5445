"""The new tokens' keys and values into the paged cache, for attention whose rotary the fused rotary kernel
(engine/kernels/triton/rotary.py) does not cover: a hybrid model's gated attention, with its partial rotary, rotates
in torch and stores here. A token whose cache slot is negative (graph padding) writes nothing.

An FP8 cache (engine/model/kv_quant.py) stores each value over its KV head's scale, rounded to nearest e4m3 and
clamped to +-448 (engine/kernels/triton/e4m3.py): the bytes torch's cast writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.e4m3 import to_e4m3
from engine.model.kv_quant import quantize

@triton.jit
def _store(k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
           stride_cs, stride_ch, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
           BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = ((h < KV_HEADS) & (h * 0 + slot >= 0))[:, None] & (d < HEAD_DIM)[None, :]
    cache = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8:
        k = to_e4m3(k, tl.load(scale_ptr + h, mask=h < KV_HEADS, other=1.0)[:, None], k_cache_ptr.dtype.element_ty)
        v = to_e4m3(v, tl.load(scale_ptr + KV_HEADS + h, mask=h < KV_HEADS, other=1.0)[:, None],
                    v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + cache, k, mask=mask)
    tl.store(v_cache_ptr + cache, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """k, v [T, KVH, D] (last dimension contiguous) -> cache slots slot_mapping[t] of k_cache, v_cache
    [slots, KVH, D]; an FP8 cache needs `kv_scale` [2, KVH] (keys', values')."""
    tokens, kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    fp8 = is_fp8(k_cache)
    _store[(tokens,)](k, v, slot_mapping, k_cache, v_cache, kv_scale if fp8 else k_cache, k.stride(0), k.stride(1),
                      v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), KV_HEADS=kv_heads,
                      HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
                      BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8, num_warps=4)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


# Whether the attention kernels widen an e4m3 cache's keys and values, and a 16-bit model's queries, to float16
# (exact for every e4m3 value, and for a bfloat16 query below 65,504 in magnitude) rather than to the query's dtype:
# Hopper converts a pair of e4m3 values to float16 in one instruction, where reaching bfloat16 takes more. Off until
# a GPU measures both (bench.lab.gpu.kernels --only decode --only extend).
E4M3_TO_FLOAT16 = False


def widened(cache: torch.Tensor, query: torch.dtype) -> tl.dtype:
    """The dtype an attention kernel computes in over `cache` for queries of dtype `query`."""
    if is_fp8(cache) and query != torch.float32 and E4M3_TO_FLOAT16:
        return tl.float16
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[query]


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    if is_fp8(k_cache):
        k, v = quantize(k, kv_scale[0]), quantize(v, kv_scale[1])
    k_cache[slot_mapping[keep].long()] = k[keep]
    v_cache[slot_mapping[keep].long()] = v[keep]
