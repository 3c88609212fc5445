"""FP8 products: e4m3 weights with fp32 scales per output channel or per block (engine/model/fp8.py holds the core's
layout; docs/design.md, Models and kernels).

The kernels read the weight scales as [N, S]: one row per output row, S = 1 per channel, or S = ceil(K / bk) for
blocks of bk columns (a block checkpoint's [N / bn, K / bk] scales repeated over each block's bn rows at load, so that
the parts of a fused q/k/v or gate/up product concatenate whatever their rows: 1/32 of the weight's bytes at bk = 128).

- the decode path is the GEMV's (engine/kernels/triton/gemv.py): weights dequantized in registers, the activations as
  they are (bf16 or fp32), fp32 sums; `fp8_weight_only_reference` is its reference here.
- `fp8_gemm`: prefill and large batches. The activations are quantized per token (`quantize_rows`: scale =
  max|x| / 448 of the row, values rounded to nearest), then e4m3 x e4m3 products accumulate in fp32 tile by tile;
  each K tile lies inside one scale block (BLOCK_K divides bk), so its partial product takes its block's scale, and
  the row's activation scale multiplies the end.
- split K (`split_k` of either GEMM's configuration): a step of few rows has few output tiles, too few programs for
  the multiprocessors to stream the weight at its bandwidth (64 rows of q/k/v in 64 x 64 tiles: 96 programs on 132
  multiprocessors). Each tile's K range is then split among `split_k` programs; each writes its scaled fp32 sums,
  and `_sum_splits` adds them in split order (the same numbers in a graph and eagerly), adds the bias and casts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.e4m3 import to_e4m3

E4M3_MAX = 448.0
SUM_BLOCK_N = 1024  # _sum_splits' columns a program


@dataclass(frozen=True)
class E4m3Rows:
    """Activations already quantized per token as quantize_rows makes them, by the kernel before the product (the
    RMSNorm's or SiLU-and-mul's: rmsnorm.add_rms_norm_e4m3, activation.silu_and_mul_e4m3); `dtype`: the product's."""
    values: torch.Tensor  # [T, K] e4m3
    scales: torch.Tensor  # [T] fp32
    dtype: torch.dtype


@triton.jit
def row_scale(largest):
    """A row's scale from its largest magnitude: times the reciprocal of 448, as the reference computes it (torch
    divides by a number that way on a GPU); a row of zeros takes 1 (any scale gives zeros). The values are then
    divided by it correctly rounded (to_e4m3), as torch divides by a tensor."""
    scale = largest * (1.0 / 448.0)
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def store_e4m3_row(y, ptrs, mask, scale_ptr):
    """A whole row y (fp32, in registers; zeros where not `mask`) stored as e4m3 values at `ptrs` over its scale,
    stored at `scale_ptr`: what quantize_rows makes of it."""
    scale = row_scale(tl.max(tl.abs(y), 0))
    tl.store(ptrs, to_e4m3(y, scale, ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, k_in, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    largest = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, k_in, BLOCK_K):
        a = tl.load(x_ptr + row * stride_x + start + k, mask=start + k < k_in, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(a))
    scale = row_scale(tl.max(largest, 0))
    for start in range(0, k_in, BLOCK_K):
        inside = start + k < k_in
        a = tl.load(x_ptr + row * stride_x + start + k, mask=inside, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + start + k, to_e4m3(a, scale, q_ptr.dtype.element_ty),
                 mask=inside)
    tl.store(s_ptr + row, scale)


@triton.jit
def _gemm(a_ptr, sa_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, m_rows, n_out, k_in, stride_a, stride_w,
          stride_s, stride_o, scale_k, E4M3_A: tl.constexpr, IEEE: tl.constexpr, PER_CHANNEL: tl.constexpr,
          HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """E4M3_A: the activations are e4m3 with a scale per row (sa_ptr), multiplied by the weight as e4m3; otherwise
    they are as they are (16-bit or fp32: IEEE, not as tf32) and each weight tile is dequantized to their dtype.
    SPLIT_K > 1: program (tile, s) sums the s-th of SPLIT_K runs of K tiles into part_ptr [SPLIT_K, M, N] (fp32,
    scaled, without the bias)."""
    # Programs in groups of GROUP_M row tiles walk the column tiles together: a weight tile read from memory serves
    # the group's rows from the L2 cache.
    tiles_m, tiles_n = tl.cdiv(m_rows, BLOCK_M), tl.cdiv(n_out, BLOCK_N)
    pid = tl.program_id(0)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    m = (first_m + (pid % group_m)) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = ((pid % (GROUP_M * tiles_n)) // group_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_safe = (m % m_rows).to(tl.int64)  # wrapped rows and columns: no masks on M and N in the loop
    n_safe = (n % n_out).to(tl.int64)
    k_tiles = tl.cdiv(k_in, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = tl.program_id(1) * per_split * BLOCK_K
    last = tl.minimum(first + per_split * BLOCK_K, k_in)
    a_ptrs = a_ptr + m_safe[:, None] * stride_a + first + k[None, :]
    b_ptrs = w_ptr + n_safe[None, :] * stride_w + first + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(first, last, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(k < k_in - start)[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=(k < k_in - start)[:, None], other=0.0)
        if E4M3_A:
            # Hopper's FP8 MMA keeps its sums in fewer bits than fp32 unless told how many products to add that
            # way (Triton's default there: all of them); a tile's worth, then into the fp32 accumulator.
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        elif IEEE:
            part = tl.dot(a, b.to(a.dtype), input_precision="ieee")  # exact: e4m3 values are fp32 values
        else:
            part = tl.dot(a, b.to(a.dtype))  # and 16-bit values
        if PER_CHANNEL:
            acc += part
        else:
            acc += part * tl.load(s_ptr + n_safe * stride_s + start // scale_k)[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + n_safe * stride_s)[None, :]
    if E4M3_A:
        acc = acc * tl.load(sa_ptr + m_safe)[:, None]
    inside = (m < m_rows)[:, None] & (n < n_out)[None, :]
    if SPLIT_K > 1:
        part = part_ptr + (tl.program_id(1) * m_rows + m.to(tl.int64))[:, None] * n_out + n[None, :]
        tl.store(part, acc, mask=inside)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_safe).to(tl.float32)[None, :]
        out = out_ptr + m.to(tl.int64)[:, None] * stride_o + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sum_splits(part_ptr, bias_ptr, out_ptr, m_rows, n_out, stride_o, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """out[m] = the SPLIT_K partial sums of row m, added in split order (+ bias), in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = n < n_out
    acc = tl.zeros([BLOCK_N], tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(part_ptr + (split * m_rows + row) * n_out + n, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=inside)


@dataclass(frozen=True)
class GemmConfig:
    """BLOCK_M x BLOCK_N output tiles, GROUP_M row tiles walking the columns together, each tile's K range split
    among `split_k` programs."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1


# By the rows of a step: (most rows, config), the first that takes them (bench/lab/gpu/fp8.py's sweep on an H200).
GEMM_CONFIGS = [(128, GemmConfig(64, 64, 4, 4)), (4096, GemmConfig(64, 128, 4, 4)),
                (None, GemmConfig(128, 128, 8, 4))]


def gemm_config(rows: int) -> GemmConfig:
    return next(config for most, config in GEMM_CONFIGS if most is None or rows <= most)


@dataclass(frozen=True)
class DequantizedConfig:
    """fp8_dequantized_gemm's BLOCK_M x BLOCK_N tiles (BLOCK_M at most: a step of fewer rows takes fewer, from 16)
    over BLOCK_K columns a load (at most a scale block's), each tile's K range split among `split_k` programs."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


DEQUANTIZED_CONFIG = DequantizedConfig(16, 32, 256, 4, 4)  # fp32 rows fit its shared memory too


def _checked(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, scale_k: int | None) -> tuple[int, int, int]:
    """(N, K, bk) of a product, bk the columns of a scale (K for one scale per row: `scale_k` None)."""
    n_out, k_in = values.shape
    scale_k = scale_k or k_in
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (n_out, -(-k_in // scale_k)), (scale.shape, values.shape, scale_k)
    assert x.shape[-1] == k_in and x.stride(-1) == 1 and values.stride(-1) == 1 and scale.stride(-1) == 1
    return n_out, k_in, scale_k


def gemm_block_k(scale_k: int, k_in: int) -> int | None:
    """The K tile of fp8_gemm for scale blocks of `scale_k` columns: the largest power of two up to 128 dividing them
    (at least 32, the smallest K of an 8-bit tl.dot), or None where none does (such a product takes
    the GEMV)."""
    if scale_k >= k_in:
        return 128
    block = 128
    while block >= 32 and scale_k % block:
        block //= 2
    return block if block >= 32 else None


def quantize_rows(x: torch.Tensor, block_k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as e4m3 values [T, K] and one fp32 scale per row [T]: max|x| / 448."""
    assert x.stride(-1) == 1
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _quantize_rows[(x.shape[0],)](x, values, scales, x.shape[1], x.stride(0), values.stride(0), BLOCK_K=block_k)
    return values, scales


def fp8_gemm(x: torch.Tensor | E4m3Rows, values: torch.Tensor, scale: torch.Tensor, scale_k: int | None,
             bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [T, K] quantized per token (or already so), times the FP8 weight [N, K]^T (+ bias), in x's dtype; the scale
    blocks' columns must take a K tile (gemm_block_k). config: gemm_config(T) when not given."""
    a, a_scale = e4m3_rows(x)
    n_out, k_in, scale_k = _checked(a, values, scale, scale_k)
    block_k = gemm_block_k(scale_k, k_in)
    assert block_k is not None, f"scale blocks of {scale_k} columns take no K tile"
    config = config or gemm_config(a.shape[0])
    return _launch(a, a_scale, values, scale, scale_k, bias, x.dtype, config.block_m, config.block_n, block_k,
                   config.group_m, config.num_warps, config.num_stages, config.split_k)


def e4m3_rows(x: torch.Tensor | E4m3Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 product's activations as e4m3 values and a scale per row: quantize_rows, unless already made."""
    return (x.values, x.scales) if isinstance(x, E4m3Rows) else quantize_rows(x)


def _launch(a: torch.Tensor, a_scale: torch.Tensor | None, values: torch.Tensor, scale: torch.Tensor, scale_k: int,
            bias: torch.Tensor | None, dtype: torch.dtype, block_m: int, block_n: int, block_k: int, group_m: int,
            num_warps: int, num_stages: int, split_k: int) -> torch.Tensor:
    """_gemm over a [T, K]: e4m3 with `a_scale` per row, or as it is (a_scale None); with split_k > 1, then
    _sum_splits."""
    (rows, k_in), n_out = a.shape, values.shape[0]
    out = torch.empty(rows, n_out, dtype=dtype, device=a.device)
    split_k = min(split_k, triton.cdiv(k_in, block_k))  # (no program without a K tile)
    part = torch.empty(split_k, rows, n_out, dtype=torch.float32, device=a.device) if split_k > 1 else out
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n_out, block_n), split_k)
    _gemm[grid](a, a_scale if a_scale is not None else scale, values, scale, bias if bias is not None else scale, out,
                part, rows, n_out, k_in, a.stride(0), values.stride(0), scale.stride(0), out.stride(0), scale_k,
                E4M3_A=a_scale is not None, IEEE=a.dtype == torch.float32, PER_CHANNEL=scale_k >= k_in,
                HAS_BIAS=bias is not None, EVEN_K=k_in % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, GROUP_M=group_m, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        _sum_splits[(rows, triton.cdiv(n_out, SUM_BLOCK_N))](part, bias if bias is not None else part, out, rows,
                                                             n_out, out.stride(0), HAS_BIAS=bias is not None,
                                                             SPLIT_K=split_k, BLOCK_N=SUM_BLOCK_N)
    return out


def fp8_dequantized_gemm(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, scale_k: int | None,
                         bias: torch.Tensor | None = None, config: DequantizedConfig | None = None) -> torch.Tensor:
    """x [T, K] (16-bit or fp32, as it is) times the FP8 weight [N, K]^T (+ bias), in x's dtype: the weight tiles
    dequantized to x's dtype in registers, on the tensor cores (fp32 exactly, not as tf32), fp32 sums. For decode
    batches: the weight read once for all their rows, no activation quantization. Scale blocks must take a K tile
    (gemm_block_k)."""
    n_out, k_in, scale_k = _checked(x, values, scale, scale_k)
    config = config or DEQUANTIZED_CONFIG
    block_k = min(config.block_k, gemm_block_k(scale_k, k_in) if scale_k < k_in else config.block_k)
    block_m = min(config.block_m, max(16, triton.next_power_of_2(x.shape[0])))
    return _launch(x, None, values, scale, scale_k, bias, x.dtype, block_m, config.block_n, block_k, 8,
                   config.num_warps, config.num_stages, config.split_k)


def fp8_scaled_mm(x: torch.Tensor | E4m3Rows, values: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_gemm's product for one scale per output row, by cuBLASLt (torch._scaled_mm with row-wise scales): the
    activations quantized per token as fp8_gemm quantizes them."""
    a, a_scale = e4m3_rows(x)
    _checked(a, values, scale, None)
    return torch._scaled_mm(a, values.T, scale_a=a_scale[:, None], scale_b=scale.T, bias=bias, out_dtype=x.dtype)


def dequantized(values: torch.Tensor, scale: torch.Tensor, scale_k: int | None) -> torch.Tensor:
    """The fp32 weight of values [N, K] and the kernels' scales [N, S] of `scale_k` columns each."""
    return values.float() * scale.repeat_interleave(scale_k or values.shape[1], dim=1)[:, :values.shape[1]]


def fp8_weight_only_reference(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, scale_k: int | None,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ dequantized(values, scale, scale_k).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.float().abs().amax(dim=1) * (1 / E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def fp8_gemm_reference(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, scale_k: int | None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    a, a_scale = quantize_rows_reference(x)
    y = (a.float() * a_scale[:, None]) @ dequantized(values, scale, scale_k).T
    return (y if bias is None else y + bias.float()).to(x.dtype)
