"""The scheduler's side of speculation: which requests draft and how deep, which of them wait for their step in
flight, what their proposals are, and what each verify round taught (docs/speculative.md).

A request drafts when its own acceptance history says a verify round of width W = depth + 1 yields more tokens per
second than a plain decode step: expected tokens (engine/speculative/acceptance.py) over the learned duration of
that step shape (engine/scheduler/policy.py GraphCostModel: ("decode", batch) and ("verify", batch, W)). A small
time budget, PROBE_FRACTION of measured step time, funds rounds one width deeper than the best, so estimates that
look worse are revisited and do not freeze. Requests that ask for penalties, logprobs, an unmet min_tokens, or a
grammar (its mask per position would need the matcher advanced through the drafts), or that opted out
(SamplingParams.speculative), always decode plainly. Requests with images draft too: a verify row carries the
request's rope shift and images, so its text positions are those of a plain decode row (engine/executor/images.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from engine.scheduler.policy import GraphCostModel, decode_capacity
from engine.scheduler.request import Request, SpeculationState
from engine.speculative.acceptance import MAX_DEPTH, AcceptanceStats, expected_tokens

WIDTHS = (2, 4, MAX_DEPTH + 1)  # verify step widths (target positions per request); depth = width - 1
PROBE_FRACTION = 0.02  # of measured step time, spent on rounds one width deeper than the best

PROPOSAL_AGEING = 0.2  # weight of the newest round in the proposal cost's mean
MAX_PROBE_CREDIT = 1.0  # seconds: idle stretches do not bank an unbounded probing spree


class Proposer(Protocol):
    name: str

    def available(self, request: Request, depth: int) -> int:
        """How many drafts a proposal could hold now (cheap; an upper bound is fine)."""

    def propose(self, batch: list[tuple[Request, int]], live: set[tuple[int, int]]) -> list[tuple[int, ...]]:
        """Up to `depth` draft tokens continuing each request's tokens. `live`: (slot, generation) of every live
        request, so per-slot state of ended requests can go."""


class NgramProposer:
    name = "ngram"

    def available(self, request: Request, depth: int) -> int:
        return len(state_of(request).ngram.propose(request.tokens, depth))

    def propose(self, batch: list[tuple[Request, int]], live: set[tuple[int, int]]) -> list[tuple[int, ...]]:
        return [state_of(request).ngram.propose(request.tokens, depth) for request, depth in batch]


def state_of(request: Request) -> SpeculationState:
    if request.speculation is None:
        request.speculation = SpeculationState()
    return request.speculation


def verifying(request: Request) -> bool:
    """Whether the request's verify round is in flight."""
    return request.speculation is not None and request.speculation.verifying


def eligible(request: Request) -> bool:
    params = request.sampling
    return (params.speculative and params.logprobs is None and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1
            and request.outputs >= params.min_tokens and request.grammar is None)


@dataclass(frozen=True)
class Choice:
    depth: int  # drafts to propose; 0: a plain decode row
    expected: float  # tokens the round emits on average
    probe_cost: float = 0.0  # > 0: a probe one width deeper than the best, paid from the probing budget
    # A request decoding with a step in flight gives up the second frame (drains) to start drafting only when the
    # round pays for the pipeline bubble too (see Speculation.depth).
    worth_draining: bool = False


PLAIN = Choice(0, 1.0)


def width_of(depth: int) -> int:
    return next(w for w in WIDTHS if w > depth)


class Speculation:
    def __init__(self, proposer: Proposer, costs: GraphCostModel, counters: Counter[str]) -> None:
        self.proposer = proposer
        self.costs = costs
        self.counters = counters
        self.probe_credit = 0.0
        # A proposal round's time per drafted position (ageing mean): next to nothing for copy proposals, a forward
        # of the draft model for each. It adds to a verify round's cost: a round pays for its proposals too.
        self.proposal_seconds = 0.0
        self.recent = AcceptanceStats()  # every request's rounds, ageing: what a new request starts from
        for name in (f"spec_drafted_tokens_{proposer.name}", f"spec_accepted_tokens_{proposer.name}",
                     f"spec_verified_tokens_{proposer.name}", "draft_rounds", "draft_accepted_tokens"):
            counters[name] += 0  # on /metrics from the start

    def depth(self, request: Request, batch: int) -> Choice:
        """The request's next round in a step of `batch` capacity (depth 0: a plain decode row)."""
        if not eligible(request):
            return PLAIN
        limit = min(request.max_outputs - request.outputs - 1, MAX_DEPTH)  # the target's own token comes too
        if limit < 1 or (limit := min(limit, self.proposer.available(request, limit))) < 1:
            return PLAIN
        stats = state_of(request).stats
        if self.proposer.name not in stats.offered:
            stats.adopt(self.proposer.name, self.recent)
        rates = stats.rates(self.proposer.name)
        # Costs as last measured, stale or not: only a shape never measured is explored for its cost (a verify
        # shape that went stale is not worth a round of text that does not copy).
        options = [(0, 1.0, self.costs.last_known(("decode", batch)))]
        for width in WIDTHS:
            depth = min(width - 1, limit)
            verify = self.costs.last_known(("verify", batch, width))
            cost = verify + self.proposal_seconds * depth if verify else 0.0
            options.append((depth, expected_tokens(rates, depth), cost))
            if depth == limit:
                break
        # Unmeasured shapes first (their cost is learned by running them), then tokens per second.
        best = max(range(len(options)), key=lambda i: (options[i][2] == 0, options[i][1] / max(options[i][2], 1e-9),
                                                       options[i][1]))
        probe = 0.0
        if best + 1 < len(options) and self.probe_credit >= options[best + 1][2] > 0:
            best, probe = best + 1, options[best + 1][2]
        depth, expected, cost = options[best]
        # Draining costs a bubble of up to a plain step: worth it when the round beats a plain step plus that
        # bubble, for a probe or an unmeasured shape (learning), and for a request's first round (its own text
        # may copy far better or worse than the engine's recent rounds say).
        decode = options[0][2]
        drain = (probe > 0 or cost == 0 or decode == 0 or self.proposer.name not in state_of(request).observed
                 or expected * decode > decode + cost)
        return Choice(depth, expected, probe, drain)

    def rounds(self, decoders: list[Request]) -> dict[Request, Choice]:
        """The round of each decoding request that would draft now."""
        if not decoders:
            return {}
        batch = decode_capacity(len(decoders))
        depths = {r: self.depth(r, batch) for r in decoders if not verifying(r)}
        return {r: choice for r, choice in depths.items() if choice.depth > 0}

    @staticmethod
    def stepping(decoders: list[Request], depths: dict[Request, Choice], done: int) -> list[Request]:
        """The decoders that take a row in the next step, with steps up to `done` completed. A request that would
        draft waits for its step in flight rather than take the second frame (its proposal needs its last token)
        when drafting promises enough; one with a verify round in flight waits for that round's accepted length.
        Either waits for its own completion only: other requests fill the frame."""
        return [r for r in decoders if r.row_fence <= done or not verifying(r) and not (
            r in depths and depths[r].worth_draining)]

    def drafts(self, decoders: list[Request], depths: dict[Request, Choice], done: int,
               slots: list[Request | None]) -> dict[Request, tuple[int, ...]]:
        """The proposals for the rounds of `depths` of the decoders with no step in flight (another's last token is
        pending), for those that got one; `slots`: the live requests, whose per-slot proposer state is kept."""
        batch = [(r, depths[r]) for r in decoders if r in depths and r.row_fence <= done]
        live = {(r.slot, r.generation) for r in slots if r is not None}
        proposals = self.propose(batch, live)
        return {request: draft for (request, _), draft in zip(batch, proposals) if draft}

    def propose(self, batch: list[tuple[Request, Choice]], live: set[tuple[int, int]]) -> list[tuple[int, ...]]:
        """Proposals for the chosen rounds; a probe's cost comes out of the budget now that it runs."""
        self.probe_credit -= sum(choice.probe_cost for _, choice in batch)
        if not batch:
            return []
        started = time.perf_counter()
        drafts = self.proposer.propose([(r, c.depth) for r, c in batch], live)
        self.observe_proposal(time.perf_counter() - started, max(c.depth for _, c in batch))
        return drafts

    def observe_proposal(self, seconds: float, positions: int) -> None:
        """A proposal round of up to `positions` drafts per request took `seconds`."""
        if positions > 0:
            per_position = seconds / positions
            self.proposal_seconds += PROPOSAL_AGEING * (per_position - self.proposal_seconds) \
                if self.proposal_seconds else per_position

    def earn(self, seconds: float) -> None:
        self.probe_credit = min(self.probe_credit + PROBE_FRACTION * seconds, MAX_PROBE_CREDIT)

    def observe(self, request: Request, proposer: str, offered: int, accepted: int, censored: bool) -> None:
        """A verify round completed: `accepted` of `offered` drafts were emitted (censored: the request ended
        inside them)."""
        state = state_of(request)
        state.rounds += 1
        state.stats.observe(proposer, offered, accepted, censored)
        state.observed.add(proposer)
        self.recent.observe(proposer, offered, accepted, censored)
        self.counters[f"spec_drafted_tokens_{proposer}"] += offered
        self.counters[f"spec_accepted_tokens_{proposer}"] += accepted
        self.counters[f"spec_verified_tokens_{proposer}"] += offered + 1
        self.counters["draft_rounds"] += 1
        self.counters["draft_accepted_tokens"] += accepted
