"""Per-request acceptance learning: conditional acceptance of draft position j given positions 1..j-1 were
accepted, by proposer, with ageing weights (docs/speculative.md, Choosing a depth).

A round that offered D drafts and accepted k observes positions 1..k as accepted and position k+1 as rejected;
positions after k+1 are unobserved, and so are positions after a termination inside the accepted prefix (censored).
Each observation first ages that position's weight by DECAY, so the estimate follows text that changes character
(a quoted passage, then new prose) and an unobserved position keeps its mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.9
PRIOR_ACCEPTED, PRIOR_OFFERED = 0.5, 1.0  # a position never observed is accepted half the time
ADOPTED_WEIGHT = 2.0  # observations a new request's statistics take over from the engine's recent rounds
MAX_DEPTH = 7


@dataclass
class AcceptanceStats:
    offered: dict[str, list[float]] = field(default_factory=dict)
    accepted: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, proposer: str, offered: int, accepted: int, censored: bool) -> None:
        """`censored`: the request ended inside the accepted prefix, so the next position was never tested."""
        offers = self.offered.setdefault(proposer, [0.0] * MAX_DEPTH)
        accepts = self.accepted.setdefault(proposer, [0.0] * MAX_DEPTH)
        observed = accepted if censored or accepted >= offered else accepted + 1
        for j in range(min(observed, MAX_DEPTH)):
            offers[j] = offers[j] * DECAY + 1
            accepts[j] = accepts[j] * DECAY + (1 if j < accepted else 0)

    def adopt(self, proposer: str, recent: AcceptanceStats) -> None:
        """Start from the engine's recent rounds with this proposer, weighed as ADOPTED_WEIGHT observations at
        most, so a request's own rounds soon dominate (a new request need not rediscover that copying pays)."""
        offers = recent.offered.get(proposer, [0.0] * MAX_DEPTH)
        accepts = recent.accepted.get(proposer, [0.0] * MAX_DEPTH)
        scales = [min(1.0, ADOPTED_WEIGHT / o) if o else 0.0 for o in offers]
        self.offered[proposer] = [o * s for o, s in zip(offers, scales)]
        self.accepted[proposer] = [a * s for a, s in zip(accepts, scales)]

    def rates(self, proposer: str) -> list[float]:
        """Mean conditional acceptance of each position 1..MAX_DEPTH."""
        offers = self.offered.get(proposer, [0.0] * MAX_DEPTH)
        accepts = self.accepted.get(proposer, [0.0] * MAX_DEPTH)
        return [(a + PRIOR_ACCEPTED) / (o + PRIOR_OFFERED) for a, o in zip(accepts, offers)]


def expected_tokens(rates: list[float], depth: int) -> float:
    """Tokens a verify round of `depth` drafts emits on average: the target's own token, plus each draft position
    that survives (all positions before it accepted)."""
    total, survive = 1.0, 1.0
    for rate in rates[:depth]:
        survive *= rate
        total += survive
    return total
