"""What the draft proposer (engine/speculative/draft.py) and its step-frame rounds (engine/speculative/draft_steps.py)
share: a request's part of a round, the greedy sampling drafts use, and what runs a round of lanes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from common.protocol import SamplingParams
from engine.model.decoder import CausalLM

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Lane:
    """One request's part of a round."""

    slot: int
    generation: int
    start: int  # the first position fed: the draft's KV holds the positions before it
    feed: tuple[int, ...]  # at least one token: the last one's logits give the first draft
    pages: tuple[int, ...]  # the draft's pages, through position start + len(feed) + depth - 2
    depth: int  # drafts to propose


class RoundSteps(Protocol):
    """Runs a round's lanes as step frames on the proposer's KV (DraftSteps eagerly, DraftGraphs in graphs)."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, page_size: int, max_active: int, context_limit: int,
                 prefill_chunk: int, device: torch.device) -> None: ...

    def propose(self, lanes: list[Lane]) -> list[tuple[int, ...]]:
        """Each lane's drafts, lanes deepest first."""
