"""What a step reads for embeddings (docs/design.md, Embeddings): per pooling row (Row.pool), the sum of its final
hidden states ("mean") or its last token's ("last"), in float32, for the scheduler to gather into the request's
vector. The hidden states are the model's after its final norm, as sentence-transformers' pooling reads them.

Both executors pool alike: the eager one from the step's hidden states, the graph one from the extend graphs' kept
copy of them (engine/sampling/graph_extras.py), with the index uploaded beside the step's frame."""

from __future__ import annotations

import numpy as np
import torch

from engine.scheduler.plan import POOL, Plan, Row, fields

Pooled = tuple[tuple[int, int, int, np.ndarray], ...]  # Completion.pooled


def pools(plan: Plan) -> bool:
    """Whether some row of the plan pools (a pass at C speed: every step asks)."""
    return any(fields(plan.rows, POOL))


def pool_index(plan: Plan) -> tuple[tuple[Row, ...], np.ndarray]:
    """The plan's pooling rows, and int64 [2, n]: each pooled token's row in the step, and which pooling row (its
    index among them) it adds into."""
    rows: list[Row] = []
    firsts: list[int] = []  # each pooling row's first pooled token in the step
    counts: list[int] = []
    first = 0
    for row in plan.rows:
        if row.pool:
            rows.append(row)
            firsts.append(first if row.pool == "mean" else first + row.length - 1)
            counts.append(row.length if row.pool == "mean" else 1)
        first += row.length
    counts_array = np.array(counts, dtype=np.int64)
    into = np.repeat(np.arange(len(rows), dtype=np.int64), counts_array)
    # (token i of pooling row r lies at firsts[r] + i: an arange over them all, moved by each row's offset)
    offsets = np.array(firsts, dtype=np.int64) - (np.cumsum(counts_array) - counts_array)
    tokens = np.arange(int(counts_array.sum()), dtype=np.int64) + np.repeat(offsets, counts_array)
    return tuple(rows), np.stack([tokens, into])


def pool_rows(hidden: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """`out` ([pooling rows, hidden], float32): each pooling row's sum of its tokens' states in `hidden`."""
    out.zero_()
    out.index_add_(0, index[1], hidden.index_select(0, index[0]).float())


def assemble(rows: tuple[Row, ...], vectors: np.ndarray) -> Pooled:
    return tuple((row.slot, row.generation, row.start, vector) for row, vector in zip(rows, vectors))


def eager_pooled(plan: Plan, hidden: torch.Tensor) -> Pooled:
    """`hidden`: the step's final hidden states, [tokens, hidden], rows in plan order."""
    if not pools(plan):
        return ()
    rows, index = pool_index(plan)
    out = torch.empty(len(rows), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    pool_rows(hidden, torch.from_numpy(index).to(hidden.device), out)
    return assemble(rows, out.cpu().numpy())  # one copy to the host for the step
