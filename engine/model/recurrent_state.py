"""The recurrent state of a hybrid model's linear-attention layers (docs/design.md, Models and kernels): a row per
request slot, beside the KV pages its attention layers use. A row holds, per Gated DeltaNet layer, the short conv's
last `conv_kernel - 1` inputs and the delta rule's state matrix per value head.

Rows are indexed by slot: a slot's row is its request's while the request holds the slot, and a request's first step
(the row that starts at position 0) starts from zeros (RecurrentState.reset). `RecurrentRows` is what a step hands
the layers: the storage and which row each decode row and prefill span reads and writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model.config import DecoderConfig


class RecurrentState:
    def __init__(self, c: DecoderConfig, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        assert c.linear is not None, "only a hybrid model has recurrent state"
        # The conv's inputs in the activations' dtype (what the conv reads); the delta rule's state in float32,
        # as the reference computes it whatever the weights' dtype.
        (layers, *conv), (_, *delta) = self.row_shapes(c)
        self.conv = torch.zeros(layers, rows, *conv, dtype=dtype, device=device)
        self.delta = torch.zeros(layers, rows, *delta, dtype=torch.float32, device=device)

    @staticmethod
    def row_shapes(c: DecoderConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A row's conv inputs and delta-rule state, every linear layer's: ([layers, conv dim, kernel - 1],
        [layers, value heads, key dim, value dim]); the state stores rows second, after the layers."""
        linear, layers = c.linear, sum(c.layer_linear)
        return ((layers, linear.conv_dim, linear.conv_kernel - 1),
                (layers, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim))

    def copy_rows(self, copies: tuple[tuple[int, int], ...]) -> None:
        """(source, destination) row copies in order (Plan.state_copies): a snapshot of a slot may precede a
        restore into the same slot."""
        for source, destination in copies:
            self.conv[:, destination] = self.conv[:, source]
            self.delta[:, destination] = self.delta[:, source]

    def reset(self, rows: torch.Tensor) -> None:
        """Zero these rows: their requests start at position 0."""
        self.conv[:, rows] = 0
        self.delta[:, rows] = 0

    @staticmethod
    def row_bytes(c: DecoderConfig, dtype: torch.dtype) -> int:
        """A row's bytes: its conv inputs in `dtype`, its delta-rule state in float32 (0 without linear layers)."""
        if c.linear is None:
            return 0
        conv, delta = RecurrentState.row_shapes(c)
        return math.prod(conv) * dtype.itemsize + math.prod(delta) * 4


SNAPSHOTS_PER_SLOT = 4
SNAPSHOT_SHARE = 0.25  # of the cache budget, at most, for snapshot rows


def snapshot_rows(c: DecoderConfig, dtype: torch.dtype, slots: int, budget_bytes: int) -> int:
    """How many snapshot rows a hybrid model's engine keeps for exact checkpoints: a few per slot, within a share
    of the cache budget (the KV pages get the rest)."""
    row = RecurrentState.row_bytes(c, dtype)
    return min(SNAPSHOTS_PER_SLOT * slots, int(budget_bytes * SNAPSHOT_SHARE) // row) if row else 0


def host_snapshot_rows(c: DecoderConfig, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many snapshot rows a hybrid model's host tier keeps (docs/design.md, Host retention): the same share of
    its budget as the device's rows take at most of the cache's (the pages get the rest)."""
    row = RecurrentState.row_bytes(c, dtype)
    return int(budget_bytes * SNAPSHOT_SHARE) // row if row else 0


@dataclass(frozen=True)
class RecurrentRows:
    """A step's view of the state: the row each decode row (in AttentionMetadata.decode_rows' order) and each
    prefill span (in AttentionMetadata.prefills' order) continues."""

    state: RecurrentState
    decode: torch.Tensor  # [Bd] int64
    spans: tuple[int, ...]


@dataclass(frozen=True)
class RecurrentBatch:
    """The kernel path's view of the state (KernelMetadata.recurrent): per sequence of the step's DecodeBatch or
    ExtendBatch (in their order), the row it continues and how many tokens precede it (none: it starts from zeros,
    whatever the row holds; -1: a decode graph's padding row, which touches nothing)."""

    state: RecurrentState
    rows: torch.Tensor  # [S] int32
    past: torch.Tensor  # [S] int32
