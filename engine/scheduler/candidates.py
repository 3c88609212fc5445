"""The steps on offer to the selection policy (engine/scheduler/policy.py): from the decoding requests, the prompts
waiting to prefill and the rounds that would draft, the candidate steps (decode, verify, a mixed chunk or a prefill
chunk at each capacity) with their values, and the policy's choice among them (docs/design.md, Scheduler and prefix
checkpoints).
"""

from __future__ import annotations

import numpy as np

from engine.scheduler.policy import Candidate, GraphCostModel, PolicyConfig, choose, decode_capacity, price
from engine.scheduler.request import Request
from engine.scheduler.speculation import Choice, width_of


class CandidateSteps:
    """The step shapes on offer each plan, valued by the policy's prices, and the one chosen."""

    def __init__(self, policy: PolicyConfig, costs: GraphCostModel, page_size: int, prefill_chunk_size: int) -> None:
        self.policy = policy
        self.costs = costs
        # Prompt-token capacities of a step: page-aligned, doubling up to the chunk size.
        self.capacities = [page_size << i for i in range(32) if page_size << i < prefill_chunk_size]
        self.capacities.append(prefill_chunk_size)

    def choose(self, decoders: list[Request], prefills: list[Request], now: float, depths: dict[Request, Choice],
               done: int) -> Candidate | None:
        """Score the step shapes on offer (PolicyConfig) and return the chosen one; `depths`: the rounds that would
        draft, of which those with no step in flight (steps up to `done` completed) may verify."""
        config = self.policy
        waiting = sum(r.prefill_target - r.scheduled for r in prefills)
        drafting = [depths[r] for r in decoders if r in depths and r.row_fence <= done] if depths else []
        batch = decode_capacity(len(decoders))
        if decoders and waiting <= 0 and not drafting:
            # The decode step is the only candidate: choose() takes it whatever its value, which goes unscored (a
            # pass over every decoder saved on every steady decode step).
            return Candidate(len(decoders), 0, 0.0, ("decode", batch))
        candidates = []
        decode_value = 0
        if decoders:  # (none: a lone prompt's first step, where numpy's calls cost tens of µs of its first token)
            # price() over every decoder at once (numpy, the same arithmetic per element), summed in order as before.
            waited = now - np.array([r.last_commit for r in decoders], dtype=np.float64)
            values = (config.output_token_value * (1 + price(config, config.delivery_fairness, waited))).tolist()
            decode_value = sum(values)
            candidates.append(Candidate(len(decoders), 0, decode_value, ("decode", batch)))
            if drafting:
                value = sum(v * depths[r].expected if r in depths else v for v, r in zip(values, decoders))
                width = width_of(max(choice.depth for choice in drafting))
                candidates.append(Candidate(len(decoders), 0, value, ("verify", batch, width)))
        largest = self.capacities[-1]
        for capacity in self.capacities:
            tokens = min(capacity, waiting)
            if tokens <= 0:
                break
            value = self._prefill_value(prefills, tokens, now)
            if decoders:
                candidates.append(Candidate(len(decoders), tokens, decode_value + value, ("mixed", capacity)))
            elif tokens == waiting or capacity == largest or self.costs.last_known(("prefill", capacity)) > 0:
                # A smaller chunk of what waits is offered once its cost is known: exploring it would only delay
                # a first token (a 67-token prompt split into 64 + 3, a cold long one into every capacity).
                candidates.append(Candidate(0, tokens, value, ("prefill", capacity)))
            if tokens == waiting:
                break
        return choose(candidates, self.costs, config)

    def _prefill_value(self, prefills: list[Request], tokens: int, now: float) -> float:
        config, value = self.policy, 0.0
        for request in prefills:
            if tokens <= 0:
                break
            take = min(tokens, request.prefill_target - request.scheduled)
            waited = now - request.last_commit
            value += take * (1 + price(config, config.token_fairness, waited))
            if take == request.prefill_target - request.scheduled:
                value += config.terminal_value + config.terminal_age_price * 1000 * waited
            tokens -= take
        return value
