"""Per-slot penalty state: output token counts and the tokens seen (prompt and output), kept on the device by both
executors (docs/design.md, Executors and CUDA graphs; engine/sampling/sampler.py's penalties read it). The executors count each drawn token
themselves; these are the updates of the tokens the host gives a step (prompt chunks, a restarted request's
history and earlier outputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.executor.inputs import any_penalty
from engine.scheduler.plan import SAMPLING, Row


def known_tokens(rows: Sequence[Row], vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The penalty-state updates of the tokens the host gives these rows: slots to clear (a request's first row),
    flat [slot, token] indices seen, flat indices to count once each (a recomputed request's earlier outputs)."""
    reset, seen, counted = [], [], []
    for row in rows:
        if row.tokens is None or row.draft:
            continue
        known = list(row.tokens)
        if row.history is not None:
            reset.append(row.slot)
            known = list(row.history) + known
        first = row.start - (len(known) - row.length)  # the position of known[0]
        base = row.slot * vocab
        seen.extend(base + token for token in known)
        counted.extend(base + token for token in known[max(row.prompt_len - first, 0):])
    return tuple(np.asarray(values, dtype=np.int64) for values in (reset, seen, counted))


def penalised_rows(rows: Sequence[Row]) -> list[Row]:
    """Rows whose request reads its penalty state: only theirs must be kept (others' is never read)."""
    return [row for row, params in zip(rows, map(SAMPLING, rows)) if any_penalty((params,))]


def apply_known_tokens(counts: torch.Tensor, seen: torch.Tensor, reset: torch.Tensor, seen_index: torch.Tensor,
                       counted: torch.Tensor) -> None:
    """`known_tokens`' updates on the device (counts int32 [slots, V], seen bool [slots, V])."""
    counts[reset] = 0
    seen[reset] = False
    seen.view(-1)[seen_index] = True
    counts.view(-1).index_put_((counted,), torch.ones_like(counted, dtype=counts.dtype), accumulate=True)
