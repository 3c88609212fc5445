"""The layer loop of the residual-stream backends (the Triton kernel path, triton.py, and a quantized CPU core's C++
ops, cpu_ops.py): the residual stream is kept beside each branch's output and every add is folded into the norm
after it, as their fused add-and-RMSNorm ops compute it. The backends differ in the ops they pass in."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.model.decoder import MLP, Attention, CausalLM
from engine.model.image_features import ImageFeatures
from engine.model.linear_attention import GatedDeltaNet
from engine.model.norms import GemmaRMSNorm

# (x, residual or None, weight, eps, consumer) -> (rms_norm(x + residual), x + residual); with no residual,
# (rms_norm(x), x). `consumer`: the product the normalised rows go to whole, where the branch's first op is one (a
# backend may hand them over in the form it reads: an FP8 product's e4m3 rows), else None.
AddRmsNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float, nn.Module | None],
                      tuple[torch.Tensor, torch.Tensor]]
# (the layer's token mixer: attention, or a hybrid's linear attention; its normalised input, layer index) -> the
# branch's output.
Attend = Callable[[Attention | GatedDeltaNet, torch.Tensor, int], torch.Tensor]
# (MLP or mixture of experts, its normalised input) -> the MLP branch's output.
Mlp = Callable[[nn.Module, torch.Tensor], torch.Tensor]
# (layer index, x, residual) -> the layer's (x, residual) in one call, or None where the layer runs op by op.
WholeLayer = Callable[[int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor] | None]


def prepare_weights(model: CausalLM) -> None:
    """The weights both backends read: q/k/v and gate/up fused into one product each, and Gemma's 1 + w norm
    weights folded once (GemmaRMSNorm.fold)."""
    model.fuse_projections()
    for module in model.modules():
        if isinstance(module, GemmaRMSNorm):
            module.fold()


def residual_stream(model: CausalLM, input_ids: torch.Tensor, images: ImageFeatures | None,
                    add_rms_norm: AddRmsNorm, attend: Attend, mlp: Mlp,
                    whole_layer: WholeLayer | None = None) -> torch.Tensor:
    """The final hidden states [T, E] of the step's tokens."""
    eps = model.config.rms_norm_eps
    x, residual = model.embed(input_ids), None
    if images is not None:
        x = images.splice(x)
    for i, layer in enumerate(model.model.layers):
        if whole_layer is not None:
            whole = whole_layer(i, x, residual)
            if whole is not None:
                x, residual = whole
                continue
        mixer = layer.linear_attn if layer.linear else layer.self_attn
        h, residual = add_rms_norm(x, residual, layer.input_layernorm.kernel_weight(), eps,
                                   None if layer.linear else mixer.qkv)
        x = attend(mixer, h, i)
        if layer.sandwich:
            x = add_rms_norm(x, None, layer.post_attention_layernorm.kernel_weight(), eps, None)[0]
        h, residual = add_rms_norm(x, residual, layer.mlp_norm().kernel_weight(), eps,
                                   layer.mlp.gate_up if isinstance(layer.mlp, MLP) else None)
        x = mlp(layer.mlp, h)
        if layer.sandwich:
            x = add_rms_norm(x, None, layer.post_feedforward_layernorm.kernel_weight(), eps, None)[0]
        if images is not None:  # the layer's output is residual + x: adding to x adds to it
            x = images.after_layer(i, x)
    return add_rms_norm(x, residual, model.model.norm.kernel_weight(), eps, None)[0]
