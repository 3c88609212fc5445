"""Layers whose weights are split over the tensor-parallel ranks, and the collective that makes each whole again.

Column-parallel projections need no layer of their own: a rank's q/k/v and gate/up are plain Linear layers over its
heads and MLP columns (engine/model/sharding.py). Each factory returns the plain layer without a group, so a single
rank runs exactly the model it ran before tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.sharding import balanced
from engine.parallel.group import TensorParallel


class RowParallelLinear(nn.Linear):
    """Input features split over ranks: the partial products are summed by an all-reduce; the bias (whole on every
    rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Vocabulary rows split over ranks: each rank embeds the ids it holds, zeros elsewhere, and the all-reduce
    assembles every row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        rows = balanced(vocab_size, tp.world_size, tp.rank)
        super().__init__(len(rows), hidden_size)
        self.first = rows.start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        held = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(held, local, 0), self.weight).masked_fill_(~held.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class VocabParallelHead(nn.Linear):
    """Vocabulary rows split over ranks: every rank gathers all the logits, so each can sample the same tokens."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        sizes = [len(balanced(vocab_size, tp.world_size, r)) for r in range(tp.world_size)]
        super().__init__(hidden_size, sizes[tp.rank], bias=False)
        self.sizes = sizes
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_last(F.linear(x, self.weight), self.sizes)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Linear:
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel | None) -> nn.Embedding:
    return nn.Embedding(vocab_size, hidden_size) if tp is None else VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallel | None) -> nn.Linear:
    if tp is None:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return VocabParallelHead(hidden_size, vocab_size, tp)
