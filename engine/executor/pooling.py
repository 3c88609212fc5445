"""What a step reads for embeddings (docs/design.md, Embeddings): per pooling row (Row.pool), the sum of its final
hidden states ("mean") or its last token's ("last"), in float32, for the scheduler to gather into the request's
vector. The hidden states are the model's after its final norm, as sentence-transformers' pooling reads them."""

from __future__ import annotations

import numpy as np
import torch

from engine.scheduler.plan import POOL, Plan, fields

Pooled = tuple[tuple[int, int, int, np.ndarray], ...]  # Completion.pooled


def eager_pooled(plan: Plan, hidden: torch.Tensor) -> Pooled:
    """`hidden`: the step's final hidden states, [tokens, hidden], rows in plan order."""
    if not any(fields(plan.rows, POOL)):
        return ()
    found, first = [], 0
    for row in plan.rows:
        if row.pool == "mean":
            found.append((row, hidden[first:first + row.length].float().sum(dim=0)))
        elif row.pool == "last":
            found.append((row, hidden[first + row.length - 1].float()))
        first += row.length
    vectors = torch.stack([vector for _, vector in found]).cpu().numpy()  # one copy to the host for the step
    return tuple((row.slot, row.generation, row.start, vector) for (row, _), vector in zip(found, vectors))
