"""The Llama family (Llama 2/3, SmolLM2, Mistral) over a paged KV cache, with Hugging Face weight names.

Two paths compute the same function: plain torch (the reference, and the CPU's), and the kernel path
(`use_kernels`: fused q/k/v and gate/up projections, Triton attention, RMSNorm, rotary and SiLU-and-mul), which is
the GPU's and the one CUDA graphs capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, KernelMetadata, PagedAttention, kernel_attention
from engine.parallel import layers as parallel
from engine.parallel.group import TensorParallel


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, config: dict) -> "LlamaConfig":
        heads = int(config["num_attention_heads"])
        rope_params = config.get("rope_parameters") or {}
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            rope_scaling=config.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default")
                                                        != "default" else None),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
        )


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1: low frequencies stretched by `factor`, high ones kept, a smooth blend between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > original / low, inv_freq / factor,
                               torch.where(wavelen < original / high, inv_freq, blended))
    return inv_freq


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the first half of each head against the second: x * cos + rotate_half(x) * sin, where
    rotate_half(x) = [-x2, x1] is written as [x2, x1] * [-sin1, sin2] (the same values, bit for bit, in fewer
    operators: a decode step runs this twice per layer)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one operator for the steps below (bit for bit the same in fp32)
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # The variance is taken in fp32 whatever the weights' dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = parallel.row_linear(c.num_heads * c.head_dim, c.hidden_size, c.attention_bias, tp)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`sin` carries the sign of rotate_half: [-sin, sin] over the two halves of a head (see `rotate`)."""
        c = self.c
        q = self.q_proj(x).view(-1, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = self.attn(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.flatten(1))

    def fuse(self) -> None:
        """One [q; k; v] weight, with the three projections left as views of it (the weight names stay)."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) \
            if self.c.attention_bias else None

    def forward_kernels(self, x: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: KernelMetadata) -> torch.Tensor:
        from engine.kernels.rotary import rope_and_store

        c = self.c
        qkv = nn.functional.linear(x, self.qkv_weight, self.qkv_bias)
        q = rope_and_store(qkv, positions, rope, meta.slot_mapping, k_cache, v_cache, c.num_heads, c.num_kv_heads)
        out = kernel_attention(q, k_cache, v_cache, meta, self.attn.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = parallel.row_linear(c.intermediate_size, c.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> None:
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward_kernels(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.activation import silu_and_mul

        return self.down_proj(silu_and_mul(nn.functional.linear(x, self.gate_up_weight)))


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights along the output dimension and re-point each layer at its slice, so the fused
    weight costs no extra memory and one matrix product replaces several."""
    fused = torch.cat([linear.weight for linear in linears])
    first = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[first:first + rows], requires_grad=False)
        first += rows
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(c, tp)
        self.mlp = MLP(c, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = parallel.embedding(c.vocab_size, c.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(c, tp) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: LlamaConfig, tp: TensorParallel | None = None) -> None:
        """With a tensor-parallel group, `c` is this rank's part of the model (engine/model/sharding.py)."""
        super().__init__()
        self.config = c
        self.model = Backbone(c, tp)
        self.lm_head = parallel.lm_head(c.hidden_size, c.vocab_size, tp)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)
        self.kernels = False

    def use_kernels(self, max_positions: int) -> None:
        """Switch to the kernel path (the GPU's; the CPU runs it only under TRITON_INTERPRET, in tests)."""
        from engine.kernels.rotary import rope_table

        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.register_buffer("rope", rope_table(self.inv_freq, max_positions), persistent=False)
        self.kernels = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | KernelMetadata) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [layers, 2, slots, KVH, D]; returns final hidden states [T, E]."""
        if self.kernels:
            return self._forward_kernels(input_ids, positions, kv_cache,
                                         meta.kernel if isinstance(meta, AttentionMetadata) else meta)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype = self.model.embed_tokens.weight.dtype
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1)
        cos, sin = angles.cos().to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]
        x = self.model.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_cache):  # two operators a layer fewer than [i, 0]
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return self.model.norm(x)

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                         meta: KernelMetadata) -> torch.Tensor:
        from engine.kernels.rmsnorm import add_rms_norm

        eps = self.config.rms_norm_eps
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            h, residual = add_rms_norm(x, residual, layer.input_layernorm.weight, eps)
            x = layer.self_attn.forward_kernels(h, positions, self.rope, kv_cache[i, 0], kv_cache[i, 1], meta)
            h, residual = add_rms_norm(x, residual, layer.post_attention_layernorm.weight, eps)
            x = layer.mlp.forward_kernels(h)
        return add_rms_norm(x, residual, self.model.norm.weight, eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
