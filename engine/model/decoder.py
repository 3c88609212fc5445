"""The decoder-only transformer every family shares (Llama, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 3), over a paged KV
cache, with Hugging Face weight names. What differs between families is a `DecoderConfig` (engine/model/config.py)
plus the mixture-of-experts MLP (engine/model/moe.py) and Gemma's norm (engine/model/norms.py).

Two paths compute the same function: plain torch (the reference, and the CPU's), and the kernel path
(`use_kernels`: fused q/k/v and gate/up projections, Triton attention, RMSNorm, rotary, SiLU-and-mul and fused MoE),
which is the GPU's and the one CUDA graphs capture: nothing on it waits for the host. A quantized CPU core runs the
kernel path's layer loop with Flare's C++ ops in place of the Triton ones (`use_cpu_ops`: engine/model/cpu_*.cpp),
eagerly; a dense CPU core keeps plain torch, bit for bit transformers' (its parity reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, KernelMetadata, PagedAttention, kernel_attention
from engine.model.config import DecoderConfig
from engine.model.moe import SparseMoE
from engine.model.norms import GemmaRMSNorm, RMSNorm, rms_norm
from engine.model.quant import QuantLinear
from engine.parallel import layers as parallel
from engine.parallel.group import TensorParallel

if TYPE_CHECKING:
    from engine.model.qwen3_vl import ImageFeatures


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(D/2, -1) * signed_sine(sin), bit for bit
    (a negation is exact), in two operators where rotate_half takes four."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] with (cos, signed_sine(sin)) of its positions."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.c = c
        self.rope = c.layer_rope[layer]
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = parallel.row_linear(c.num_heads * c.head_dim, c.hidden_size, False, tp)
        if c.qk_norm:
            self.q_norm = rms_norm(c.gemma_norms, c.head_dim, c.rms_norm_eps)
            self.k_norm = rms_norm(c.gemma_norms, c.head_dim, c.rms_norm_eps)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.attention_scale, c.layer_window[layer])
        self.qkv: nn.Module | None = None  # fuse()
        # rotate, or a one-call op computing the same (flare_cpu::rotary: CausalLM.use_cpu_ops).
        self.rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = rotate

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`sin` is signed (signed_sine): q and k are rotated together, as one [T, H + KVH, D] tensor."""
        c = self.c
        heads, width = c.num_heads + c.num_kv_heads, (c.num_heads + c.num_kv_heads) * c.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
            qk, v = qkv[:, :width].view(-1, heads, c.head_dim), qkv[:, width:]
        else:
            qk, v = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1).view(-1, heads, c.head_dim), self.v_proj(x)
        if c.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :c.num_heads]), self.k_norm(qk[:, c.num_heads:])), dim=1)
        qk = self.rotary(qk, cos, sin)
        out = self.attn(qk[:, :c.num_heads], qk[:, c.num_heads:], v.view(-1, c.num_kv_heads, c.head_dim), k_cache,
                        v_cache, meta)
        return self.o_proj(out.flatten(1))

    def fuse(self) -> None:
        """One [q; k; v] product, the three projections left as views of it (the weight names stay); kept
        separate where the parts cannot share one product (fuse_linears)."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward_kernels(self, x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: KernelMetadata) -> torch.Tensor:
        out = self.attend_kernels(self.qkv(x), positions, rope, k_cache, v_cache, meta)
        return self.o_proj(out.flatten(1))

    def attend_kernels(self, qkv: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: KernelMetadata) -> torch.Tensor:
        """The kernel path from the fused q/k/v product [T, (H + 2 KVH) D] to the attention's output [T, H, D]:
        q/k norms and rotary, the new keys and values stored, attention over the cache."""
        from engine.kernels.triton.rotary import rope_and_store

        c = self.c
        norms = {}
        if c.qk_norm:  # the kernel normalises each q and k head before rotating, rounding as the family does
            norms = dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight, norm_eps=c.rms_norm_eps,
                         norm_style="gemma" if c.gemma_norms else "llama")
        q = rope_and_store(qkv, positions, rope, meta.slot_mapping, k_cache, v_cache, c.num_heads, c.num_kv_heads,
                           **norms)
        return kernel_attention(q, k_cache, v_cache, meta, self.attn.scale, self.attn.window)


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = parallel.row_linear(c.intermediate_size, c.hidden_size, False, tp)
        self.gelu = c.hidden_act == "gelu_tanh"
        self.gate_up: nn.Module | None = None  # fuse()
        # act(gate) * up of the fused [gate | up] product in one call (flare_cpu::silu_mul: CausalLM.use_cpu_ops).
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(gate, approximate="tanh") if self.gelu else nn.functional.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(self.gate_up(x)))
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward_kernels(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.triton.activation import silu_and_mul

        gate_up = self.gate_up(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(silu_and_mul(gate_up))


def fuse_linears(*linears: nn.Module) -> nn.Module | None:
    """One layer computing the given layers' outputs side by side, or None where they cannot share one product.
    Dense layers: the weights concatenated along the output dimension, each layer re-pointed at its slice, so the
    fused weight costs no extra memory. Quantized layers: QuantLinear.concat."""
    if all(isinstance(linear, QuantLinear) for linear in linears):
        return QuantLinear.concat(*linears)
    if not all(type(linear) is nn.Linear for linear in linears):
        return None
    fused = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    with torch.device("meta"):
        layer = nn.Linear(fused.shape[1], fused.shape[0], bias=biases[0] is not None)
    layer.weight = nn.Parameter(fused, requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    first = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[first:first + rows], requires_grad=False)
        first += rows
    return layer


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(c, layer, tp)
        self.mlp = SparseMoE(c, tp) if c.is_moe(layer) else MLP(c, tp)
        self.input_layernorm = rms_norm(c.gemma_norms, c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = rms_norm(c.gemma_norms, c.hidden_size, c.rms_norm_eps)
        # Gemma normalises each branch's output too: post_attention_layernorm is then the attention's output norm,
        # and the MLP has its own pair.
        self.sandwich = c.gemma_norms
        if c.gemma_norms:
            self.pre_feedforward_layernorm = rms_norm(True, c.hidden_size, c.rms_norm_eps)
            self.post_feedforward_layernorm = rms_norm(True, c.hidden_size, c.rms_norm_eps)
        # What flare_cpu::decoder_layer takes to run this layer for a decode step (CausalLM.use_cpu_ops).
        self.whole_decode: tuple[list[torch.Tensor], list[int]] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def fuses_few_rows(self) -> bool:
        """Whether CausalLM._forward_few_rows runs this layer: Llama-style norms around each branch, plain (not
        tensor-parallel, not quantized) q/k/v and o, and a SiLU MLP of plain products or a mixture of experts."""
        attn, mlp = self.self_attn, self.mlp
        plain = [attn.qkv, attn.o_proj] + ([mlp.gate_up, mlp.down_proj] if isinstance(mlp, MLP) else [])
        return not self.sandwich and all(type(p) is nn.Linear for p in plain) and \
            not (isinstance(mlp, MLP) and mlp.gelu)

    def mlp_norm(self) -> nn.Module:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def decode_weights(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The weights and code widths flare_cpu::decoder_layer takes (engine/kernels/cpu/decoder_layer.cpp), or None
        where this layer is not of the shape it runs: Llama-style norms, fused q/k/v and gate/up, every product
        quantized for Flare's kernel without a bias, no q/k norms, SiLU (after use_cpu_ops set its op)."""
        attn, mlp = self.self_attn, self.mlp
        if self.sandwich or attn.c.qk_norm or not isinstance(mlp, MLP) or mlp.act_and_mul is None or \
                any(type(norm) is not RMSNorm for norm in (self.input_layernorm, self.post_attention_layernorm)):
            return None
        products = [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj]
        if not all(isinstance(p, QuantLinear) and p.bits is not None and p.bias is None for p in products):
            return None
        weights = [self.input_layernorm.weight, *_packed(attn.qkv), *_packed(attn.o_proj),
                   self.post_attention_layernorm.weight, *_packed(mlp.gate_up), *_packed(mlp.down_proj)]
        return weights, [p.bits for p in products]


def _packed(layer: QuantLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.codes, layer.scales, layer.mins


class Backbone(nn.Module):
    def __init__(self, c: DecoderConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = parallel.embedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(c, i, tp) for i in range(c.num_layers))
        self.norm = rms_norm(c.gemma_norms, c.hidden_size, c.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, c: DecoderConfig, tp: TensorParallel | None = None) -> None:
        """With a tensor-parallel group, `c` is this rank's part of the model (engine/model/sharding.py)."""
        super().__init__()
        self.config = c
        self.model = Backbone(c, tp)
        self.lm_head = parallel.lm_head(c.hidden_size, c.vocab_size, tp)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_rope()
        self.kernels = False
        self.few_rows = 0  # use_kernels: steps of up to this many tokens take _forward_few_rows
        self.cpu_ops = False

    def set_rope(self, device: torch.device | None = None) -> None:
        """The inverse frequencies of each distinct rope (Gemma 3's local and global layers have their own)."""
        for i, rope in enumerate(self.config.ropes):
            self.register_buffer(f"inv_freq{i}", rope.inv_freq(self.config.head_dim).to(device), persistent=False)

    @property
    def inv_freqs(self) -> list[torch.Tensor]:
        return [getattr(self, f"inv_freq{i}") for i in range(len(self.config.ropes))]

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one product each: always on the kernel path; on the CPU for a quantized core, where
        it saves operators a layer (a dense CPU model keeps transformers' separate products, its parity reference)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()

    def use_kernels(self, max_positions: int) -> None:
        """Switch to the kernel path (the GPU's; the CPU runs it only under TRITON_INTERPRET, in tests)."""
        from engine.kernels.triton.gemv import MAX_ROWS as GEMV_MAX_ROWS
        from engine.kernels.triton.rotary import rope_table

        self.fuse_projections()
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold()
        self.rope_tables = [rope_table(inv_freq, max_positions) for inv_freq in self.inv_freqs]
        self.kernels = True
        self.few_rows = GEMV_MAX_ROWS if all(layer.fuses_few_rows() for layer in self.model.layers) else 0

    def use_cpu_ops(self) -> None:
        """Flare's C++ ops for a quantized fp32 core on the CPU (the loader calls this where they build,
        engine/kernels/cpu/extension.py): the kernel path's layer loop, each residual add folded into the norm after it
        (flare_cpu::add_rms_norm), rotary in one op, SiLU(gate) * up in one op, and decode rows' attention in one
        call over their pages (flare_cpu::decode_attention); in a step of decode rows only, each Llama-style layer in
        one call of the same functions (flare_cpu::decoder_layer). Each computes what the torch ops it replaces do,
        within a few units in the last place of fp32 (tests/kernels/test_cpu_layer_ops.py)."""
        ops = torch.ops.flare_cpu
        for module in self.modules():
            if type(module) is RMSNorm:  # Gemma's (1 + w) norms keep their own forward
                module.op = ops.rms_norm
            elif isinstance(module, GemmaRMSNorm):
                module.fold()
            elif isinstance(module, Attention):
                module.rotary = ops.rotary
            elif isinstance(module, PagedAttention):
                module.decode_op = ops.decode_attention
            elif isinstance(module, MLP) and module.gate_up is not None and not module.gelu:
                module.act_and_mul = ops.silu_mul
        for layer in self.model.layers:
            layer.whole_decode = layer.decode_weights()
        self.cpu_ops = True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the weights' dtype, as transformers does
            x = x * float(torch.tensor(self.config.embed_scale, dtype=x.dtype))
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | KernelMetadata, images: ImageFeatures | None = None) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [layers, 2, slots, KVH, D]; returns final hidden states [T, E].
        `images` (a vision-language model's prompt rows, engine/model/qwen3_vl.py) replace their tokens' embeddings
        and add to the first layers' outputs."""
        if self.kernels:
            meta = meta.kernel if isinstance(meta, AttentionMetadata) else meta
            if images is None and input_ids.shape[0] <= self.few_rows:
                return self._forward_few_rows(input_ids, positions, kv_cache, meta)
            return self._forward_residual(input_ids, positions, kv_cache, meta, images)
        if self.cpu_ops:
            return self._forward_residual(input_ids, positions, kv_cache, meta, images)
        rotations = self.rotations(positions)
        x = self.embed(input_ids)
        if images is not None:
            x = images.splice(x)
        for i, layer in enumerate(self.model.layers):
            cos, sin = rotations[layer.self_attn.rope]
            x = layer(x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], meta)
            if images is not None:
                x = images.after_layer(i, x)
        return self.model.norm(x)

    def rotations(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, signed sin) [T, 1, D] per distinct rope, for positions [T] (rotate)."""
        dtype = self.model.embed_tokens.weight.dtype
        rotations = []
        for inv_freq in self.inv_freqs:
            freqs = positions.float()[:, None] * inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            rotations.append((angles.cos().to(dtype)[:, None, :], signed_sine(angles.sin().to(dtype))[:, None, :]))
        return rotations

    def _forward_residual(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                          meta: AttentionMetadata | KernelMetadata, images: ImageFeatures | None = None
                          ) -> torch.Tensor:
        """The layers with the residual stream beside the branch outputs, each add folded into the norm after it:
        the kernel path (Triton ops, `meta` a KernelMetadata) or a quantized CPU core's (C++ ops, `use_cpu_ops`)."""
        eps = self.config.rms_norm_eps
        if self.kernels:
            from engine.kernels.triton.rmsnorm import add_rms_norm

            tables, rope_positions = self.rope_inputs(positions)

            def attend(attn: Attention, h: torch.Tensor, i: int) -> torch.Tensor:
                return attn.forward_kernels(h, rope_positions, tables[attn.rope], kv_cache[i, 0], kv_cache[i, 1],
                                            meta)

            def mlp(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
                return layer.forward_kernels(h)
            whole_layer = None
        else:
            add_rms_norm = cpu_add_rms_norm
            rotations = self.rotations(positions)

            def attend(attn: Attention, h: torch.Tensor, i: int) -> torch.Tensor:
                return attn(h, *rotations[attn.rope], kv_cache[i, 0], kv_cache[i, 1], meta)

            def mlp(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
                return layer(h)

            def decode_layer(layer: DecoderLayer, i: int, x: torch.Tensor, residual: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
                attn = layer.self_attn.attn
                return torch.ops.flare_cpu.decoder_layer(
                    x, residual, *layer.whole_decode, *rotations[layer.self_attn.rope], kv_cache[i, 0],
                    kv_cache[i, 1], meta.slot_mapping, meta.decode_rows, meta.decode_page_tables,
                    meta.decode_context_lens, meta.page_size, attn.scale, attn.window or 0, eps)
            # decoder_layer runs steps of decode rows only
            whole_layer = None if meta.prefills or images is not None else decode_layer
        x, residual = self.embed(input_ids), None
        if images is not None:
            x = images.splice(x)
        for i, layer in enumerate(self.model.layers):
            if whole_layer is not None and layer.whole_decode is not None:
                x, residual = whole_layer(layer, i, x, residual)
                continue
            h, residual = add_rms_norm(x, residual, layer.input_layernorm.kernel_weight(), eps)
            x = attend(layer.self_attn, h, i)
            if layer.sandwich:
                x = add_rms_norm(x, None, layer.post_attention_layernorm.kernel_weight(), eps)[0]
            h, residual = add_rms_norm(x, residual, layer.mlp_norm().kernel_weight(), eps)
            x = mlp(layer.mlp, h)
            if layer.sandwich:
                x = add_rms_norm(x, None, layer.post_feedforward_layernorm.kernel_weight(), eps)[0]
            if images is not None:  # the layer's output is residual + x: adding to x adds to it
                x = images.after_layer(i, x)
        return add_rms_norm(x, residual, self.model.norm.kernel_weight(), eps)[0]

    def _forward_few_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                          meta: KernelMetadata) -> torch.Tensor:
        """The kernel path for a step of up to `few_rows` tokens (a decode step of a few sequences): each
        projection is one gemv (engine/kernels/triton/gemv.py) with the RMSNorm before it as its prologue and the
        residual add after it as its epilogue, so the residual stream is updated in place and no norm, add or SiLU
        kernel runs between them. A MoE layer's MLP keeps its own kernels, its down kernel adding to the stream."""
        from engine.kernels.triton.gemv import gemv
        from engine.kernels.triton.rmsnorm import add_rms_norm

        eps = self.config.rms_norm_eps
        tables, rope_positions = self.rope_inputs(positions)
        stream = self.embed(input_ids)  # a tensor of this step's own: the epilogues write into it
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = gemv(stream, attn.qkv.weight, attn.qkv.bias, norm=(layer.input_layernorm.kernel_weight(), eps))
            out = attn.attend_kernels(qkv, rope_positions, tables[attn.rope], kv_cache[i, 0], kv_cache[i, 1], meta)
            gemv(out.flatten(1), attn.o_proj.weight, attn.o_proj.bias, residual=stream)
            norm = (layer.post_attention_layernorm.kernel_weight(), eps)
            if isinstance(mlp, MLP):
                gemv(gemv(stream, mlp.gate_up.weight, norm=norm), mlp.down_proj.weight, silu_mul=True,
                     residual=stream)
            else:
                mlp.forward_kernels(add_rms_norm(stream, None, *norm)[0], residual=stream)
        return add_rms_norm(stream, None, self.model.norm.kernel_weight(), eps)[0]

    def rope_inputs(self, positions: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The kernel path's rotary: a table per distinct rope, and the row of it each token reads."""
        return self.rope_tables, positions

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def cpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) by Flare's C++ ops; with no residual, (rms_norm(x), x): the Triton
    add_rms_norm's contract (engine/kernels/triton/rmsnorm.py), for a quantized CPU core."""
    if residual is None:
        return torch.ops.flare_cpu.rms_norm(x, weight, eps), x
    return torch.ops.flare_cpu.add_rms_norm(x, residual, weight, eps)
