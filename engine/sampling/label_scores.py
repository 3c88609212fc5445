"""Label logits of scored prefills (docs/design.md, Beyond plain decoding: Decisions).

A row of a scored prefill carries label queries: at a position of the row, the logits of a few label tokens. The
eager executor computes the logits of every queried position; a graph step already holds, per sequence row, the
logits of the row's last token, so it reads queries at that position by a flat index into its logits buffer.
Both turn the values they read into the Completion's `scores` here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.scheduler.plan import Plan

Scores = tuple[tuple[int, int, int, tuple[float, ...]], ...]  # Completion.scores


@dataclass(frozen=True)
class Query:
    slot: int
    generation: int
    position: int
    token_ids: tuple[int, ...]
    token_row: int  # the step's flat token row at `position`
    sequence: int  # index of the query's row in the plan
    last: bool  # `position` is its row's last token


def queries(plan: Plan) -> list[Query]:
    found, first = [], 0
    for index, row in enumerate(plan.rows):
        for position, token_ids in row.scores:
            offset = position - row.start
            found.append(Query(row.slot, row.generation, position, token_ids, first + offset, index,
                               offset == row.length - 1))
        first += row.length
    return found


def assemble(found: list[Query], values: list[float]) -> Scores:
    """`values` holds every query's label logits, one after the other in query order."""
    scores, at = [], 0
    for query in found:
        scores.append((query.slot, query.generation, query.position, tuple(values[at:at + len(query.token_ids)])))
        at += len(query.token_ids)
    return tuple(scores)


def eager_scores(plan: Plan, hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]) -> Scores:
    """The labels' logits at every queried token row of `hidden` ([T, hidden]); `logits` is the model's head."""
    found = queries(plan)
    if not found:
        return ()
    device = hidden.device
    rows = logits(hidden[torch.tensor([q.token_row for q in found], device=device)])
    vocab = rows.shape[-1]
    flat = torch.tensor([i * vocab + t for i, q in enumerate(found) for t in q.token_ids], device=device)
    return assemble(found, rows.flatten()[flat].tolist())


def graph_index(plan: Plan, vocab: int) -> tuple[list[Query], list[int]] | None:
    """Flat indices into a graph step's logits ([sequences, vocab]: each row's last token) of every query's
    labels; None when a query reads another position (the step then runs eagerly)."""
    found = queries(plan)
    if any(not q.last for q in found):
        return None
    return found, [q.sequence * vocab + t for q in found for t in q.token_ids]
