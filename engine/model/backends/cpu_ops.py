"""The C++ ops backend: a quantized fp32 core on the CPU, where Flare's C++ ops build (engine/kernels/cpu/
extension.py). The residual stream of the kernel path (residual.py), each residual add folded into the norm after
it (flare_cpu::add_rms_norm), Llama-style q/k norms in one op (flare_cpu::rms_norm), rotary in one op, SiLU * up in
one op, and attention in one call over the rows' pages (flare_cpu::decode_attention: a prompt's rows too, each
as the decode row of its position would be); in a step of decode rows only, each Llama-style layer in one call of
the same functions (flare_cpu::decoder_layer). Each computes what the torch ops it replaces do, within a few units
in the last place of fp32 (tests/kernels/test_cpu_layer_ops.py), and a row's bits do not depend on the step it
came in: the products round each row's activations to integers, which turns any last-place difference into other
tokens at a near tie. A dense CPU core keeps the torch reference, bit for bit transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.backends.residual import prepare_weights, residual_stream
from engine.model.decoder import MLP, Attention, CausalLM, DecoderLayer
from engine.model.image_features import ImageFeatures, Tower
from engine.model.norms import RMSNorm
from engine.model.quant import QuantLinear

# What flare_cpu::decoder_layer takes for one layer (engine/kernels/cpu/decoder_layer.cpp): its weights, and the
# code width of each of its four products.
LayerWeights = tuple[list[torch.Tensor], list[int]]


@dataclass(frozen=True)
class CpuOps:
    """Made by prepare, once per model; holds what each layer's one-call decode reads."""

    whole_layers: tuple[LayerWeights | None, ...]  # per layer; None: the layer runs op by op in every step

    @classmethod
    def prepare(cls, model: CausalLM) -> CpuOps:
        """Fuses and folds the model's weights (prepare_weights) and packs each whole-layer decode's."""
        prepare_weights(model)
        return cls(tuple(layer_weights(layer) for layer in model.model.layers))

    def forward(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, images: ImageFeatures | None) -> torch.Tensor:
        eps = model.config.rms_norm_eps
        rotations = model.rotations(positions)

        def attend(attn: Attention, h: torch.Tensor, i: int) -> torch.Tensor:
            return attention(attn, h, *rotations[attn.rope], kv_cache[i, 0], kv_cache[i, 1], meta)

        def whole_layer(i: int, x: torch.Tensor, residual: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
            if self.whole_layers[i] is None:
                return None
            weights, bits = self.whole_layers[i]
            layer = model.model.layers[i]
            attn = layer.self_attn.attn
            return torch.ops.flare_cpu.decoder_layer(
                x, residual, weights, bits, *rotations[layer.self_attn.rope], kv_cache[i, 0], kv_cache[i, 1],
                meta.slot_mapping, meta.decode_rows, meta.decode_page_tables, meta.decode_context_lens,
                meta.page_size, attn.scale, attn.window or 0, eps)

        # decoder_layer runs steps of decode rows only
        whole = None if meta.prefills or images is not None else whole_layer
        return residual_stream(model, input_ids, images, add_rms_norm, attend, mlp, whole)

    def tower(self, visual: nn.Module) -> Tower:
        return visual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 consumer: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); with no residual, (rms_norm(x), x): the Triton add_rms_norm's
    contract (engine/kernels/triton/rmsnorm.py). Its products take the rows as they are (`consumer` unread)."""
    if residual is None:
        return torch.ops.flare_cpu.rms_norm(x, weight, eps), x
    return torch.ops.flare_cpu.add_rms_norm(x, residual, weight, eps)


def head_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A q or k norm: Llama-style by the one-call op (aten's is five operators here), Gemma's by its own forward."""
    if type(norm) is RMSNorm:
        return torch.ops.flare_cpu.rms_norm(x, norm.weight, norm.eps)
    return norm(x)


def attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention.forward with the C++ ops (`sin` signed, as there)."""
    c = attn.c
    qk, v = attn.project(x)
    if c.qk_norm:
        qk = torch.cat((head_norm(attn.q_norm, qk[:, :c.num_heads]), head_norm(attn.k_norm, qk[:, c.num_heads:])),
                       dim=1)
    qk = torch.ops.flare_cpu.rotary(qk, cos, sin)
    out = paged_attention(attn.attn, qk[:, :c.num_heads], qk[:, c.num_heads:],
                          v.view(-1, c.num_kv_heads, c.head_dim), k_cache, v_cache, meta)
    return attn.o_proj(out.flatten(1))


def paged_attention(attn: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """PagedAttention.forward in one C++ call, which stores the rows' k/v and attends over their pages: a step of
    decode rows as they are, a step with prefill spans row by row (meta.every_row), so that each row runs the same
    arithmetic wherever it comes (a prompt, a verify round, a decode step)."""
    if meta.prefills:
        batch = meta.every_row
        rows, tables, lens, seq_table = batch.rows, batch.page_tables, batch.context_lens, batch.seq_table
    else:  # the step's rows are its decode rows, in order
        rows, tables, lens, seq_table = meta.decode_rows, meta.decode_page_tables, meta.decode_context_lens, None
    return torch.ops.flare_cpu.decode_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, rows, tables, lens,
                                                meta.page_size, attn.scale, attn.window or 0, seq_table)


def mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the fused product in one op; a GELU MLP, unfused products or experts by their forward."""
    if isinstance(layer, MLP) and silu_fused(layer):
        return layer.down_proj(torch.ops.flare_cpu.silu_mul(layer.gate_up(x)))
    return layer(x)


def silu_fused(layer: MLP) -> bool:
    return layer.gate_up is not None and not layer.gelu


def layer_weights(layer: DecoderLayer) -> LayerWeights | None:
    """What flare_cpu::decoder_layer takes to run this layer in a decode step, or None where the layer is not of
    the shape it runs: Llama-style norms, fused q/k/v and gate/up, every product quantized for Flare's kernel
    without a bias, no q/k norms, SiLU."""
    attn, block = layer.self_attn, layer.mlp
    if layer.sandwich or attn.c.qk_norm or not isinstance(block, MLP) or not silu_fused(block) or \
            any(type(norm) is not RMSNorm for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
        return None
    products = [attn.qkv, attn.o_proj, block.gate_up, block.down_proj]
    if not all(isinstance(p, QuantLinear) and p.bits is not None and p.bias is None for p in products):
        return None
    weights = [layer.input_layernorm.weight, *packed(attn.qkv), *packed(attn.o_proj),
               layer.post_attention_layernorm.weight, *packed(block.gate_up), *packed(block.down_proj)]
    return weights, [p.bits for p in products]


def packed(layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.codes, layer.scales, layer.mins
