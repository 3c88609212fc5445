"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen3.5-MoE, Qwen3-Next): a router picks the top k of E
experts per token. Qwen3.5-MoE and Qwen3-Next add a shared expert every token runs, its output scaled by a sigmoid
gate (`shared_expert_gate [1, H]`) and added to the routed experts'.

Expert weights are stacked per layer, the layout the fused kernel reads in place (engine/kernels/triton/fused_moe.py,
which the kernel path runs: engine/model/backends/triton_layers.py):
`w13 [E, 2I, H]` (each expert's gate_proj rows, then its up_proj rows) and `w2 [E, H, I]`; the router is `[E, H]`.
Routing is transformers': softmax of the router logits in float32, top k, renormalised to sum to one when the family
says (`norm_topk_prob`; Mixtral always).

An FP8 core's experts stay e4m3 on a single rank's kernel path, with their scales (`use_fp8`); the fused kernels
dequantize them in registers, and the torch reference here dequantizes each expert it runs.

Tensor parallelism splits every expert by its MLP columns (w13 rows, w2 columns), as the dense MLP is split: each rank
holds a slice of every expert, so the work stays balanced whatever the routing, and the layer ends in the same one
all-reduce (engine/model/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import DecoderConfig
from engine.parallel.group import TensorParallel


class SparseMoE(nn.Module):
    def __init__(self, c: DecoderConfig, tp: TensorParallel | None = None, shared: nn.Module | None = None) -> None:
        """`shared`: the shared expert (a dense MLP of the family's shared_expert_intermediate_size), if any."""
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)  # the router
        inter = c.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(c.num_experts, 2 * inter, c.hidden_size))
        self.w2 = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, inter))
        self.scales = None  # FP8 experts' (use_fp8)
        self.tp = tp
        if shared is not None:
            self.shared_expert = shared
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] float32, expert ids [T, K] int32). No host sync: graphs capture it."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.to(torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: each expert that some token chose runs on its tokens; results are summed per token."""
        weights, ids = self.route(x)
        weights = weights.to(x.dtype)  # transformers rounds the routing weights to the activations' dtype
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.where(ids == expert)
            gate, up = nn.functional.linear(x[token], self.expert("w13", expert, x.dtype)).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.expert("w2", expert, x.dtype))
            out.index_add_(0, token, y * weights[token, slot, None])
        return self.with_shared(x, self.all_reduce(out))

    def use_fp8(self, w13: torch.Tensor, w2: torch.Tensor, scales: object) -> None:
        """FP8 experts on the kernel path (engine/model/fp8_linear.py, fp8_experts): e4m3 `w13` and `w2` with their
        scales (engine/kernels/triton/moe_rows.py, ExpertScales), which the fused kernels dequantize in registers."""
        del self.w13, self.w2
        self.register_buffer("w13", w13.contiguous(), persistent=False)
        self.register_buffer("w2", w2.contiguous(), persistent=False)
        self.scales = scales

    def expert(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s `name` weight ("w13" or "w2"); an FP8 one dequantized to `dtype`."""
        weight = getattr(self, name)[expert]
        if self.scales is None:
            return weight
        scale = getattr(self.scales, name)[expert]
        if self.scales.scale_k is not None:
            scale = scale.repeat_interleave(self.scales.scale_k, dim=-1)[:, :weight.shape[-1]]
        return (weight.float() * scale).to(dtype)

    def with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus the shared expert's, where the family has one."""
        if not hasattr(self, "shared_expert"):
            return routed
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's partial one (the sum over ranks; one rank: as it is)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)
