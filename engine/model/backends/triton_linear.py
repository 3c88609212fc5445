"""A hybrid model's Gated DeltaNet layer on the kernel path (docs/design.md, Hybrid models: linear attention and
recurrent state): its four input projections as one product, the short conv and the gated delta rule as Triton
kernels over the step's sequences (engine/kernels/triton/short_conv.py, gated_delta_rule.py), reading and advancing
the state rows KernelMetadata.recurrent names, then the gated RMSNorm (one kernel, rmsnorm.py) and the output
projection. A decode step runs
the recurrent form; a step with prefill spans runs the chunked form over every sequence, its decode rows one-token
sequences, as a captured extend graph does. Nothing waits for the host, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.triton.gated_delta_rule import gated_delta_rule
from engine.kernels.triton.rmsnorm import gated_rms_norm
from engine.kernels.triton.short_conv import short_conv
from engine.model.attention import KernelMetadata
from engine.model.decoder import fuse_linears
from engine.model.linear_attention import GatedDeltaNet


def fuse_inputs(layer: GatedDeltaNet) -> nn.Module:
    """[qkv; z; b; a] as one product (the four projections left as views of it)."""
    fused = fuse_linears(layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a)
    assert fused is not None, "the kernel path fuses a linear-attention layer's dense input projections"
    return fused


def linear_attention(layer: GatedDeltaNet, inputs: nn.Module, x: torch.Tensor, meta: KernelMetadata
                     ) -> torch.Tensor:
    """The linear-attention branch [T, E] -> [T, E]; `inputs`: the layer's fused input projection (fuse_inputs)."""
    shape, rec = layer.shape, meta.recurrent
    assert rec is not None, "a linear-attention layer needs the step's recurrent rows"
    conv_dim, heads = shape.conv_dim, shape.num_value_heads
    product = inputs(x)
    qkv = product[:, :conv_dim]
    z = product[:, conv_dim:conv_dim + shape.value_dim]
    b = product[:, conv_dim + shape.value_dim:conv_dim + shape.value_dim + heads]
    a = product[:, conv_dim + shape.value_dim + heads:]
    conv_state = rec.state.conv[layer.state_layer]
    delta_state = rec.state.delta[layer.state_layer]
    weight = layer.conv1d.weight
    if meta.decode is not None:  # one token a sequence: token rows[i] (i in a graph); past -1 marks padding
        d = meta.decode
        starts = torch.arange(rec.rows.shape[0], device=x.device) if d.rows is None else d.rows
        mixed = short_conv(qkv, weight, conv_state, rec.rows, starts, (rec.past >= 0).to(torch.int32), rec.past)
        out = gated_delta_rule(mixed, a, b, layer.A_log, layer.dt_bias, delta_state, rec.rows, d.rows, None,
                               rec.past, shape.num_key_heads)
    else:
        e = meta.extend
        assert e is not None
        mixed = short_conv(qkv, weight, conv_state, rec.rows, e.query_start, e.query_len, rec.past)
        out = gated_delta_rule(mixed, a, b, layer.A_log, layer.dt_bias, delta_state, rec.rows, e.query_start,
                               e.query_len, rec.past, shape.num_key_heads)
    out = out.view(-1, heads, shape.value_head_dim)
    return layer.out_proj(gated_rms_norm(out, z, layer.norm.weight, layer.norm.eps))
