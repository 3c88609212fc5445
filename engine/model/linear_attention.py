"""Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next (docs/design.md, Models and kernels), in plain
torch: the reference the engine runs on any device.

Per token: `in_proj_qkv` gives q, k (key heads) and v (value heads), which a depthwise causal conv (kernel 4, SiLU)
mixes with the previous three tokens'; `in_proj_z` the output gate; `in_proj_b` beta = sigmoid(b), the write
strength; `in_proj_a` the decay g = -exp(A_log) * softplus(a + dt_bias), in log space. q and k are L2-normalised, q
scaled by key_head_dim ** -0.5, and each key head serves num_value_heads // num_key_heads value heads. The state S
[value heads, key dim, value dim] follows the gated delta rule,

    S = exp(g) * S;   S = S + k (beta * (v - S^T k))^T;   out = S^T q

token by token for single-token rows (decode), and in its chunked form (64 tokens a chunk, a triangular solve within
the chunk, the state carried between chunks) for prefill spans. The output is RMS-normalised per value head, times
SiLU(z), then `out_proj`. Qwen3-Next's checkpoints hold q, k, v, z and b, a interleaved per key head
(`in_proj_qkvz`, `in_proj_ba`): ignition reorders them into these four projections at export
(ignition/families.py).

The conv's last inputs and S live in a row per request (engine/model/recurrent_state.py); a step's AttentionMetadata
says which row each decode row and prefill span continues (`recurrent`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import AttentionMetadata
from engine.model.config import DecoderConfig
from engine.model.norms import RMSNorm
from engine.parallel import layers as parallel
from engine.parallel.group import TensorParallel

CHUNK = 64


class GatedRMSNorm(RMSNorm):
    """RMSNorm of each value head's output (weight w, not 1 + w), times SiLU of the gate, in float32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self.weight * self.normalise(x).to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: DecoderConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        linear = c.linear
        assert linear is not None
        self.shape = linear
        self.state_layer = sum(c.layer_linear[:layer])  # its index in the recurrent state
        self.in_proj_qkv = nn.Linear(c.hidden_size, linear.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, linear.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, linear.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, linear.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(linear.conv_dim, linear.conv_dim, linear.conv_kernel, groups=linear.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(linear.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(linear.num_value_heads))
        self.norm = GatedRMSNorm(linear.value_head_dim, c.rms_norm_eps)
        self.out_proj = parallel.row_linear(linear.value_dim, c.hidden_size, False, tp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, E] (the step's rows) -> [T, E]; reads and advances the state rows meta.recurrent names."""
        shape, rows = self.shape, meta.recurrent
        assert rows is not None, "a linear-attention layer needs the step's recurrent rows"
        conv_state, delta_state = rows.state.conv[self.state_layer], rows.state.delta[self.state_layer]
        qkv = self.in_proj_qkv(x)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = torch.empty(x.shape[0], shape.num_value_heads, shape.value_head_dim, dtype=x.dtype, device=x.device)
        weight = self.conv1d.weight  # [C, 1, K]
        if meta.decode_rows.numel():
            token_rows, state_rows = meta.decode_rows, rows.decode
            window = torch.cat((conv_state[state_rows], qkv[token_rows, :, None]), dim=-1)  # [B, C, K]
            conv_state[state_rows] = window[:, :, 1:]
            mixed = F.silu(F.conv1d(window, weight, groups=shape.conv_dim)[:, :, 0])  # the conv's one output a row
            q, k, v = self.heads(mixed)
            step, delta_state[state_rows] = recurrent_step(q, k, v, g[token_rows], beta[token_rows],
                                                           delta_state[state_rows])
            out[token_rows] = step.to(x.dtype)
        for span, row in zip(meta.prefills, rows.spans):
            tokens = slice(span.start, span.start + span.length)
            window = torch.cat((conv_state[row], qkv[tokens].T), dim=-1)  # [C, K - 1 + L]
            conv_state[row] = window[:, -(shape.conv_kernel - 1):]
            mixed = F.silu(F.conv1d(window[None], weight, groups=shape.conv_dim)[0].T)  # [L, C]
            q, k, v = self.heads(mixed)
            span_out, delta_state[row] = chunked(q, k, v, g[tokens], beta[tokens], delta_state[row])
            out[tokens] = span_out.to(x.dtype)
        z = self.in_proj_z(x).view_as(out)
        return self.out_proj(self.norm(out, z).flatten(1))

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, C] conv outputs -> q, k [N, value heads, Dk] (each key head repeated for its value heads), L2-normalised
        in float32, and v [N, value heads, Dv] in float32."""
        s = self.shape
        q, k, v = mixed.float().split((s.key_dim, s.key_dim, s.value_dim), dim=-1)
        group = s.num_value_heads // s.num_key_heads
        q, k = (l2norm(t.reshape(-1, s.num_key_heads, s.key_head_dim)).repeat_interleave(group, dim=1)
                for t in (q, k))
        return q, k, v.reshape(-1, s.num_value_heads, s.value_head_dim)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, H, Dk], v [B, H, Dv], g and beta [B, H], state [B, H, Dk, Dv] ->
    (out [B, H, Dv], the new state), float32."""
    q = q / q.shape[-1] ** 0.5
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # what the state already holds for k
    delta = (v - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence of L tokens from `state`: q, k [L, H, Dk], v [L, H, Dv], g and beta [L, H], state [H, Dk, Dv] ->
    (out [L, H, Dv], the state after the last token), float32. Within a chunk the delta rule's L updates are one
    triangular solve (the UT transform); between chunks the state carries the rest."""
    length = q.shape[0]
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, L + pad, D]
    beta, g = (F.pad(t.float().T, (0, pad)) for t in (beta, g))  # [H, L + pad]; padding neither writes nor decays
    q = q * q.shape[-1] ** -0.5
    heads, chunks = q.shape[0], q.shape[1] // CHUNK
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(heads, chunks, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, chunks, CHUNK).cumsum(-1)  # log of the decay from the chunk's start to each token
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    within = (q @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(chunks):
        new = values[:, i] - keys_read[:, i] @ state  # the part of the chunk's values the state does not predict
        out[:, i] = q[:, i] @ state + within[:, i] @ new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ new
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1), state
