"""The gated delta rule of engine/model/linear_attention.py against transformers' torch references: the chunked form
from a carried state and the one-token form give transformers' outputs and final state, with key heads serving
several value heads and a length that is not a multiple of the chunk."""

from __future__ import annotations

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                 torch_recurrent_gated_delta_rule)

from engine.model.linear_attention import chunked, l2norm, recurrent_step

KEY_HEADS, VALUE_HEADS, DK, DV = 2, 4, 16, 8


def inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q, k = torch.randn(length, KEY_HEADS, DK), torch.randn(length, KEY_HEADS, DK)
    v = torch.randn(length, VALUE_HEADS, DV)
    g = -torch.rand(length, VALUE_HEADS) * 2
    beta = torch.rand(length, VALUE_HEADS)
    state = torch.randn(VALUE_HEADS, DK, DV)
    return q, k, v, g, beta, state


def flare_heads(t: torch.Tensor) -> torch.Tensor:
    """As GatedDeltaNet.heads gives them: L2-normalised, each key head repeated for its value heads."""
    return l2norm(t).repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=1)


def test_the_chunked_rule_from_a_state_equals_transformers() -> None:
    q, k, v, g, beta, state = inputs(100, 0)
    out, final = chunked(flare_heads(q), flare_heads(k), v, g, beta, state)
    expected, expected_final = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, expected_final[0], rtol=1e-5, atol=1e-5)


def test_the_one_token_rule_equals_transformers_and_continues_the_chunked_one() -> None:
    q, k, v, g, beta, state = inputs(3, 1)
    states = state[None].repeat(3, 1, 1, 1)  # three rows, one token each
    out, final = recurrent_step(flare_heads(q), flare_heads(k), v, g, beta, states)
    for row in range(3):
        expected, expected_final = torch_recurrent_gated_delta_rule(
            q[None, row:row + 1], k[None, row:row + 1], v[None, row:row + 1], g[None, row:row + 1],
            beta[None, row:row + 1], initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[row], expected[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[row], expected_final[0], rtol=1e-5, atol=1e-5)
    # Token by token from the same state: what the chunked form gives at once.
    whole, whole_final = chunked(flare_heads(q), flare_heads(k), v, g, beta, state)
    carried = state[None]
    for t in range(3):
        step, carried = recurrent_step(flare_heads(q[t:t + 1]), flare_heads(k[t:t + 1]), v[t:t + 1], g[t:t + 1],
                                       beta[t:t + 1], carried)
        torch.testing.assert_close(step[0], whole[t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(carried[0], whole_final, rtol=1e-5, atol=1e-5)
