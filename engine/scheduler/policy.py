"""The selection policy: which step to run next, by expected useful value per estimated step duration.

Every candidate (a decode cohort, a prefill chunk of some capacity, or both in one step) is scored

    value(candidate) / cost(candidate)  -  waiting cost of the decoding requests it leaves out

Value is counted in prompt-token units: a prompt token is worth 1, an output token `output_token_value`, and the
token that completes a prompt (a request's first output) `terminal_value` more. Each request carries service prices
that grow while it waits for service, so value shifts toward whoever waited longest and nobody starves behind long
prompts. Costs are learned online per step shape: zero until measured (so new shapes are explored first), then the
median of the last nine measured durations; after 30 seconds without a new one, the median of the last nine however
old (an idle server's next request is not spent re-exploring). The coefficients are preferences, not limits.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    output_token_value: float = 64.0  # prompt-token units per output token
    token_fairness: float = 16.0  # price growth for prompt service
    delivery_fairness: float = 4.0  # price growth for output delivery
    decode_age_price: float = 0.1  # waiting cost per millisecond a left-out decoding request has waited
    terminal_value: float = 256.0  # bonus for the step that completes a prompt
    terminal_age_price: float = 1.0  # ... growing per millisecond the request has waited for its first token
    price_adaptation: float = 0.1  # seconds of waiting that raise a price by one coefficient
    observations: int = 9
    stale_after: float = 30.0


Shape = tuple  # (kind, capacity), or ("verify", batch capacity, width): the step shape whose cost is learned


def beats_recomputing(unit_seconds: Sequence[float], units: int, recompute: float) -> bool:
    """Whether `units` of copying (host pages, disk files) at the median of the recent `unit_seconds` each are
    expected to take no longer than computing their tokens again, `recompute` seconds by the learned step costs;
    taken while either is unmeasured (no samples, 0.0)."""
    return not unit_seconds or not recompute or units * statistics.median(unit_seconds) <= recompute


@dataclass
class GraphCostModel:
    config: PolicyConfig
    _samples: dict[Shape, deque[tuple[float, float]]] = field(default_factory=dict)

    def observe(self, shape: Shape, seconds: float, now: float | None = None) -> None:
        samples = self._samples.setdefault(shape, deque(maxlen=self.config.observations))
        samples.append((now if now is not None else time.monotonic(), seconds))

    def estimate(self, shape: Shape, now: float | None = None) -> float:
        """Median of recent observations; 0.0 when none are fresh (unmeasured: explore it)."""
        samples = self._samples.get(shape)
        if not samples:
            return 0.0
        now = now if now is not None else time.monotonic()
        fresh = [seconds for when, seconds in samples if now - when <= self.config.stale_after]
        return statistics.median(fresh) if fresh else 0.0

    def last_known(self, shape: Shape) -> float:
        """Median of the recent observations however old; 0.0 only for a shape never measured."""
        samples = self._samples.get(shape)
        return statistics.median(seconds for _, seconds in samples) if samples else 0.0


def decode_capacity(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


def prefill_capacity(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


@dataclass(frozen=True)
class Candidate:
    decoders: int  # decoding requests in the step
    prefill_tokens: int  # prompt tokens in the step
    value: float
    shape: Shape


def price(config: PolicyConfig, coefficient: float, waited: float) -> float:
    return coefficient * waited / config.price_adaptation


def choose(candidates: list[Candidate], costs: GraphCostModel, config: PolicyConfig) -> Candidate | None:
    """The best candidate. Shapes never measured come first (the most valuable of them); measured ones trade value
    per second against the time their decoding requests spend waiting inside a longer step."""
    best, best_score = None, float("-inf")
    for candidate in candidates:
        cost = costs.estimate(candidate.shape) or costs.last_known(candidate.shape)
        if cost > 0:
            score = candidate.value / cost - config.decode_age_price * candidate.decoders * cost * 1000
        else:
            score = float("inf")
        if score > best_score or (score == best_score and best is not None and candidate.value > best.value):
            best, best_score = candidate, score
    return best
