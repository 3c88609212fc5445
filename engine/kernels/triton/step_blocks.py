"""Spreading a step's sequences over a grid of fixed-size token blocks, so that one launch of a fixed grid (a captured
graph's) covers any split of the step's tokens: program p takes the p-th block of the step, sequence after sequence,
each sequence's first block starting at its first token. A sequence of length L takes ceil(L / BLOCK) blocks, so a
grid of ceil(tokens / BLOCK) + sequences programs covers every step; the programs past the last block have nothing
to do.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_block(length_ptr, row_ptr, p, SEQUENCES: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    """(sequence, first token of the block within it) of program p; sequence SEQUENCES past the last block. A
    sequence whose state row is -1 has no blocks."""
    n = tl.arange(0, BLOCK_S)
    live = n < SEQUENCES
    length = tl.load(length_ptr + n, mask=live, other=0)
    length = tl.where(tl.load(row_ptr + n, mask=live, other=-1) >= 0, length, 0)
    ends = tl.cumsum((length + BLOCK - 1) // BLOCK, 0)
    s = tl.sum((ends <= p).to(tl.int32), 0)
    before = tl.sum(tl.where(n == s - 1, ends, 0), 0)
    return s, (p - before) * BLOCK


def grid_blocks(tokens: int, sequences: int, block: int) -> int:
    """Programs enough for any split of `tokens` over `sequences`: at most one partial block a sequence."""
    return triton.cdiv(tokens, block) + sequences


def sequence_bound(sequences: int) -> int:
    """BLOCK_S for `sequences`: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(sequences))
