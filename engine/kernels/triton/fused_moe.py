"""Fused mixture-of-experts MLP: top-k routing, tokens grouped by expert, two grouped GEMMs (docs/design.md, Models and
kernels).

Experts of one layer are stored as `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`, so the kernels
read them in place. A (token, k) pair is one row of work: `align_by_expert` sorts the pairs by expert and pads each
expert's run to a multiple of BLOCK_M, so that every BLOCK_M rows of the sorted list belong to one expert. It runs on
the device with no host sync and buffers sized by T alone, so a graph captured at a fixed T replays any routing.
The first GEMM multiplies each block by its expert's w13 and applies SiLU(gate) * up; the second multiplies by w2
and the pair's routing weight; the K rows of a token are then summed. Rounding follows the reference: each product
rounds to the activations' dtype where the torch expression rounds it.

A decode step of a token or a few has about one pair per active expert, so each 16-row tile of the grouped GEMM
holds one live row and a few dozen programs stream all the experts' weights (about 0.5 TB/s on an H200). Up to
ROWS_MAX_PAIRS pairs take the rows path instead (engine/kernels/triton/moe_rows.py): no sort, hundreds of programs share
the stream, and its second kernel sums a token's experts itself. Routing is engine/kernels/triton/moe_routing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.triton.decode_attention import dot_precision
from engine.kernels.triton.dependent_launch import NONE
from engine.kernels.triton.moe_rows import ROWS_MAX_PAIRS, ExpertScales, RowsConfig, fused_moe_rows, scale_args, scaled


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows (token, k pairs) per block; the alignment unit of align_by_expert
    block_n: int
    block_k: int
    group_m: int  # row blocks that share a column sweep, so their expert's weight tiles stay in L2
    num_warps: int
    num_stages: int


def moe_config(pairs: int, num_experts: int) -> MoeConfig | RowsConfig:
    """The rows path for a few pairs; for more, small blocks when experts see a token or two (decode: the weights'
    bandwidth is all), larger ones when each expert gets many rows (prefill: the tensor cores)."""
    if pairs <= ROWS_MAX_PAIRS:
        return RowsConfig(16, 256, 4, 3)
    if pairs <= num_experts:
        return MoeConfig(16, 64, 128, 1, 4, 3)
    if pairs <= 8 * num_experts:
        return MoeConfig(32, 64, 64, 4, 4, 3)
    return MoeConfig(64, 128, 64, 8, 8, 3)


ONE_PROGRAM_PAIRS = 2048  # up to this many pairs (decode batches) one Triton program aligns them in one launch
ALIGN_CHUNK = 128


def align_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted list may need: each expert that has pairs wastes at most block_m - 1 rows, and at most
    `pairs` experts have any."""
    capacity = min(pairs + num_experts * (block_m - 1), pairs * block_m)
    return -(-capacity // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] int32 -> the pairs (index t*K + k) sorted by expert, stable, each expert's run padded to a
    multiple of block_m with the index T*K (no pair); the expert of each block of block_m rows; and the padded total
    [1]. Blocks past the total are listed (the buffers are sized for the worst case) and the kernels skip them."""
    flat = topk_ids.flatten()
    if flat.numel() <= ONE_PROGRAM_PAIRS:
        return align_in_one_program(flat, num_experts, block_m)
    return align_with_torch(flat, num_experts, block_m)


@triton.jit
def _align(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, pairs, capacity, num_experts, BLOCK_M: tl.constexpr,
           E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.arange(0, E_POW2)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_POW2], tl.int32)
    for start in range(0, pairs, CHUNK):
        ids = tl.load(ids_ptr + start + c, mask=start + c < pairs, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(total_ptr, tl.sum(padded, 0))
    for start in range(0, capacity, CHUNK):
        tl.store(sorted_ptr + start + c, c * 0 + pairs, mask=start + c < capacity)
    blocks = capacity // BLOCK_M
    for start in range(0, blocks, CHUNK):
        b = start + c
        expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)  # searchsorted, right side
        tl.store(block_expert_ptr + b, tl.minimum(expert, num_experts - 1), mask=b < blocks)
    tl.debug_barrier()  # the padding fill lands before any pair's own row
    taken = ends - padded  # the next free row of each expert
    for start in range(0, pairs, CHUNK):
        pair = start + c
        ids = tl.load(ids_ptr + pair, mask=pair < pairs, other=-1)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # earlier pairs of the same expert in this chunk
        tl.store(sorted_ptr + tl.sum(onehot * taken[None, :], 1) + rank, pair, mask=pair < pairs)
        taken += tl.sum(onehot, 0)


def align_in_one_program(flat_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_by_expert in one launch: decode steps call it every layer, where a dozen small torch kernels cost more
    than the experts' GEMMs."""
    pairs = flat_ids.numel()
    capacity = align_capacity(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=flat_ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat_ids.device)
    total = torch.empty(1, dtype=torch.int32, device=flat_ids.device)
    _align[(1,)](flat_ids, sorted_pairs, block_expert, total, pairs, capacity, num_experts,
                 BLOCK_M=block_m, E_POW2=triton.next_power_of_2(num_experts), CHUNK=ALIGN_CHUNK, num_warps=4)
    return sorted_pairs, block_expert, total


def align_with_torch(flat_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_by_expert in torch operations (a device sort), for prefill-sized batches; no host sync either."""
    pairs = flat_ids.numel()
    capacity = align_capacity(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids.long(), torch.ones_like(flat_ids, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    experts, order = torch.sort(flat_ids, stable=True)
    experts = experts.long()
    rank = torch.arange(pairs, device=flat_ids.device) - (counts.cumsum(0) - counts)[experts]
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=flat_ids.device)
    sorted_pairs[(ends - padded)[experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat_ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _block_coords(num_blocks_m, num_n, GROUP_M: tl.constexpr):
    """This program's (row block, column block), walking GROUP_M row blocks down each column sweep."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _gate_up(x_ptr, w_ptr, s_ptr, h_ptr, pairs_ptr, block_expert_ptr, total_ptr, num_pairs, num_blocks_m,
             hidden, inter, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ht, scale_k,
             TOP_K: tl.constexpr, W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _block_coords(num_blocks_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + k[None, :]
    gate_ptrs = w_ptr + expert * stride_we + (n % inter)[None, :] * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + inter * stride_wn
    s_ptr += expert * stride_se
    gate_rows = (n % inter) * stride_sn  # into the expert's scales
    up_rows = gate_rows + inter * stride_sn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, hidden, BLOCK_K):
        kmask = k < hidden - start
        a = tl.load(x_ptrs, mask=live[:, None] & kmask[None, :], other=0.0)
        gate_w = tl.load(gate_ptrs, mask=kmask[:, None], other=0.0)
        up_w = tl.load(up_ptrs, mask=kmask[:, None], other=0.0)
        if W_SCALE != 0:  # e4m3 weights, dequantized in registers to the activations' dtype
            gate_w = scaled(gate_w, s_ptr, gate_rows[None, :], start, k[:, None], hidden, scale_k, W_SCALE).to(a.dtype)
            up_w = scaled(up_w, s_ptr, up_rows[None, :], start, k[:, None], hidden, scale_k, W_SCALE).to(a.dtype)
        acc_gate = tl.dot(a, gate_w, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up_w, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc_gate = acc_gate * tl.load(s_ptr + gate_rows)[None, :]
        acc_up = acc_up * tl.load(s_ptr + up_rows)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + pair.to(tl.int64)[:, None] * stride_ht + n[None, :], h, mask=live[:, None] & (n < inter)[None, :])


@triton.jit
def _down(h_ptr, w_ptr, s_ptr, y_ptr, weights_ptr, pairs_ptr, block_expert_ptr, total_ptr, num_pairs,
          num_blocks_m, inter, hidden, stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_yt, scale_k,
          W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _block_coords(num_blocks_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < num_pairs
    pair = pair.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair[:, None] * stride_ht + k[None, :]
    w_ptrs = w_ptr + expert * stride_we + (n % hidden)[None, :] * stride_wn + k[:, None]
    s_ptr += expert * stride_se
    rows = (n % hidden) * stride_sn  # into the expert's scales
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inter, BLOCK_K):
        kmask = k < inter - start
        a = tl.load(h_ptrs, mask=live[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
        if W_SCALE != 0:
            w = scaled(w, s_ptr, rows[None, :], start, k[:, None], inter, scale_k, W_SCALE).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:
        acc = acc * tl.load(s_ptr + rows)[None, :]
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=live, other=0.0)
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(y_ptr + pair[:, None] * stride_yt + n[None, :], y, mask=live[:, None] & (n < hidden)[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | RowsConfig | None = None,
              residual: torch.Tensor | None = None, scales: ExpertScales | None = None,
              dependent: int = NONE, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K] int32 -> [T, H].
    With a residual [T, H], the result is added to it in place and it is returned. With `scales`, w13 and w2 are
    e4m3 (an FP8 core's experts), dequantized in registers. `dependent`: the rows path's launch
    (engine/kernels/triton/dependent_launch.py); the grouped path launches plainly. `norm`: the rows path's RMSNorm
    of x (fused_moe_rows)."""
    check_shapes(x, w13, w2)
    pairs = topk_ids.numel()
    if pairs == 0:
        return torch.zeros_like(x) if residual is None else residual
    # Once here, so that neither path converts per kernel (no-ops when the routing came from route_in_one_program).
    weights, ids = topk_weights.float().contiguous(), topk_ids.to(torch.int32).contiguous()
    c = config or moe_config(pairs, w2.shape[0])
    if scales is not None and x.element_size() == 4 and isinstance(c, MoeConfig):
        # fp32 activations widen each e4m3 weight tile to fp32 through shared memory: three stages of the largest
        # tiles need 256 KiB, over Hopper's 227.
        c = replace(c, num_stages=min(c.num_stages, 2))
    if isinstance(c, RowsConfig):
        return fused_moe_rows(x, w13, w2, weights, ids, c, residual, scales, dependent, norm)
    assert norm is None, "only the rows path normalises its input"
    out = fused_moe_grouped(x, w13, w2, weights, ids, c, scales)
    return out if residual is None else residual.add_(out)


def check_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    experts, hidden, inter = w2.shape
    assert x.shape[1] == hidden and w13.shape == (experts, 2 * inter, hidden)
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, c: MoeConfig, scales: ExpertScales | None = None) -> torch.Tensor:
    """fused_moe's grouped path: topk_weights float32 and topk_ids int32, contiguous."""
    tokens, hidden = x.shape
    experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    sorted_pairs, block_expert, total = align_by_expert(topk_ids, experts, c.block_m)
    blocks_m = block_expert.numel()
    precision = dot_precision(x.dtype)
    mode, scale_k, (s13, s13_e, s13_n), (s2, s2_e, s2_n) = scale_args(scales, w13, w2)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up[(blocks_m * triton.cdiv(inter, c.block_n),)](
        x, w13, s13, h, sorted_pairs, block_expert, total, pairs, blocks_m, hidden, inter, x.stride(0),
        w13.stride(0), w13.stride(1), s13_e, s13_n, h.stride(0), scale_k, TOP_K=top_k, W_SCALE=mode,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, PRECISION=precision,
        num_warps=c.num_warps, num_stages=c.num_stages)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _down[(blocks_m * triton.cdiv(hidden, c.block_n),)](
        h, w2, s2, y, topk_weights, sorted_pairs, block_expert, total, pairs, blocks_m, inter, hidden,
        h.stride(0), w2.stride(0), w2.stride(1), s2_e, s2_n, y.stride(0), scale_k, W_SCALE=mode,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, PRECISION=precision,
        num_warps=c.num_warps, num_stages=c.num_stages)
    return y.view(tokens, top_k, hidden).sum(dim=1)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The same function in torch, expert by expert as transformers computes it: SiLU(gate) * up, the down
    projection, times the routing weight (in float32, rounded once), added into the token's row."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token, (y.float() * topk_weights[token, slot, None].float()).to(x.dtype))
    return out
