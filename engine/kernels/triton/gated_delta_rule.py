"""The gated delta rule of a Gated DeltaNet layer (docs/design.md, Hybrid models: linear attention and recurrent
state) over a step's sequences, from the conv's output and the layer's raw decay and write-strength projections.

Fused in, as the torch reference (engine/model/linear_attention.py) computes them apart: q and k L2-normalised per
key head (q scaled by key_head_dim ** -0.5, each key head serving its group of value heads), beta = sigmoid(b)
rounded to the activations' dtype, g = -exp(A_log) * softplus(a + dt_bias) in float32. The state
[value heads, key dim, value dim] stays float32 in its row and is updated in place.

Two forms:
- `recurrent`: one token per sequence (decode steps), one program per (sequence, value head, block of value
  dimensions): the state read once and written once;
- `chunked`: any lengths, 64 tokens a chunk, in two launches. `_prepare` takes every chunk of the step at once (one
  program per chunk and value head, engine/kernels/triton/step_blocks.py): what does not depend on the state, the UT
  transform (the inverse of I + the strictly lower beta k k^T decay matrix) and through it the chunk's values and
  the keys its start state is read through, into float32 scratch. `_carry` then walks each sequence's chunks in
  order (one program per sequence, value head and block of value dimensions), the state carrying from chunk to
  chunk: only its products wait on the previous chunk. Products run on the tensor cores in TF32 for bf16 and fp16
  activations (fp32 accumulation), exactly in fp32 for fp32 ones. A sequence's tokens past its length are zero,
  write nothing and do not decay, as the reference's padding.
A sequence is (first step row, length, tokens before it, state row): one of length 0 (a graph's padding) or of row
-1 touches nothing; one with no tokens before it starts from a zero state whatever its row holds. Rows of no
sequence keep the output's zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.triton.step_blocks import grid_blocks, sequence_block, sequence_bound
from engine.model.linear_attention import chunked as chunked_reference_span
from engine.model.linear_attention import l2norm, recurrent_step

CHUNK = 64


@triton.jit
def _gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, t, mask, h, stride_ab):
    """g (log decay) and beta of tokens t of value head h, float32; 0 where masked (neither decays nor writes)."""
    a = tl.load(a_ptr + t * stride_ab + h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * stride_ab + h, mask=mask, other=0.0)
    x = a + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    beta = tl.sigmoid(b.to(tl.float32)).to(b_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(mask, g, 0.0), tl.where(mask, beta, 0.0)


@triton.jit
def _l2norm(x, axis: tl.constexpr):
    return x * tl.rsqrt(tl.sum(x * x, axis, keep_dims=True) + 1e-6)


@triton.jit
def _recurrent(mixed_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr, row_ptr, token_ptr, past_ptr,
               stride_mixed, stride_ab, stride_state, stride_out, KEY_DIM: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
               HAS_TOKENS: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(row_ptr + s).to(tl.int64)
    past = tl.load(past_ptr + s)  # -1: a padding sequence
    token = s.to(tl.int64)
    if HAS_TOKENS:
        token = tl.load(token_ptr + s).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    live = (i * 0 + row >= 0) & (i * 0 + past >= 0)
    im = (i < DK) & live
    jm = (j < DV) & (j * 0 + row >= 0) & (j * 0 + past >= 0)
    base = mixed_ptr + token * stride_mixed
    kh = h // GROUP
    q = _l2norm(tl.load(base + kh * DK + i, mask=im, other=0.0).to(tl.float32), 0) * (DK ** -0.5)
    k = _l2norm(tl.load(base + KEY_DIM + kh * DK + i, mask=im, other=0.0).to(tl.float32), 0)
    v = tl.load(base + 2 * KEY_DIM + h * DV + j, mask=jm, other=0.0).to(tl.float32)
    g, beta = _gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, token + j * 0, jm, h, stride_ab)
    cell = state_ptr + row * stride_state + h * DK * DV + i[:, None] * DV + j[None, :]
    sm = im[:, None] & jm[None, :]
    state = tl.load(cell, mask=sm & (i * 0 + past > 0)[:, None], other=0.0)
    state = state * tl.exp(g)[None, :]
    delta = (v - tl.sum(state * k[:, None], 0)) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + token * stride_out + h * DV + j, out.to(out_ptr.dtype.element_ty), mask=jm)
    tl.store(cell, state, mask=sm)


@triton.jit
def _prepare(mixed_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, row_ptr, start_ptr, length_ptr, w_ptr, u_ptr,
             decay_ptr, stride_mixed, stride_ab, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
             HEADS: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_DV: tl.constexpr, SEQUENCES: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of one value head, independent of the state: the UT transform. With A the strictly lower
    beta k k^T decay matrix, (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^32) (A^64 = 0), six squarings on the
    tensor cores instead of 63 dependent row updates; then the chunk's values u = (I + A)^-1 beta v and the keys its
    start state is read through, w = (I + A)^-1 beta k e^decay, and the cumulative log decay."""
    s, c0 = sequence_block(length_ptr, row_ptr, tl.program_id(0), SEQUENCES, BLOCK_S, CHUNK)
    if s >= SEQUENCES:
        return
    h = tl.program_id(1)
    start = tl.load(start_ptr + s).to(tl.int64)
    length = tl.load(length_ptr + s)
    kh = h // GROUP
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_DV)
    r = tl.arange(0, CHUNK)
    t = c0 + r
    tm = t < length
    rows = mixed_ptr + (start + t)[:, None] * stride_mixed
    k = _l2norm(tl.load(rows + KEY_DIM + kh * DK + i[None, :], mask=tm[:, None] & (i < DK)[None, :],
                        other=0.0).to(tl.float32), 1)
    v = tl.load(rows + 2 * KEY_DIM + h * DV + j[None, :], mask=tm[:, None] & (j < DV)[None, :],
                other=0.0).to(tl.float32)
    g, beta = _gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, start + t, tm, h, stride_ab)
    decay = tl.cumsum(g, 0)  # padding neither decays nor writes: it keeps the last token's decay
    pair = decay[:, None] - decay[None, :]
    k_beta = k * beta[:, None]
    lower = -tl.dot(k_beta, tl.trans(k), input_precision=PRECISION) * \
        tl.exp(tl.where(r[:, None] > r[None, :], pair, float("-inf")))
    inverse = tl.where(r[:, None] == r[None, :], 1.0, 0.0) + lower
    power = lower
    for _ in tl.static_range(5):
        power = tl.dot(power, power, input_precision=PRECISION)
        inverse += tl.dot(inverse, power, input_precision=PRECISION)
    out = (start + t)[:, None] * HEADS + h
    tl.store(u_ptr + out * DV + j[None, :], tl.dot(inverse, v * beta[:, None], input_precision=PRECISION),
             mask=tm[:, None] & (j < DV)[None, :])
    tl.store(w_ptr + out * DK + i[None, :],
             tl.dot(inverse, k_beta * tl.exp(decay)[:, None], input_precision=PRECISION),
             mask=tm[:, None] & (i < DK)[None, :])
    tl.store(decay_ptr + (start + t) * HEADS + h, decay, mask=tm)


@triton.jit
def _carry(mixed_ptr, w_ptr, u_ptr, decay_ptr, state_ptr, out_ptr, row_ptr, start_ptr, length_ptr, past_ptr,
           stride_mixed, stride_state, stride_out, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
           HEADS: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """A sequence's chunks in order for one value head and block of value dimensions: the part of each chunk's
    values its start state does not predict, the chunk's outputs, and the state it hands the next chunk."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(row_ptr + s).to(tl.int64)
    start = tl.load(start_ptr + s).to(tl.int64)
    length = tl.load(length_ptr + s)
    length = tl.where(row >= 0, length, 0)
    past = tl.load(past_ptr + s)
    kh = h // GROUP
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    r = tl.arange(0, CHUNK)
    im = i < DK
    jm = j < DV
    live = (i * 0 + length > 0)[:, None] & (j * 0 + length > 0)[None, :]
    cell = state_ptr + row * stride_state + h * DK * DV + i[:, None] * DV + j[None, :]
    sm = im[:, None] & jm[None, :] & live
    state = tl.load(cell, mask=sm & (i * 0 + past > 0)[:, None], other=0.0)
    for c0 in range(0, length, CHUNK):
        t = c0 + r
        tm = t < length
        rows = mixed_ptr + (start + t)[:, None] * stride_mixed
        km = tm[:, None] & im[None, :]
        vm = tm[:, None] & jm[None, :]
        q = _l2norm(tl.load(rows + kh * DK + i[None, :], mask=km, other=0.0).to(tl.float32), 1) * (DK ** -0.5)
        k = _l2norm(tl.load(rows + KEY_DIM + kh * DK + i[None, :], mask=km, other=0.0).to(tl.float32), 1)
        at = (start + t)[:, None] * HEADS + h
        w = tl.load(w_ptr + at * DK + i[None, :], mask=km, other=0.0)
        u = tl.load(u_ptr + at * DV + j[None, :], mask=vm, other=0.0)
        decay = tl.load(decay_ptr + (start + t) * HEADS + h, mask=tm, other=0.0)
        last = tl.min(tl.where(tm, decay, 0.0), 0)  # decays only fall: the last token's is the least
        decay = tl.where(tm, decay, last)
        within = tl.dot(q, tl.trans(k), input_precision=PRECISION) * \
            tl.exp(tl.where(r[:, None] >= r[None, :], decay[:, None] - decay[None, :], float("-inf")))
        new = u - tl.dot(w, state, input_precision=PRECISION)  # what the state does not predict
        out = tl.dot(q * tl.exp(decay)[:, None], state, input_precision=PRECISION) + \
            tl.dot(within, new, input_precision=PRECISION)
        tl.store(out_ptr + (start + t)[:, None] * stride_out + h * DV + j[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=vm)
        k_late = k * tl.exp(last - decay)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(k_late), new, input_precision=PRECISION)
    tl.store(cell, state, mask=sm)


def gated_delta_rule(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor | None,
                     lengths: torch.Tensor | None, past: torch.Tensor, num_key_heads: int,
                     out: torch.Tensor | None = None, block_v: int | None = None) -> torch.Tensor:
    """mixed [T, 2 Kd + Vd] (the conv's output: q, k, v side by side), a and b [T, H] (the layer's raw projections,
    rows may be strided), a_log and dt_bias [H], state [rows, H, Dk, Dv] float32 (updated in place). Per sequence i
    (device tensors [S]): state row `rows[i]`, first step row `starts[i]`, `lengths[i]` tokens and `past[i]` tokens
    before them. With `lengths` None every sequence is one token (the recurrent form), token `starts[i]` (token i
    when starts is None), and `past[i]` -1 marks padding. -> out [T, H * Dv] in mixed's dtype."""
    tokens = mixed.shape[0]
    _, heads, dk, dv = state.shape
    key_dim = num_key_heads * dk
    assert mixed.stride(1) == 1 and a.stride(1) == 1 and a.stride(0) == b.stride(0) and state.is_contiguous()
    if out is None:
        out = torch.zeros(tokens, heads * dv, dtype=mixed.dtype, device=mixed.device)
    block_k = max(16, triton.next_power_of_2(dk))
    if block_v is None:  # a chunked step of few sequences walks its chunks on more SMs with narrower blocks
        block_v = 32 if lengths is not None and rows.shape[0] * heads * triton.cdiv(dv, 64) < 128 else 64
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    grid = (rows.shape[0], heads, triton.cdiv(dv, block_v))
    common = (mixed.stride(0), a.stride(0), state.stride(0), out.stride(0))
    if lengths is None:
        _recurrent[grid](mixed, a, b, a_log, dt_bias, state, out, rows, rows if starts is None else starts, past,
                         *common, KEY_DIM=key_dim, DK=dk, DV=dv, GROUP=heads // num_key_heads, BLOCK_K=block_k,
                         BLOCK_V=block_v, HAS_TOKENS=starts is not None, num_warps=4)
    else:
        count, heads_per_key = rows.shape[0], heads // num_key_heads
        precision = "ieee" if mixed.dtype == torch.float32 else "tf32"
        w = torch.empty(tokens, heads, dk, dtype=torch.float32, device=mixed.device)
        u = torch.empty(tokens, heads, dv, dtype=torch.float32, device=mixed.device)
        decay = torch.empty(tokens, heads, dtype=torch.float32, device=mixed.device)
        _prepare[(grid_blocks(tokens, count, CHUNK), heads)](
            mixed, a, b, a_log, dt_bias, rows, starts, lengths, w, u, decay, mixed.stride(0), a.stride(0),
            KEY_DIM=key_dim, DK=dk, DV=dv, HEADS=heads, GROUP=heads_per_key, CHUNK=CHUNK, BLOCK_K=block_k,
            BLOCK_DV=max(16, triton.next_power_of_2(dv)), SEQUENCES=count,
            BLOCK_S=sequence_bound(count), PRECISION=precision, num_warps=4)
        _carry[grid](mixed, w, u, decay, state, out, rows, starts, lengths, past, mixed.stride(0), state.stride(0),
                     out.stride(0), KEY_DIM=key_dim, DK=dk, DV=dv, HEADS=heads, GROUP=heads_per_key, CHUNK=CHUNK,
                     BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision, num_warps=4,
                     num_stages=2)  # three stages of the chunk's loads need more shared memory than an SM has
    return out


def gated_delta_rule_reference(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                               dt_bias: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                               starts: torch.Tensor | None, lengths: torch.Tensor | None, past: torch.Tensor,
                               num_key_heads: int) -> torch.Tensor:
    """The layer's own ops (engine/model/linear_attention.py: heads, recurrent_step, chunked), a sequence at a time."""
    tokens = mixed.shape[0]
    _, heads, dk, dv = state.shape
    key_dim = num_key_heads * dk
    out = torch.zeros(tokens, heads, dv, dtype=mixed.dtype, device=mixed.device)
    count = rows.shape[0]
    firsts = (torch.arange(count) if starts is None else starts).tolist()
    spans = [1] * count if lengths is None else lengths.tolist()
    for row, first, length, before in zip(rows.tolist(), firsts, spans, past.tolist()):
        if row < 0 or length == 0 or before < 0:
            continue
        x = mixed[first:first + length].float()
        q, k, v = x.split((key_dim, key_dim, heads * dv), dim=-1)
        q, k = (l2norm(t.reshape(length, num_key_heads, dk)).repeat_interleave(heads // num_key_heads, dim=1)
                for t in (q, k))
        v = v.reshape(length, heads, dv)
        beta = torch.sigmoid(b[first:first + length])
        g = -a_log.float().exp() * F.softplus(a[first:first + length].float() + dt_bias)
        initial = state[row] if before > 0 else torch.zeros_like(state[row])
        if lengths is None:
            result, state[row] = (t[0] for t in recurrent_step(q, k, v, g, beta, initial[None]))
            out[first] = result.to(out.dtype)
        else:
            result, state[row] = chunked_reference_span(q, k, v, g, beta, initial)
            out[first:first + length] = result.to(out.dtype)
    return out.flatten(1)
