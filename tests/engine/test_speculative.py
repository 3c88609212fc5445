"""Speculative decoding through the real scheduler and eager executor on a tiny random Llama (no processes):
outputs equal plain decoding exactly (greedy and seeded sampling) whatever the proposals, the sampled distribution
is the target's (chi-square), terminations inside an accepted prefix emit nothing extra and pages all return, and the
depth choice follows acceptance and learned step costs."""

from __future__ import annotations

import math
import random
import select
from collections import Counter

import pytest
import torch

from common.protocol import SamplingParams
from engine.model.backends.select import use_backend
from engine.scheduler.policy import GraphCostModel, PolicyConfig
from engine.scheduler.request import Request
from engine.scheduler.speculation import NgramProposer, Speculation, state_of
from engine.speculative.acceptance import AcceptanceStats, expected_tokens
from engine.speculative.draft import DraftProposer
from engine.speculative.ngram import NgramIndex
from tests.support.engine_harness import TINY, Harness, tiny_model

VOCAB = TINY["vocab_size"]


class ReplayProposer:
    """Proposes a known continuation of each prompt, each token replaced by a wrong one with probability
    `corrupt` (a fixed random stream): corrupt=0 is the mechanism's ceiling, 1 a proposer that is always wrong."""

    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt: float) -> None:
        self.continuations = continuations
        self.corrupt = corrupt
        self.random = random.Random(1)

    def _next(self, request: Request, depth: int) -> list[int]:
        return self.continuations[tuple(request.tokens[:request.prompt_len])][request.outputs:request.outputs + depth]

    def available(self, request: Request, depth: int) -> int:
        return len(self._next(request, depth))

    def propose(self, batch: list[tuple[Request, int]], live: set) -> list[tuple[int, ...]]:
        return [tuple(t if self.random.random() >= self.corrupt else (t + 1) % VOCAB for t in self._next(r, d))
                for r, d in batch]


def modeled_seconds(shape: tuple) -> float:
    """A GPU-like step cost by shape: a fixed launch plus a little per position, so that depth choices do not
    follow how loaded the machine running the tests is."""
    positions = math.prod(n for n in shape if isinstance(n, int))
    return 1.0 + 0.01 * positions


def generate(prompts: list[list[int]], proposer: object = None, num_pages: int = 64,
             **sampling: object) -> tuple[list[list[int]], Harness]:
    harness = Harness(tiny_model(), num_pages=num_pages, proposer=proposer)
    costs = harness.scheduler.costs
    costs.observe = lambda shape, seconds, now=None: GraphCostModel.observe(costs, shape, modeled_seconds(shape), now)
    requests = [harness.add(p, **sampling) for p in prompts]
    try:
        harness.run()
    finally:
        harness.close()
    assert harness.scheduler.pages.free_count + harness.scheduler.cached_pages == num_pages  # every page returned
    return [r.tokens[r.prompt_len:] for r in requests], harness


def random_tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(count)]


PROMPTS = [random_tokens(n, n) for n in (30, 17, 50, 5)]


@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    return generate(PROMPTS, temperature=0.0, max_tokens=40)[0]


@pytest.mark.parametrize("corrupt", [0.0, 0.3, 1.0])
def test_greedy_output_is_plain_decodings_whatever_the_proposals(plain_greedy, corrupt: float) -> None:
    proposer = ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, plain_greedy)}, corrupt)
    outputs, harness = generate(PROMPTS, proposer, temperature=0.0, max_tokens=40)
    assert outputs == plain_greedy
    counters = harness.scheduler.counters
    assert counters["draft_rounds"] > 0
    if corrupt == 0.0:
        assert counters["spec_accepted_tokens_replay"] == counters["spec_drafted_tokens_replay"]
        assert harness.steps < 40 * 0.6  # whole drafts accepted: far fewer steps than tokens


@pytest.mark.parametrize("draft_seed", [0, 3])
def test_draft_model_proposals_keep_greedy_output(plain_greedy, draft_seed: int) -> None:
    """The target as its own draft (everything accepted) and a different random model (mostly rejected)."""
    proposer = DraftProposer(tiny_model(draft_seed), 64, 16, torch.device("cpu"))
    outputs, harness = generate(PROMPTS, proposer, temperature=0.0, max_tokens=40)
    assert outputs == plain_greedy
    counters = harness.scheduler.counters
    if draft_seed == 0:
        assert counters["spec_accepted_tokens_draft"] == counters["spec_drafted_tokens_draft"] > 0
    proposer.propose([], set())  # its next proposal finds every request ended: their pages go back
    assert proposer.pages.free_count == 64


def test_seeded_sampling_is_reproduced_token_for_token() -> None:
    plain = generate(PROMPTS, temperature=1.0, top_k=20, max_tokens=30, seed=11)[0]
    greedy = generate(PROMPTS, temperature=0.0, max_tokens=30)[0]
    proposer = ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, greedy)}, 0.2)
    assert generate(PROMPTS, proposer, temperature=1.0, top_k=20, max_tokens=30, seed=11)[0] == plain


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_distribution_of_verified_tokens_is_the_targets() -> None:
    """Over 240 seeds, the second output token (the first one a verify round emits, drafts proposed by the target
    itself greedily, so most are rejected or accepted by chance) follows the target's distribution given the first;
    the expected counts come from the target's full logprobs in a plain run. Deterministic: fixed seeds."""
    prompt, seeds, temperature = PROMPTS[1], range(240), 1.0
    harness = Harness(tiny_model(), proposer=DraftProposer(tiny_model(), 64, 16, torch.device("cpu")))
    requests = [harness.add(prompt, temperature=temperature, max_tokens=3, seed=s) for s in seeds]
    harness.run()
    harness.close()
    assert harness.scheduler.counters["draft_rounds"] > 0
    reference = Harness(tiny_model())
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    firsts = []
    for s in seeds:
        request = reference.add(prompt, temperature=temperature, max_tokens=2, seed=s, logprobs=VOCAB)
        while request.outputs < 2:
            for result in reference.step():
                for r, token, lp in result.tokens:
                    if r is request and r.outputs == 2:  # the second token's full distribution
                        expected[torch.tensor(lp.top_ids[0])] += torch.tensor(lp.top_logprobs[0]).double().exp()
        firsts.append(request.tokens[-2])
    reference.close()
    second = [r.tokens[r.prompt_len + 1] for r in requests]
    assert [r.tokens[r.prompt_len] for r in requests] == firsts  # the first token is prefill's: the same in both
    observed = Counter(second)
    common = [t for t in range(VOCAB) if expected[t] >= 5]
    rest = sum(expected[t] for t in range(VOCAB) if t not in common)
    cells = [(observed[t], float(expected[t])) for t in common]
    cells.append((sum(observed[t] for t in observed if t not in common), float(rest)))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    assert len(cells) >= 5
    assert statistic < _chi_square_critical(len(cells) - 1), (statistic, cells)


@pytest.mark.parametrize("case", ["stop_id", "max_tokens"])
def test_termination_inside_an_accepted_prefix_emits_nothing_after_it(plain_greedy, case: str) -> None:
    proposer = ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, plain_greedy)}, 0.0)
    prompt, continuation = PROMPTS[0], plain_greedy[0]
    sampling = dict(temperature=0.0, max_tokens=40)
    if case == "stop_id":
        sampling["stop_token_ids"] = [continuation[9]]
        want = continuation[:continuation.index(continuation[9]) + 1]
    else:
        sampling["max_tokens"] = 9
        want = continuation[:9]
    outputs, harness = generate([prompt], proposer, **sampling)
    assert outputs == [want]
    assert harness.scheduler.counters["draft_accepted_tokens"] <= len(want)


def test_preemption_under_page_pressure_keeps_outputs(plain_greedy) -> None:
    """Eight pages of sixteen tokens for four requests of up to 90 tokens: requests are preempted and recomputed
    while others verify drafts."""
    proposer = ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, plain_greedy)}, 0.2)
    outputs, _ = generate(PROMPTS, proposer, num_pages=8, temperature=0.0, max_tokens=40)
    assert outputs == plain_greedy


def test_a_cancelled_request_emits_nothing_from_its_verify_round_in_flight(plain_greedy) -> None:
    proposer = ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, plain_greedy)}, 0.0)
    harness = Harness(tiny_model(), proposer=proposer)
    request = harness.add(PROMPTS[0], temperature=0.0, max_tokens=40)
    scheduler, executor = harness.scheduler, harness.executor
    while True:  # run until a verify round is submitted; cancel before its completion is read
        if executor.can_submit() and (plan := scheduler.plan()) is not None:
            scheduler.commit(plan, executor.next_fence())
            executor.submit(plan)
            if any(row.draft for row in plan.rows):
                break
            continue
        select.select([executor.wake_fd], [], [], 5)
        for done, completion in executor.poll():
            scheduler.complete(completion, done)
    before = len(request.tokens)
    scheduler.cancel(request)
    harness.run()
    harness.close()
    assert len(request.tokens) == before and request.finish_reason == "abort"
    assert scheduler.pages.free_count + scheduler.cached_pages == 64


def test_opted_out_and_penalised_requests_never_draft(plain_greedy) -> None:
    proposer = ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, plain_greedy)}, 0.0)
    outputs, harness = generate(PROMPTS, proposer, temperature=0.0, max_tokens=40, speculative=False)
    assert outputs == plain_greedy
    assert harness.scheduler.counters["draft_rounds"] == 0
    _, harness = generate(PROMPTS, proposer, temperature=0.0, max_tokens=40, repetition_penalty=1.0001)
    assert harness.scheduler.counters["draft_rounds"] == 0


def test_ngram_index_finds_the_latest_earlier_occurrence_longest_first() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert index.propose(tokens, 3) == (7, 8, 5)  # "2 3" last seen before the suffix at 5..6
    tokens += [7]
    assert index.propose(tokens, 2) == (8, 5)  # "2 3 7" beats shorter matches
    assert NgramIndex().propose([4, 5, 6], 4) == ()


def test_ngram_proposer_copies_a_quoted_passage() -> None:
    passage = random_tokens(40, 5)
    request = Request("r", b"", 45, passage + [1, 2] + passage[:5], SamplingParams(), 0, frozenset(), 50, 0.0)
    assert NgramProposer().propose([(request, 7)], set()) == [tuple(passage[5:12])]


def _speculation(decode: float, verify: dict[int, float]) -> Speculation:
    costs = GraphCostModel(PolicyConfig())
    costs.observe(("decode", 1), decode)
    for width, seconds in verify.items():
        costs.observe(("verify", 1, width), seconds)
    return Speculation(NgramProposer(), costs, Counter())


def _copying_request() -> Request:
    passage = list(range(100, 140))
    return Request("r", b"", 42, passage + [1, 2] + passage[:4], SamplingParams(), 0, frozenset(), 100, 0.0)


def test_depth_follows_acceptance_and_step_costs() -> None:
    speculation = _speculation(0.010, {2: 0.013, 4: 0.016, 8: 0.022})
    request = _copying_request()
    assert speculation.depth(request, 1).depth == 3  # the prior (half accepted), at these costs
    for _ in range(20):
        state_of(request).stats.observe("ngram", 7, 7, False)
    assert speculation.depth(request, 1).depth == 7
    for _ in range(30):
        state_of(request).stats.observe("ngram", 7, 0, False)
    assert speculation.depth(request, 1).depth == 0  # unpredictable text decodes plainly
    speculation.earn(0.014 / 0.02)  # enough measured time to fund one probe of the next width
    choice = speculation.depth(request, 1)
    assert choice.depth == 1 and choice.probe_cost == pytest.approx(0.013)
    speculation.propose([(request, choice)], set())
    assert speculation.depth(request, 1).depth == 0  # the budget is spent


def test_a_proposer_that_costs_a_forward_per_draft_pays_for_it() -> None:
    """GPU-like costs (a verify graph a few % dearer than a decode step): at low acceptance a free proposer still
    drafts, a draft model whose rounds cost about a step per position does not."""
    speculation = _speculation(0.00466, {2: 0.00478, 4: 0.00486, 8: 0.00496})
    request = _copying_request()
    for _ in range(30):
        state_of(request).stats.observe("ngram", 1, 0, False)
    assert speculation.depth(request, 1).depth > 0
    speculation.observe_proposal(0.0055, 1)  # the draft rounds measured on an H200 (docs/speculative.md)
    assert speculation.depth(request, 1).depth == 0


def test_depth_is_clipped_by_remaining_output_and_proposals() -> None:
    speculation = _speculation(0.010, {2: 0.011, 4: 0.012, 8: 0.014})
    request = _copying_request()
    request.max_outputs = request.outputs + 3
    assert speculation.depth(request, 1).depth == 2
    unmatched = Request("u", b"", 3, [7, 8, 9], SamplingParams(), 0, frozenset(), 100, 0.0)
    assert speculation.depth(unmatched, 1).depth == 0


def test_acceptance_statistics_condition_on_earlier_positions_and_censor_terminations() -> None:
    stats = AcceptanceStats()
    stats.observe("p", offered=4, accepted=2, censored=False)  # positions 1, 2 accepted, 3 rejected, 4 unseen
    rates = stats.rates("p")
    assert rates[0] == rates[1] > 0.5 > rates[2] and rates[3] == 0.5
    stats.observe("p", offered=4, accepted=1, censored=True)  # ended after position 1: 2.. unseen
    assert stats.rates("p")[2] == rates[2]
    assert expected_tokens([1.0, 1.0, 0.0], 3) == 3.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=50, seed=11)])
def test_graph_executor_verify_rounds_keep_outputs(sampling: dict) -> None:
    """On the GPU: the GraphExecutor with verify rounds (its eager step, kernel path) gives plain decoding's tokens."""
    from engine.executor.graph import GraphExecutor

    def run(proposer: object) -> list[list[int]]:
        model = tiny_model().to("cuda", torch.bfloat16)
        use_backend(model, "triton", 256)
        harness = Harness(model, proposer=proposer)
        harness.executor.close()
        harness.executor = GraphExecutor(model, 64, 16, 8, torch.device("cuda"), 256, 48)
        requests = [harness.add(p, max_tokens=40, **sampling) for p in PROMPTS]
        harness.run()
        harness.close()
        return [r.tokens[r.prompt_len:] for r in requests]

    plain = run(None)
    assert run(ReplayProposer({tuple(p): o for p, o in zip(PROMPTS, plain)}, 0.3)) == plain
