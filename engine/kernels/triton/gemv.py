"""Linear layers for steps of a few rows (a decode step of one sequence), with what surrounds them fused in
(docs/design.md, Models and kernels: the batch-1 step).

At batch 1 a decoder layer is four weight streams; cuBLAS reads the big ones near the copy bandwidth but splits the
small ones (q/k/v, o) over K and sums the parts in a kernel of its own, and around them sit an add+RMSNorm, a SiLU
and the split-K reduces: a quarter of the 8B's step beside the weights. Here one kernel per projection reads the
weight once, BLOCK_N rows per program over the whole of K (so each output has one owner), and takes in
- a prologue on its input: RMSNorm (the weights' product with x * norm_weight, scaled by 1/rms at the end, the sum
  of squares gathered in the same loop: nothing waits for a reduction before the first weight load), or
  SiLU(gate) * up of a fused [gate | up] input, rounded as silu_and_mul rounds it;
- an epilogue: the bias, and the residual add written in place, so the residual stream is updated by the
  projections that end each branch (o and down) and no add+norm kernel runs between layers.
The RMSNorm prologue does not round the normalised row to the activations' dtype before the product (the unfused
path does): within the kernel tests' tolerance of the reference, and the same in eager steps and in graphs.

The weight may be FP8 (e4m3 values with fp32 scales, engine/kernels/triton/fp8_linear.py's layout): a scale per
output row multiplies the row's sum once; block scales multiply each value as it is dequantized in registers. A step
of one token then reads one byte a weight.

Launched as a dependent kernel (engine/kernels/triton/dependent_launch.py; `dependent`), a program waits for the
kernel before it either first (WAIT_FIRST) or after reading its first slice of the weight (PREFETCH), which no step
writes: the load is then in flight while the kernel before drains. Only PREFETCH takes the first slice out of the K
loop, whose pipelining would otherwise load it beside the next ones. PREFETCH_EARLY lets the next kernel's programs
be placed once this one's have all started rather than once they have read their weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.dependent_launch import NONE, launch_options, release, wait
from engine.kernels.triton.fp8_linear import dequantized

# Rows up to which a step's projections take this path: at 2 and 4 rows cuBLAS was faster on every 8B projection
# (bench/lab/gpu/gemv.py on an H200), at 1 this kernel on each.
MAX_ROWS = 1
NO_PROLOGUE, RMS_NORM, SILU_MUL = 0, 1, 2


@dataclass(frozen=True)
class GemvConfig:
    """BLOCK_N weight rows per program, read in BLOCK_K slices."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The sweep's best at one row for every 8B projection (bench/lab/gpu/gemv.py on an H200; docs/gpu.md).
DEFAULT_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)
# FP8 weights at one row (bench/lab/gpu/fp8.py on an H200): 1,024 columns a load (DEFAULT_CONFIG's bytes) for the
# narrow or long products (the 8B's o and down), 512 for the wide ones, whose programs outnumber the SMs many times.
FP8_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3)
FP8_WIDE_CONFIG = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)


def fp8_config(n_out: int, k_in: int) -> GemvConfig:
    return FP8_WIDE_CONFIG if n_out > 4096 and k_in <= 8192 else FP8_CONFIG


NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2


@triton.jit
def _weight_slice(w_ptrs, start, k, k_in, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_ptrs + start)
    else:
        w = tl.load(w_ptrs + start, mask=(k < k_in - start)[None, :], other=0.0)
    return w


@triton.jit
def norm_prologue(a, squares, norm_ptr, start, k, k_in):
    """The RMSNorm prologue on the input slice `a` (fp32) at column `start`: times the norm weight, its squares
    gathered for `rms`; the product's sum is divided by the rms at the end, so no load waits for a reduction."""
    squares += a * a
    return a * tl.load(norm_ptr + start + k, mask=k < k_in - start, other=0.0).to(tl.float32), squares


@triton.jit
def rms(squares, k_in, eps):
    """The row's root mean square (plus eps) from the prologue's squares."""
    return tl.sqrt(tl.sum(squares, 0) / k_in + eps)


@triton.jit
def _accumulate(acc, squares, w, x_ptrs, s_ptr, norm_ptr, rows, k, start, k_in, stride_s, scale_k,
                PROLOGUE: tl.constexpr, W_SCALE: tl.constexpr, EVEN_K: tl.constexpr, dtype: tl.constexpr):
    """acc (and the RMSNorm's squares) with the products of weight slice `w`, the one at column `start`."""
    if EVEN_K:
        a = tl.load(x_ptrs + start).to(tl.float32)
    else:
        a = tl.load(x_ptrs + start, mask=k < k_in - start, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        a, squares = norm_prologue(a, squares, norm_ptr, start, k, k_in)
    elif PROLOGUE == 2:
        up = tl.load(x_ptrs + start + k_in, mask=k < k_in - start, other=0.0).to(tl.float32)
        silu = (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32)
        a = (silu * up).to(dtype).to(tl.float32)
    w = w.to(tl.float32)
    if W_SCALE == 2:
        w = w * tl.load(s_ptr + rows[:, None] * stride_s + ((start + k) // scale_k)[None, :],
                        mask=(k < k_in - start)[None, :], other=0.0)
    return acc + w * a[None, :], squares


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, bias_ptr, norm_ptr, out_ptr, n_out, k_in, stride_x, stride_w, stride_s, stride_o,
          scale_k, eps, PROLOGUE: tl.constexpr, W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
          ADD_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          DEPENDENT: tl.constexpr):
    # The row is the grid's fastest dimension: the programs of one weight block run side by side, so a step of a
    # few rows reads each block from memory once and from the L2 cache for the other rows.
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    rows = (n % n_out).to(tl.int64)  # wrapped rows: no mask on N
    w_ptrs = w_ptr + rows[:, None] * stride_w + k[None, :]
    x_ptrs = x_ptr + row * stride_x + k
    # Products summed per lane over the K slices and across lanes once at the end: one reduction per program.
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    first = 0
    if DEPENDENT == 1:  # WAIT_FIRST
        wait(DEPENDENT)
    if DEPENDENT >= 2:  # PREFETCH: the first slice's load in flight across the wait, the loop from the second on
        w = _weight_slice(w_ptrs, 0, k, k_in, EVEN_K)
        if DEPENDENT == 3:  # PREFETCH_EARLY
            release(DEPENDENT)
        wait(DEPENDENT)
        acc, squares = _accumulate(acc, squares, w, x_ptrs, s_ptr, norm_ptr, rows, k, 0, k_in, stride_s, scale_k,
                                   PROLOGUE, W_SCALE, EVEN_K, dtype)
        first = BLOCK_K
    for start in range(first, k_in, BLOCK_K):
        w = _weight_slice(w_ptrs, start, k, k_in, EVEN_K)
        acc, squares = _accumulate(acc, squares, w, x_ptrs, s_ptr, norm_ptr, rows, k, start, k_in, stride_s,
                                   scale_k, PROLOGUE, W_SCALE, EVEN_K, dtype)
    if DEPENDENT != 3:
        release(DEPENDENT)  # the next kernel's programs may be placed as this one's last ones finish
    y = tl.sum(acc, 1)
    if W_SCALE == 1:
        y = y * tl.load(s_ptr + rows * stride_s)
    if PROLOGUE == 1:
        y = y / rms(squares, k_in, eps)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    y = y.to(dtype)
    out_ptrs = out_ptr + row * stride_o + n
    if ADD_RESIDUAL:  # out is the residual, added to in place, rounded as the unfused add: the product, then the sum
        y = (y.to(tl.float32) + tl.load(out_ptrs, mask=n < n_out, other=0.0).to(tl.float32)).to(dtype)
    tl.store(out_ptrs, y, mask=n < n_out)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         scale: torch.Tensor | None = None, scale_k: int | None = None,
         norm: tuple[torch.Tensor, float] | None = None, silu_mul: bool = False,
         residual: torch.Tensor | None = None, config: GemvConfig | None = None,
         dependent: int = NONE) -> torch.Tensor:
    """x [T, K] times weight [N, K]^T (+ bias), with
    - scale [N, S] for an e4m3 weight: S = 1 per output row (`scale_k` None), or one per `scale_k` columns;
    - norm (norm_weight [K], eps): of rms_norm(x) * norm_weight instead of x;
    - silu_mul: x is [T, 2K], a fused [gate | up], and the product is of SiLU(gate) * up;
    - residual [T, N]: the result is added to it, in place, and it is returned.
    config: DEFAULT_CONFIG (fp8_config's for an e4m3 weight) when not given. dependent: a dependent launch's kind
    (engine/kernels/triton/dependent_launch.py), where dependent_launch.supported(x.device)."""
    rows = x.shape[0]
    n_out, k_in = weight.shape
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and not (norm and silu_mul)
    assert x.shape[1] == (2 * k_in if silu_mul else k_in)
    assert (scale is not None) == (weight.dtype == torch.float8_e4m3fn)
    w_scale = NO_SCALE if scale is None else ROW_SCALE if scale_k is None or scale_k >= k_in else BLOCK_SCALE
    if scale is not None:
        assert scale.dtype == torch.float32 and scale.stride(-1) == 1
        assert scale.shape == (n_out, 1 if w_scale == ROW_SCALE else -(-k_in // scale_k)), (scale.shape, scale_k)
    config = config or (DEFAULT_CONFIG if scale is None else fp8_config(n_out, k_in))
    out = residual if residual is not None else torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    prologue = RMS_NORM if norm is not None else SILU_MUL if silu_mul else NO_PROLOGUE
    scale = scale if scale is not None else x  # unread without a scale
    _gemv[(rows, triton.cdiv(n_out, config.block_n))](
        x, weight, scale, bias if bias is not None else x, norm_weight, out, n_out, k_in, x.stride(0),
        weight.stride(0), scale.stride(0), out.stride(0), scale_k or k_in, eps, PROLOGUE=prologue, W_SCALE=w_scale,
        HAS_BIAS=bias is not None, ADD_RESIDUAL=residual is not None, EVEN_K=k_in % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, DEPENDENT=dependent, num_warps=config.num_warps,
        num_stages=config.num_stages, **launch_options(dependent))
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   scale: torch.Tensor | None = None, scale_k: int | None = None,
                   norm: tuple[torch.Tensor, float] | None = None, silu_mul: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused torch expression gemv computes (not in place); an e4m3 weight dequantized in x's dtype."""
    if scale is not None:
        weight = dequantized(weight, scale, scale_k).to(x.dtype)
    if norm is not None:
        x32 = x.float()
        x = norm[0] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm[1])).to(x.dtype)
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    y = torch.nn.functional.linear(x, weight, bias)
    return y if residual is None else y + residual
