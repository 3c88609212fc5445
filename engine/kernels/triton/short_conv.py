"""The causal depthwise conv of a Gated DeltaNet layer (docs/design.md, Hybrid models: linear attention and recurrent
state), with its SiLU, over a step's sequences: each reads the last `kernel - 1` inputs of its state row before its
first token and leaves its own last inputs there.

A sequence is (first step row, length, tokens before it, state row): prefill spans and decode rows (length 1) alike,
so one launch serves any step. Each program takes one block of a sequence's tokens and of channels
(engine/kernels/triton/step_blocks.py); a sequence's first block is the only one that reads its old state, and it
writes the new one after its reads. A sequence of length 0 (a graph's padding) reads and writes nothing; one with no
tokens before it starts from zeros whatever its row holds (a request's first step). Rows of no sequence are left as
they are, so the caller hands in zeros there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.triton.step_blocks import grid_blocks, sequence_block, sequence_bound


@triton.jit
def _short_conv(x_ptr, w_ptr, state_ptr, out_ptr, row_ptr, start_ptr, length_ptr, past_ptr, stride_x, stride_out,
                stride_state, CHANNELS: tl.constexpr, KERNEL: tl.constexpr, TAIL: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEQUENCES: tl.constexpr, BLOCK_S: tl.constexpr):
    s, t0 = sequence_block(length_ptr, row_ptr, tl.program_id(0), SEQUENCES, BLOCK_S, BLOCK_T)
    if s >= SEQUENCES:
        return
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < CHANNELS
    row = tl.load(row_ptr + s).to(tl.int64)
    start = tl.load(start_ptr + s).to(tl.int64)
    length = tl.load(length_ptr + s)
    past = tl.load(past_ptr + s)  # tokens before the sequence: none, and it starts from zeros
    state = state_ptr + row * stride_state + c * (KERNEL - 1)
    dtype = out_ptr.dtype.element_ty
    t = t0 + tl.arange(0, BLOCK_T)
    tm = t < length
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        r = t - (KERNEL - 1) + j  # the input this tap reads, relative to the sequence's first token
        xm = ((r >= 0) & tm)[:, None] & cm[None, :]
        xv = tl.load(x_ptr + (start + r)[:, None] * stride_x + c[None, :], mask=xm, other=0.0)
        sm = ((r < 0) & tm & (r * 0 + past > 0))[:, None] & cm[None, :]
        sv = tl.load(state[None, :] + (KERNEL - 1 + r)[:, None], mask=sm, other=0.0)
        w = tl.load(w_ptr + c * KERNEL + j, mask=cm, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    y = acc.to(dtype).to(tl.float32)  # the conv's output rounds, then its SiLU, as the reference's do
    y = y * tl.sigmoid(y)
    tl.store(out_ptr + (start + t)[:, None] * stride_out + c[None, :], y.to(dtype), mask=tm[:, None] & cm[None, :])
    if t0 == 0:  # the new state: the window's last KERNEL - 1 inputs, the sequence's or the old state's
        tail = tl.arange(0, TAIL)  # window index length + i
        w_index = length + tail
        from_x = w_index >= KERNEL - 1
        keep = (tail * 0 + past > 0)[:, None]
        write = (tail < KERNEL - 1)[:, None] & cm[None, :]
        x_tail = tl.load(x_ptr + (start + w_index - (KERNEL - 1))[:, None] * stride_x + c[None, :],
                         mask=write & from_x[:, None], other=0.0)
        s_tail = tl.load(state[None, :] + tl.where(from_x, 0, w_index)[:, None],
                         mask=write & ~from_x[:, None] & keep, other=0.0)
        new = tl.where(from_x[:, None], x_tail.to(tl.float32), s_tail.to(tl.float32))
        tl.debug_barrier()  # every thread's reads of the old state come first
        tl.store(state[None, :] + tail[:, None], new.to(state_ptr.dtype.element_ty), mask=write)


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
               lengths: torch.Tensor, past: torch.Tensor, out: torch.Tensor | None = None,
               block_c: int = 128) -> torch.Tensor:
    """x [T, C] (rows may be strided: a column slice of a fused product); weight [C, K]; state [rows, C, K - 1]
    (updated in place). Per sequence i (device tensors [S]): its state row `rows[i]` (-1: none), first step row
    `starts[i]`, `lengths[i]` tokens, `past[i]` tokens before them. -> SiLU(conv) [T, C] in x's dtype; rows of no
    sequence are `out`'s (zeros when not given)."""
    tokens, channels = x.shape
    kernel = weight.shape[-1]
    assert x.stride(1) == 1 and state.stride(2) == 1 and state.stride(1) == kernel - 1
    if out is None:
        out = torch.zeros(tokens, channels, dtype=x.dtype, device=x.device)
    count = rows.shape[0]
    block_t = 16 if tokens <= count else 64  # decode steps: one token a sequence
    grid = (grid_blocks(tokens, count, block_t), triton.cdiv(channels, block_c))
    _short_conv[grid](x, weight.reshape(channels, kernel), state, out, rows, starts, lengths, past, x.stride(0),
                      out.stride(0), state.stride(0), CHANNELS=channels, KERNEL=kernel,
                      TAIL=triton.next_power_of_2(kernel - 1), BLOCK_T=block_t, BLOCK_C=block_c,
                      SEQUENCES=count, BLOCK_S=sequence_bound(count), num_warps=4)
    return out


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
                         starts: torch.Tensor, lengths: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """The linear-attention layer's own conv (engine/model/linear_attention.py), a sequence at a time."""
    tokens, channels = x.shape
    kernel = weight.shape[-1]
    out = torch.zeros(tokens, channels, dtype=x.dtype, device=x.device)
    for row, start, length, before in zip(rows.tolist(), starts.tolist(), lengths.tolist(), past.tolist()):
        if row < 0 or length == 0:
            continue
        old = state[row] if before > 0 else torch.zeros_like(state[row])
        window = torch.cat((old, x[start:start + length].T), dim=-1)
        state[row] = window[:, -(kernel - 1):]
        out[start:start + length] = F.silu(F.conv1d(window[None], weight.reshape(channels, 1, kernel),
                                                    groups=channels)[0].T)
    return out
