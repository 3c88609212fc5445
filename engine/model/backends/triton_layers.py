"""The kernel path's layer parts (engine/model/backends/triton.py and few_rows.py run them): attention from the
fused q/k/v product through the Triton rotary and paged-attention kernels (a hybrid model's gated attention, with its
partial rotary, rotated in torch and stored by its own kernel), the MLP over the fused gate/up product, and the
mixture of experts through the fused MoE kernel. Nothing here waits for the host, so CUDA graphs capture it. (A
hybrid's linear-attention layers: triton_linear.py.)
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from engine.kernels.triton.activation import silu_and_mul, silu_and_mul_e4m3
from engine.kernels.triton.decode_attention import NewTokens, decode_attention, num_splits
from engine.kernels.triton.dependent_launch import NONE
from engine.kernels.triton.extend_attention import extend_attention
from engine.kernels.triton.fp8_linear import E4m3Rows
from engine.kernels.triton.fused_moe import fused_moe
from engine.kernels.triton.kv_store import store_kv
from engine.kernels.triton.moe_routing import route_in_one_program
from engine.kernels.triton.rmsnorm import add_rms_norm, add_rms_norm_e4m3
from engine.kernels.triton.rotary import rope_and_store
from engine.model.attention import KernelMetadata
from engine.model.decoder import MLP, Attention
from engine.model.fp8_linear import Fp8Linear
from engine.model.moe import SparseMoE


# A decode step's rotary and cache store inside its attention kernel rather than a kernel of their own (one launch a
# layer fewer): batch-1 steps 1-3% shorter on an H100 (`bench.lab.gpu.evidence --only dependent`, docs/gpu.md).
ROTARY_IN_DECODE = True


@lru_cache
def multiprocessors(device: torch.device) -> int:
    # Under the CPU interpreter (tests) any small count will do.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: KernelMetadata,
                     scale: float, window: int | None = None, kv_scale: torch.Tensor | None = None,
                     dependent: int = NONE) -> torch.Tensor:
    """q [T, H, D] of tokens whose K/V are already in the cache -> [T, H, D]. With a window, a query sees its own key
    and the window - 1 before it (sliding-window layers). An extend step's rows of no sequence (a graph's padding,
    which its kernel skips) are zeros rather than whatever the memory held: they flow on through the layers, and a
    NaN there would reach the router of a mixture of experts. An FP8 cache is read with `kv_scale` (the layer's
    PagedAttention.kv_scale). `dependent`: the decode kernels' launch (engine/kernels/triton/dependent_launch.py)."""
    if meta.extend is not None:  # (a step is extend sequences, its decode rows among them, or decode rows alone)
        e = meta.extend
        out = torch.zeros_like(q)
        extend_attention(q, k_cache, v_cache, out, e.page_tables, e.seq_table, e.query_start, e.query_len,
                         e.context_lens, e.block_seq, e.block_first, meta.page_size, scale, window=window or 0,
                         kv_scale=kv_scale)
        return out
    rows = meta.decode.rows
    return decode(q if rows is None else q[rows], k_cache, v_cache, meta, scale, window, kv_scale, dependent)


def decode(rows: torch.Tensor | NewTokens, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: KernelMetadata,
           scale: float, window: int | None, kv_scale: torch.Tensor | None, dependent: int) -> torch.Tensor:
    """The decode rows' attention (kernel_attention's arguments), from their queries or their q/k/v product, as the
    step's rows [T, H, D] (an eager step names its decode rows, DecodeBatch.rows; a graph's are its rows)."""
    d = meta.decode
    batch = rows.qkv.shape[0] if isinstance(rows, NewTokens) else rows.shape[0]
    # The split count follows the batch's size only, so a graph and an eager step of one size agree bitwise.
    splits = num_splits(batch, k_cache.shape[1], multiprocessors(k_cache.device))
    result = decode_attention(rows, k_cache, v_cache, d.page_tables, d.seq_table, d.context_lens, meta.page_size,
                              scale, splits, window=window or 0, kv_scale=kv_scale, dependent=dependent)
    if d.rows is None:
        return result
    out = result.new_empty(meta.slot_mapping.shape[0], *result.shape[1:])
    out[d.rows] = result
    return out


def attend(attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, meta: KernelMetadata, dependent: int = NONE) -> torch.Tensor:
    """From the fused q/k/v product [T, (H + 2 KVH) D] to the attention's output [T, H, D]: q/k norms and rotary,
    the new keys and values stored, attention over the cache; `dependent`: the rotary's and the decode kernels'
    launch (engine/kernels/triton/dependent_launch.py)."""
    c = attn.c
    norms = {}
    if c.qk_norm:  # the kernel normalises each q and k head before rotating, rounding as the family does
        norms = dict(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight, norm_eps=c.rms_norm_eps,
                     norm_style="gemma" if c.gemma_norms else "llama")
    paged = attn.attn
    if ROTARY_IN_DECODE and meta.extend is None:
        rows = meta.decode.rows
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        new = NewTokens(pick(qkv), pick(positions), rope, pick(meta.slot_mapping), c.num_heads, **norms)
        return decode(new, k_cache, v_cache, meta, paged.scale, paged.window, paged.kv_scale, dependent)
    q = rope_and_store(qkv, positions, rope, meta.slot_mapping, k_cache, v_cache, c.num_heads, c.num_kv_heads,
                       kv_scale=paged.kv_scale, dependent=dependent, **norms)
    return kernel_attention(q, k_cache, v_cache, meta, paged.scale, paged.window, paged.kv_scale, dependent)


def attention(attn: Attention, x: torch.Tensor | E4m3Rows, positions: torch.Tensor, rope: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, meta: KernelMetadata) -> torch.Tensor:
    """The attention branch [T, E] -> [T, E]; `rope` is the table of the layer's rope, `positions` its rows."""
    out = attend(attn, attn.qkv(x), positions, rope, k_cache, v_cache, meta)
    return attn.o_proj(out.flatten(1))


def gated_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: KernelMetadata) -> torch.Tensor:
    """A hybrid's attention branch [T, E] -> [T, E]: q, k, v and the output gate as the torch reference makes them
    (its per-step cos and sin: Attention.rotated), the new keys and values stored, the paged-attention kernels, the
    gate."""
    q, k, v, gate = attn.rotated(x, cos, sin)
    paged = attn.attn
    store_kv(k, v, meta.slot_mapping, k_cache, v_cache, paged.kv_scale)
    out = kernel_attention(q.contiguous(), k_cache, v_cache, meta, paged.scale, paged.window, paged.kv_scale)
    return attn.o_proj(attn.gated(out.flatten(1), gate))


def norm_for(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             consumer: nn.Module | None) -> tuple[torch.Tensor | E4m3Rows, torch.Tensor]:
    """add_rms_norm, its rows quantized per token in the same kernel where they go to an FP8 product that would
    quantize them (the residual stream's AddRmsNorm, engine/model/backends/residual.py)."""
    if isinstance(consumer, Fp8Linear) and consumer.takes_e4m3(x.shape[0]):
        return add_rms_norm_e4m3(x, residual, weight, eps)
    return add_rms_norm(x, residual, weight, eps)


def mlp(layer: MLP, x: torch.Tensor | E4m3Rows) -> torch.Tensor:
    gate_up = layer.gate_up(x)
    if layer.gelu:
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.down_proj(layer.act(gate) * up)
    down = layer.down_proj
    if isinstance(down, Fp8Linear) and down.takes_e4m3(gate_up.shape[0]):
        return down(silu_and_mul_e4m3(gate_up))
    return down(silu_and_mul(gate_up))


def moe(layer: SparseMoE, x: torch.Tensor, residual: torch.Tensor | None = None, dependent: int = NONE,
        logits: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """With a residual (one rank only), the output is added to it in place by the down kernel. A hybrid's shared
    expert (Qwen3.5-MoE, Qwen3-Next) runs beside the routed ones, as the torch reference's. `dependent`: the routing's
    and the rows path's launch (engine/kernels/triton/dependent_launch.py). `logits`: the router's, where the caller
    made them; `norm`: x is the residual stream, which the experts' kernels normalise (fused_moe_rows)."""
    logits = layer.gate(x) if logits is None else logits
    weights, ids = route_in_one_program(logits, layer.top_k, layer.norm_topk_prob, dependent)
    if residual is not None:
        assert layer.tp is None
        return fused_moe(x, layer.w13, layer.w2, weights, ids, residual=residual, scales=layer.scales,
                         dependent=dependent, norm=norm)
    assert norm is None
    return layer.with_shared(x, layer.all_reduce(fused_moe(x, layer.w13, layer.w2, weights, ids,
                                                           scales=layer.scales, dependent=dependent)))
