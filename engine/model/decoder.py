"""The decoder-only transformer every family shares (Llama, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 3), over a paged KV
cache, with Hugging Face weight names. What differs between families is a `DecoderConfig` (engine/model/config.py)
plus the mixture-of-experts MLP (engine/model/moe.py) and Gemma's norm (engine/model/norms.py).

This module defines the layers: their weights and the torch reference forward (each module's own `forward`, and
`Reference`, the layer loop over them: bit for bit transformers', a dense CPU core's path). How a loaded model
computes is its `backend`, chosen once at load (engine/model/backends/select.py), which prepares the weights it
needs then: the Triton kernel path (the GPU's, what CUDA graphs capture), or Flare's C++ ops for a quantized fp32
core on the CPU. `CausalLM.forward` runs through it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, KernelMetadata, PagedAttention
from engine.model.config import DecoderConfig
from engine.model.fp8_linear import Fp8Linear
from engine.model.image_features import ImageFeatures, Tower
from engine.model.linear_attention import GatedDeltaNet
from engine.model.moe import SparseMoE
from engine.model.norms import rms_norm
from engine.model.quant import QuantLinear
from engine.model.rotary import rotate, signed_sine
from engine.parallel import layers as parallel
from engine.parallel.group import TensorParallel


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.c = c
        self.rope = c.layer_rope[layer]
        gated = 2 if c.attn_output_gate else 1
        self.q_proj = nn.Linear(c.hidden_size, gated * c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = parallel.row_linear(c.num_heads * c.head_dim, c.hidden_size, False, tp)
        if c.qk_norm:
            self.q_norm = rms_norm(c.plus_one_norms, c.head_dim, c.rms_norm_eps)
            self.k_norm = rms_norm(c.plus_one_norms, c.head_dim, c.rms_norm_eps)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.attention_scale, c.layer_window[layer])
        self.qkv: nn.Module | None = None  # fuse()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v, gate = self.rotated(x, cos, sin)
        out = self.attn(q, k, v, k_cache, v_cache, meta).flatten(1)
        return self.o_proj(self.gated(out, gate))

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [T, H, D], k and v [T, KVH, D] normalised and rotated, and the output gate (or None): the attention's
        input, which the kernel path's gated attention shares (engine/model/backends/triton_layers.py). `sin` is
        signed (signed_sine): q and k are rotated together, as one [T, H + KVH, D] tensor."""
        c = self.c
        gate = None
        if c.attn_output_gate:  # each head's q_proj rows: its q, then its gate
            q, gate = self.q_proj(x).view(-1, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
            qk = torch.cat((q, self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim)), dim=1)
            v = self.v_proj(x)
        else:
            qk, v = self.project(x)
        if c.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :c.num_heads]), self.k_norm(qk[:, c.num_heads:])), dim=1)
        if c.rotated_dim < c.head_dim:  # partial rotary: the leading dimensions turn, the rest pass
            qk = torch.cat((rotate(qk[..., :c.rotated_dim], cos, sin), qk[..., c.rotated_dim:]), dim=-1)
        else:
            qk = rotate(qk, cos, sin)
        return qk[:, :c.num_heads], qk[:, c.num_heads:], v.view(-1, c.num_kv_heads, c.head_dim), gate

    @staticmethod
    def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's output [T, H * D] times the sigmoid of its gate, where it has one."""
        return out if gate is None else out * torch.sigmoid(gate.reshape(out.shape))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as one [T, H + KVH, D] tensor, and v [T, KVH * D]: from the fused product where the weights
        were fused (fuse), else from the three. (Gated attention's q_proj is its own: forward.)"""
        c = self.c
        heads, width = c.num_heads + c.num_kv_heads, (c.num_heads + c.num_kv_heads) * c.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
            return qkv[:, :width].view(-1, heads, c.head_dim), qkv[:, width:]
        return torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1).view(-1, heads, c.head_dim), self.v_proj(x)

    def fuse(self) -> None:
        """One [q; k; v] product, the three projections left as views of it (the weight names stay); kept
        separate where the parts cannot share one product (fuse_linears), or where q_proj carries a gate."""
        if not self.c.attn_output_gate:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig, tp: TensorParallel | None = None, size: int | None = None) -> None:
        """`size`: the intermediate size when not the config's (a shared expert's)."""
        super().__init__()
        size = size or c.intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, size, bias=False)
        self.down_proj = parallel.row_linear(size, c.hidden_size, False, tp)
        self.gelu = c.hidden_act == "gelu_tanh"
        self.gate_up: nn.Module | None = None  # fuse()

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(gate, approximate="tanh") if self.gelu else nn.functional.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)


def fuse_linears(*linears: nn.Module) -> nn.Module | None:
    """One layer computing the given layers' outputs side by side, or None where they cannot share one product.
    Dense layers: the weights concatenated along the output dimension, each layer re-pointed at its slice, so the
    fused weight costs no extra memory. Quantized layers: QuantLinear.concat; FP8 ones, Fp8Linear.concat."""
    if all(isinstance(linear, QuantLinear) for linear in linears):
        return QuantLinear.concat(*linears)
    if all(isinstance(linear, Fp8Linear) for linear in linears):
        return Fp8Linear.concat(*linears)
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
        # A hybrid's token mixer is linear attention in some layers (its weights under linear_attn)
        self.linear = c.is_linear(layer)
        if self.linear:
            self.linear_attn = GatedDeltaNet(c, layer, tp)
        else:
            self.self_attn = Attention(c, layer, tp)
        if c.is_moe(layer):
            shared = MLP(c, tp, c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size else None
            self.mlp = SparseMoE(c, tp, shared)
        else:
            self.mlp = MLP(c, tp)
        self.input_layernorm = rms_norm(c.plus_one_norms, c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = rms_norm(c.plus_one_norms, c.hidden_size, c.rms_norm_eps)
        # Gemma normalises each branch's output too: post_attention_layernorm is then the attention's output norm,
        # and the MLP has its own pair.
        self.sandwich = c.gemma_norms
        if c.gemma_norms:
            self.pre_feedforward_layernorm = rms_norm(True, c.hidden_size, c.rms_norm_eps)
            self.post_feedforward_layernorm = rms_norm(True, c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """A linear-attention layer reads neither rotary nor KV (None): its state rows are meta.recurrent's."""
        h = self.input_layernorm(x)
        attn = self.linear_attn(h, meta) if self.linear else self.self_attn(h, cos, sin, k_cache, v_cache, meta)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def mlp_norm(self) -> nn.Module:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm


class Backbone(nn.Module):
    def __init__(self, c: DecoderConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = parallel.embedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(c, i, tp) for i in range(c.num_layers))
        self.norm = rms_norm(c.plus_one_norms, c.hidden_size, c.rms_norm_eps)


class Backend(Protocol):
    """How a model computes: `Reference` below, or what engine/model/backends/select.py chose at load (a backend
    object holds what it prepared for its model, such as the kernel path's rope tables)."""

    def forward(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | KernelMetadata, images: ImageFeatures | None) -> torch.Tensor:
        """CausalLM.forward's contract."""

    def tower(self, visual: nn.Module) -> Tower:
        """A vision-language model's tower (engine/model/qwen3_vl_vision.py) as this backend runs it."""


class Reference:
    """The torch reference: the layers' own forwards, each rotation from cos/sin tables computed per step."""

    def forward(self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, images: ImageFeatures | None) -> torch.Tensor:
        rotations = model.rotations(positions)
        x = model.embed(input_ids)
        if images is not None:
            x = images.splice(x)
        kv_layers = model.config.kv_layers
        for i, layer in enumerate(model.model.layers):
            if layer.linear:
                x = layer(x, None, None, None, None, meta)
            else:
                cos, sin = rotations[layer.self_attn.rope]
                kv = kv_layers.index(i)  # a hybrid's cache holds its attention layers only
                x = layer(x, cos, sin, kv_cache[kv, 0], kv_cache[kv, 1], meta)
            if images is not None:
                x = images.after_layer(i, x)
        return model.model.norm(x)

    def tower(self, visual: nn.Module) -> Tower:
        return visual



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
        # The torch reference until the loader chooses (engine/model/backends/select.py: use_backend).
        self.backend: Backend = Reference()
        # The KV cache's element type where it is not the model's (an FP8 cache: engine/model/kv_quant.py); the
        # executors allocate `cache_dtype`.
        self.kv_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.model.embed_tokens.weight.dtype

    def set_rope(self, device: torch.device | None = None) -> None:
        """The inverse frequencies of each distinct rope (Gemma 3's local and global layers have their own)."""
        for i, rope in enumerate(self.config.ropes):
            self.register_buffer(f"inv_freq{i}", rope.inv_freq(self.config.rotated_dim).to(device),
                                 persistent=False)

    @property
    def inv_freqs(self) -> list[torch.Tensor]:
        return [getattr(self, f"inv_freq{i}") for i in range(len(self.config.ropes))]

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one product each: always on the kernel path; on the CPU for a quantized core, where
        it saves operators a layer (a dense CPU model keeps transformers' separate products, its parity reference)."""
        for layer in self.model.layers:
            if not layer.linear:
                layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the weights' dtype, as transformers does
            x = x * float(torch.tensor(self.config.embed_scale, dtype=x.dtype))
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | KernelMetadata, images: ImageFeatures | None = None) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [layers, 2, slots, KVH, D]; returns final hidden states [T, E], as
        the model's backend computes them. `images` (a vision-language model's prompt rows,
        engine/model/qwen3_vl.py) replace their tokens' embeddings and add to the first layers' outputs."""
        return self.backend.forward(self, input_ids, positions, kv_cache, meta, images)

    def rotations(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, signed sin) [T, 1, D] per distinct rope, for positions [T] (rotate)."""
        dtype = self.model.embed_tokens.weight.dtype
        rotations = []
        for inv_freq in self.inv_freqs:
            freqs = positions.float()[:, None] * inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            rotations.append((angles.cos().to(dtype)[:, None, :], signed_sine(angles.sin().to(dtype))[:, None, :]))
        return rotations

    def rope_inputs(self, positions: torch.Tensor, tables: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The kernel path's rotary (engine/model/backends/triton.py): given its table per distinct rope (a row
        per position), the tables to read and the row of them each token reads."""
        return tables, positions

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
