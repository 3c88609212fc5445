"""The kernel path for a step of up to gemv.MAX_ROWS tokens (a decode step of a few sequences): each projection is one
GEMV (engine/kernels/triton/gemv.py) with the RMSNorm before it as its prologue and the residual add after it as its
epilogue, so the residual stream is updated in place and no norm, add or SiLU kernel runs between them. A mixture
of experts keeps its own kernels, its router's GEMV and its gate/up kernel normalising the stream, its down kernel
adding to it. The Triton backend (triton.py) takes this
path where every layer is of the shape it runs (runs_few_rows)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.triton import dependent_launch
from engine.kernels.triton.gemv import gemv
from engine.kernels.triton.rmsnorm import add_rms_norm
from engine.model.attention import KernelMetadata
from engine.model.backends.triton_layers import attend, moe
from engine.model.decoder import MLP, CausalLM, DecoderLayer
from engine.model.fp8_linear import Fp8Linear


# How the step's kernels (projections, rotary, decode attention, a mixture of experts' routing and rows path, the
# norms) are launched where the GPU allows dependent launches (engine/kernels/triton/dependent_launch.py): each starts
# while the kernel before it ends and reads its first weight slice before it waits, and a GEMV lets the next kernel's
# programs be placed once its own have all started. Whole batch-1 steps (`bench.lab.gpu.evidence --only dependent`,
# docs/gpu.md): 3-25% shorter than launched plainly on an H100 (8B, Qwen3-30B-A3B, SmolLM2), the same tokens; the
# early release alone 5% on SmolLM2, within 0.5% on the others.
LAUNCH = dependent_launch.PREFETCH_EARLY


def runs_few_rows(layer: DecoderLayer) -> bool:
    """Llama-style norms around each branch, plain (not tensor-parallel, not GGUF-quantized; bf16 or FP8) q/k/v and
    o, and a SiLU MLP of plain products or a mixture of experts with a plain router: the layers whose norms and adds
    the GEMVs fold in (not a hybrid's linear attention)."""
    if layer.linear:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    plain = [attn.qkv, attn.o_proj] + ([mlp.gate_up, mlp.down_proj] if isinstance(mlp, MLP) else [mlp.gate])
    return not layer.sandwich and all(type(p) in (nn.Linear, Fp8Linear) for p in plain) and \
        not (isinstance(mlp, MLP) and mlp.gelu)


def weights(linear: nn.Linear | Fp8Linear) -> dict[str, torch.Tensor | int | None]:
    """gemv's weight arguments for a linear: its weight and bias, and an FP8 weight's scales."""
    if isinstance(linear, Fp8Linear):
        return {"weight": linear.values, "bias": linear.bias, "scale": linear.scale, "scale_k": linear.scale_k}
    return {"weight": linear.weight, "bias": linear.bias}


def forward(model: CausalLM, tables: list[torch.Tensor], input_ids: torch.Tensor, positions: torch.Tensor,
            kv_cache: torch.Tensor, meta: KernelMetadata) -> torch.Tensor:
    """The final hidden states [T, E]; `tables`: the Triton backend's rope table per distinct rope."""
    eps = model.config.rms_norm_eps
    tables, rope_positions = model.rope_inputs(positions, tables)
    stream = model.embed(input_ids)  # a tensor of this step's own: the epilogues write into it
    launch = LAUNCH if dependent_launch.supported(stream.device) else dependent_launch.NONE
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = gemv(stream, **weights(attn.qkv), norm=(layer.input_layernorm.kernel_weight(), eps), dependent=launch)
        out = attend(attn, qkv, rope_positions, tables[attn.rope], kv_cache[i, 0], kv_cache[i, 1], meta, launch)
        gemv(out.flatten(1), **weights(attn.o_proj), residual=stream, dependent=launch)
        norm = (layer.post_attention_layernorm.kernel_weight(), eps)
        if isinstance(mlp, MLP):
            gemv(gemv(stream, **weights(mlp.gate_up), norm=norm, dependent=launch), **weights(mlp.down_proj),
                 silu_mul=True, residual=stream, dependent=launch)
        else:
            # The router as a GEMV keeps the chain of dependent launches (cuBLAS's launch plainly: the kernel after
            # one waits for its end before its programs are placed); it and the experts' gate/up kernel normalise
            # the stream themselves, as the dense projections do.
            logits = gemv(stream, **weights(mlp.gate), norm=norm, dependent=launch)
            moe(mlp, stream, residual=stream, dependent=launch, logits=logits, norm=norm)
    return add_rms_norm(stream, None, model.model.norm.kernel_weight(), eps, dependent=launch)[0]
