"""Mixture-of-experts routing (docs/design.md, Models and kernels): the softmax of a token's router logits in float32, its
top k experts (the largest first, the lowest id among equals), and with `renormalize` their k weights scaled to sum
to one (transformers' Mixtral; Qwen3-MoE's norm_topk_prob).

Every id is an expert, whatever the logits: a row of NaN (a padding row's undefined activations, an overflow) compares
equal to nothing, and an id past the experts would send the grouped kernels' sort and gathers out of bounds (a
device-side assert that poisons the whole CUDA context), so such a row takes the last expert; its output is as
undefined as its input.

`route` is the torch reference; `route_in_one_program` is the same in one Triton launch, a program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.dependent_launch import NONE, launch_options, release, wait


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@triton.jit
def top_k_experts(logits_ptr, num_experts, TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    """The logits at logits_ptr (one token's) -> (weights [K_POW2] float32, ids [K_POW2] int32); slots past TOP_K
    hold zeros."""
    e = tl.arange(0, E_POW2)
    logits = tl.load(logits_ptr + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, 0))
    probs = exps / tl.sum(exps, 0)
    k = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], tl.float32)
    ids = tl.zeros([K_POW2], tl.int32)
    for slot in tl.static_range(TOP_K):  # the largest left, the lowest id among equals
        best = tl.max(probs, 0)
        expert = tl.minimum(tl.min(tl.where(probs == best, e, E_POW2), 0), num_experts - 1)
        weights = tl.where(k == slot, best, weights)
        ids = tl.where(k == slot, expert, ids)
        probs = tl.where(e == expert, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    return weights, ids


@triton.jit
def _route(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
           E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, DEPENDENT: tl.constexpr):
    wait(DEPENDENT)  # a program per token, over at once
    release(DEPENDENT)
    t = tl.program_id(0)
    weights, ids = top_k_experts(logits_ptr + t * stride_t, num_experts, TOP_K, K_POW2, E_POW2, RENORMALIZE)
    k = tl.arange(0, K_POW2)
    tl.store(weights_ptr + t * TOP_K + k, weights, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def route_in_one_program(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool, dependent: int = NONE) -> tuple[torch.Tensor, torch.Tensor]:
    """route in one launch per layer, a program per token: torch's softmax, topk and renormalisation are seven
    kernels of 1-5 µs, a sixth of a batch-1 decode layer of Qwen3-30B-A3B. `dependent`: launched as a dependent
    launch (engine/kernels/triton/dependent_launch.py)."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        _route[(tokens,)](router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
                          K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(experts),
                          RENORMALIZE=renormalize, DEPENDENT=dependent, num_warps=1, **launch_options(dependent))
    return weights, ids
