"""The fused MoE's rows path, for decode steps of a few tokens (docs/design.md, Models and kernels; the grouped path and
the weight layout are in engine/kernels/triton/fused_moe.py).

A decode step of a token or a few has about one (token, k) pair per active expert, so the grouped GEMM's tiles would
hold one live row each. Here nothing is sorted: two kernels read each pair's expert in place, both as dots of
activations with weight rows, BLOCK_N weight rows per program, so that hundreds of programs share the stream.
- gate/up: one program per (pair, BLOCK_N columns of the intermediate), writing SiLU(gate) * up. (Routing inside
  this kernel, from the router's logits, was measured on an H200 against routing in a launch of its own: equal at
  batch 1, 4% slower at batch 4, since every program's weight loads wait for twenty block reductions. Routing stays
  engine/kernels/triton/moe_routing.py's one launch.)
- down: one program per (token, BLOCK_N / K output columns), holding the BLOCK_N rows of the token's K experts at
  once, so it adds the K products, times their routing weights, itself: no (pairs x H) intermediate, no summing
  kernel, and the same order of addition every time.
The rounding steps are the reference's (fused_moe_reference): each product rounds to the activations' dtype where
the torch expression rounds it, and the K weighted terms add in float32, rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.dependent_launch import NONE, launch_options, release, wait
from engine.kernels.triton.gemv import norm_prologue, rms

ROWS_MAX_PAIRS = 32  # (token, k) pairs up to which the rows path runs: decode batches of up to 4 tokens at top-8


@dataclass(frozen=True)
class RowsConfig:
    """BLOCK_N weight rows per program in both kernels, read in BLOCK_K slices."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def scaled(w, s_ptr, rows, start, k, k_in, scale_k, W_SCALE: tl.constexpr):
    """An expert weight tile [.., BLOCK_N, BLOCK_K] in fp32, an e4m3 one times its scales per `scale_k` columns
    (W_SCALE 2; with one scale per row, W_SCALE 1, the caller scales the row's sum instead). `s_ptr` points at the
    expert's scales and `rows` indexes them ([.., BLOCK_N, 1]: the row offsets into them)."""
    w = w.to(tl.float32)
    if W_SCALE == 2:
        w = w * tl.load(s_ptr + rows + ((start + k) // scale_k), mask=k < k_in - start, other=0.0)
    return w


@triton.jit
def _gate_up_rows(x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, norm_ptr, eps, hidden, inter, stride_xt, stride_we, stride_wn,
                  stride_se, stride_sn, stride_ht, scale_k, TOP_K: tl.constexpr, W_SCALE: tl.constexpr,
                  NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPENDENT: tl.constexpr):
    """NORM: x is the residual stream, and the products are of rms_norm(x) * norm weight, by gemv's RMSNorm prologue
    (engine/kernels/triton/gemv.py)."""
    wait(DEPENDENT)  # (the expert, hence the weight, comes from the routing before)
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + k
    gate_ptrs = w_ptr + expert * stride_we + (n % inter)[:, None] * stride_wn + k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = gate_ptrs + inter * stride_wn
    s_ptr += expert * stride_se
    gate_rows = (n % inter) * stride_sn  # into the expert's scales
    up_rows = gate_rows + inter * stride_sn
    # Products summed per lane over the K slices and across lanes once at the end: one reduction per program.
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, hidden, BLOCK_K):
        kmask = (k < hidden - start)[None, :]
        a = tl.load(x_ptrs, mask=k < hidden - start, other=0.0).to(tl.float32)
        if NORM:
            a, squares = norm_prologue(a, squares, norm_ptr, start, k, hidden)
        a = a[None, :]
        acc_gate += scaled(tl.load(gate_ptrs, mask=kmask, other=0.0), s_ptr, gate_rows[:, None], start, k[None, :],
                           hidden, scale_k, W_SCALE) * a
        acc_up += scaled(tl.load(up_ptrs, mask=kmask, other=0.0), s_ptr, up_rows[:, None], start, k[None, :], hidden,
                         scale_k, W_SCALE) * a
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    release(DEPENDENT)
    dtype = h_ptr.dtype.element_ty
    gate, up = tl.sum(acc_gate, 1), tl.sum(acc_up, 1)
    if W_SCALE == 1:
        gate = gate * tl.load(s_ptr + gate_rows)
        up = up * tl.load(s_ptr + up_rows)
    if NORM:
        root = rms(squares, hidden, eps)
        gate, up = gate / root, up / root
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + pair.to(tl.int64) * stride_ht + n, h, mask=n < inter)


@triton.jit
def _down_rows(h_ptr, w_ptr, s_ptr, y_ptr, weights_ptr, ids_ptr, inter, hidden, stride_ht, stride_we, stride_wn,
               stride_se, stride_sn, stride_yt, scale_k, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
               ADD_RESIDUAL: tl.constexpr, W_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DEPENDENT: tl.constexpr):
    wait(DEPENDENT)
    token = tl.program_id(0)
    slot = tl.arange(0, K_POW2)
    live = slot < TOP_K
    pair = (token * TOP_K + slot).to(tl.int64)
    expert = tl.load(ids_ptr + pair, mask=live, other=0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    # [K_POW2, BLOCK_N, BLOCK_K] rows of the token's experts against their pairs' activations, which are loaded once
    # per column (from the cache) so that both tiles share one layout: no shuffle through shared memory per slice.
    w_ptrs = (w_ptr + (expert * stride_we)[:, None, None] + (n % hidden)[None, :, None] * stride_wn
              + k[None, None, :])
    h_ptrs = tl.broadcast_to(h_ptr + (pair * stride_ht)[:, None, None] + k[None, None, :], [K_POW2, BLOCK_N, BLOCK_K])
    rows = (expert * stride_se)[:, None] + ((n % hidden) * stride_sn)[None, :]  # into the scales
    acc = tl.zeros([K_POW2, BLOCK_N, BLOCK_K], tl.float32)
    for start in range(0, inter, BLOCK_K):
        mask = live[:, None, None] & (k < inter - start)[None, None, :]
        a = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += scaled(tl.load(w_ptrs, mask=mask, other=0.0), s_ptr, rows[:, :, None], start, k[None, None, :], inter,
                      scale_k, W_SCALE) * a
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    release(DEPENDENT)
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=live, other=0.0)
    product = tl.sum(acc, 2)
    if W_SCALE == 1:
        product = product * tl.load(s_ptr + rows, mask=live[:, None], other=0.0)
    y = (product.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)
    y = tl.sum(y, 0).to(dtype)
    y_ptrs = y_ptr + token.to(tl.int64) * stride_yt + n
    if ADD_RESIDUAL:  # y is the residual stream, added to in place, the sum rounded as the unfused add rounds it
        y = (y.to(tl.float32) + tl.load(y_ptrs, mask=n < hidden, other=0.0).to(tl.float32)).to(dtype)
    tl.store(y_ptrs, y, mask=n < hidden)


@dataclass(frozen=True)
class ExpertScales:
    """An FP8 layer's expert scales: w13's [E, 2I, S] and w2's [E, H, S'] fp32, one per row (S = 1, `scale_k`
    None) or one per `scale_k` columns of a row (block scales expanded to rows, engine/model/fp8.py)."""
    w13: torch.Tensor
    w2: torch.Tensor
    scale_k: int | None


def scale_args(scales: ExpertScales | None, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, tuple, tuple]:
    """The kernels' W_SCALE (0: no scales, 1: per row, 2: per `scale_k` columns) and scale_k, and for w13 and for
    w2 (the scales, their expert stride, their row stride); without scales, the weights stand in as placeholders."""
    if scales is None:
        return 0, 1, (w13, 0, 0), (w2, 0, 0)
    return 1 if scales.scale_k is None else 2, scales.scale_k or 1, \
        (scales.w13, scales.w13.stride(0), scales.w13.stride(1)), (scales.w2, scales.w2.stride(0), scales.w2.stride(1))


def fused_moe_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, c: RowsConfig, residual: torch.Tensor | None = None,
                   scales: ExpertScales | None = None, dependent: int = NONE,
                   norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """fused_moe's rows path: pair p = t*K + k reads token t and expert topk_ids[t, k] directly. topk_weights [T, K]
    float32 and topk_ids [T, K] int32, contiguous. With a residual [T, H], the result is added to it in place; with
    `scales`, the expert weights are e4m3. `dependent`: both kernels launched as dependent launches
    (engine/kernels/triton/dependent_launch.py). `norm` (weight [H], eps): the experts take rms_norm(x) * weight,
    normalised inside the gate/up kernel (x may then be the residual itself)."""
    tokens, hidden = x.shape
    inter, top_k = w2.shape[2], topk_ids.shape[1]
    k_pow2 = triton.next_power_of_2(top_k)
    mode, scale_k, (s13, s13_e, s13_n), (s2, s2_e, s2_n) = scale_args(scales, w13, w2)
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _gate_up_rows[(tokens * top_k, triton.cdiv(inter, c.block_n))](
        x, w13, s13, h, topk_ids, norm[0] if norm else x, norm[1] if norm else 0.0, hidden, inter, x.stride(0),
        w13.stride(0), w13.stride(1), s13_e, s13_n, h.stride(0), scale_k, TOP_K=top_k, W_SCALE=mode,
        NORM=norm is not None, BLOCK_N=c.block_n, BLOCK_K=c.block_k, DEPENDENT=dependent, num_warps=c.num_warps,
        num_stages=c.num_stages, **launch_options(dependent))
    y = residual if residual is not None else torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    down_n = max(1, c.block_n // k_pow2)  # output columns per program: BLOCK_N weight rows over the K experts
    _down_rows[(tokens, triton.cdiv(hidden, down_n))](
        h, w2, s2, y, topk_weights, topk_ids, inter, hidden, h.stride(0), w2.stride(0), w2.stride(1), s2_e, s2_n,
        y.stride(0), scale_k, TOP_K=top_k,
        K_POW2=k_pow2, ADD_RESIDUAL=residual is not None, W_SCALE=mode, BLOCK_N=down_n, BLOCK_K=c.block_k,
        DEPENDENT=dependent, num_warps=c.num_warps, num_stages=c.num_stages, **launch_options(dependent))
    return y
