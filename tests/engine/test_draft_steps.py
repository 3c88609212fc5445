"""The draft model's rounds as step frames (engine/speculative/draft_steps.py) against its eager rounds.

On the CPU (Triton interpreter): DraftSteps, the frame functions a CUDA graph replays, run eagerly; its proposals
must be the eager DraftProposer's, round for round, through the real scheduler. On a GPU: DraftGraphs itself, and
greedy outputs with graph drafts equal plain decoding in the GraphExecutor.
"""

from __future__ import annotations


import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.model.backends.select import use_backend  # noqa: E402
from engine.speculative.draft import DraftProposer  # noqa: E402
from engine.speculative.draft_round import Lane  # noqa: E402
from engine.speculative.draft_steps import DraftSteps, round_frames  # noqa: E402
from tests.engine.test_speculative import random_tokens  # noqa: E402
from tests.support.engine_harness import Harness, tiny_model  # noqa: E402

# A prompt longer than a catch-up frame (64 tokens here), so its first feed spans two frames.
PROMPTS = [random_tokens(n, n) for n in (30, 90, 17, 5)]
PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK, CONTEXT = 64, 16, 8, 16, 1024


def lane(slot: int, start: int, feed: int, depth: int) -> Lane:
    return Lane(slot, 1, start, tuple(range(10, 10 + feed)), (slot,), depth)


def test_round_frames_chunk_the_catch_up_and_chain_the_deepest_lanes() -> None:
    frames = round_frames([lane(0, 0, 50, 3), lane(1, 4, 30, 2), lane(2, 7, 1, 1)], chunk=64)
    assert [(f.kind, f.position, f.first_lane, f.count) for f in frames] == \
        [("extend", 0, 0, 1), ("extend", 0, 1, 2), ("decode", 1, 0, 2), ("decode", 2, 0, 1)]
    first, second = frames[0].plan.rows, frames[1].plan.rows
    assert [(r.slot, r.start, r.length, r.sample) for r in first] == [(0, 0, 50, True), (1, 4, 14, False)]
    assert [(r.slot, r.start, r.length, r.sample) for r in second] == [(1, 18, 16, True), (2, 7, 1, True)]
    assert first[1].tokens + second[0].tokens == tuple(range(10, 40))
    # Decode rows take their input from the slot's last sample, one position further each frame.
    assert [(r.slot, r.start, r.tokens) for r in frames[2].plan.rows] == [(0, 50, None), (1, 34, None)]
    assert [(r.slot, r.start, r.tokens) for r in frames[3].plan.rows] == [(0, 51, None)]
    with pytest.raises(ValueError):
        round_frames([lane(0, 0, 5, 1), lane(1, 0, 5, 2)], chunk=64)


class Twin:
    """Proposes with the frame-step proposer and checks each round against the eager one, which runs the same
    batches beside it (the rounds the scheduler plans depend on measured step times, so they differ run to run)."""

    name = "draft"

    def __init__(self, eager: DraftProposer, frames: DraftProposer) -> None:
        self.eager, self.frames, self.rounds = eager, frames, []

    def available(self, request, depth: int) -> int:
        return depth

    def propose(self, batch, live):
        proposals = self.frames.propose(batch, live)
        assert proposals == self.eager.propose(batch, live)
        self.rounds.append([depth for _, depth in batch])
        return proposals


@pytest.mark.skipif(GPU, reason="the GPU runs DraftGraphs itself (below)")
@pytest.mark.parametrize("draft_seed", [0, 3])
def test_frame_rounds_propose_the_eager_rounds_drafts(draft_seed: int) -> None:
    """The target as its own draft (deep rounds, all accepted) and another random model (mostly rejected, so the
    catch-up rewinds): each round's proposals are the eager proposer's, and outputs are plain decoding's."""
    plain = Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK)
    expected = [plain.add(p, temperature=0.0, max_tokens=16) for p in PROMPTS]
    plain.run()
    plain.close()
    model = tiny_model(draft_seed)
    use_backend(model, "triton", CONTEXT)
    draft = DraftProposer(model, PAGES, PAGE_SIZE, torch.device("cpu"), CONTEXT)
    draft.use_steps(DraftSteps, MAX_ACTIVE, CHUNK)
    twin = Twin(DraftProposer(tiny_model(draft_seed), PAGES, PAGE_SIZE, torch.device("cpu")), draft)
    harness = Harness(tiny_model(), PAGES, PAGE_SIZE, MAX_ACTIVE, CHUNK, proposer=twin)
    requests = [harness.add(p, temperature=0.0, max_tokens=16) for p in PROMPTS]
    harness.run()
    harness.close()
    assert [r.tokens for r in requests] == [r.tokens for r in expected]
    assert any(max(depths) > 1 for depths in twin.rounds)  # the chain ran decode frames
    assert any(len(depths) > 1 for depths in twin.rounds)  # lanes shared frames
    draft.propose([], set())  # every request ended: the draft's pages all go back
    assert draft.pages.free_count == PAGES


def test_a_request_whose_drafts_pass_the_drafts_context_proposes_nothing() -> None:
    harness = Harness(tiny_model())
    request = harness.add(PROMPTS[0], temperature=0.0, max_tokens=4)
    harness.close()
    request.slot, request.generation = 0, 1
    draft = DraftProposer(tiny_model(), PAGES, PAGE_SIZE, torch.device("cpu"), context_limit=len(PROMPTS[0]) + 2)
    live = {(request.slot, request.generation)}
    assert draft.propose([(request, 4)], live) == [()]
    assert draft.pages.free_count == PAGES
    assert len(draft.propose([(request, 3)], live)[0]) == 3


def gpu_speculate(draft: object, max_active: int = 32) -> tuple[list[list[int]], dict]:
    """Greedy outputs of the GraphExecutor (decode graphs up to 32 rows: verify steps of up to 4 x 8 rows)."""
    from engine.executor.graph import GraphExecutor

    model = tiny_model().to("cuda")
    use_backend(model, "triton", CONTEXT)
    harness = Harness(model, PAGES, PAGE_SIZE, max_active, CHUNK, proposer=draft)
    harness.executor.close()
    harness.executor = GraphExecutor(model, PAGES, PAGE_SIZE, max_active, torch.device("cuda"), CONTEXT, CHUNK)
    requests = [harness.add(p, temperature=0.0, max_tokens=24) for p in PROMPTS]
    harness.run()
    harness.close()
    return [r.tokens for r in requests], harness.scheduler.counters


def gpu_draft(seed: int, graphs: bool, max_active: int = 32) -> DraftProposer:
    from engine.speculative.draft_steps import DraftGraphs

    model = tiny_model(seed).to("cuda")
    use_backend(model, "triton", CONTEXT)
    draft = DraftProposer(model, PAGES, PAGE_SIZE, torch.device("cuda"), CONTEXT)
    if graphs:
        draft.use_steps(DraftGraphs, max_active, CHUNK)
    return draft


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("draft_seed", [0, 3])
def test_draft_graphs_propose_the_eager_drafts_and_keep_greedy_output(draft_seed: int) -> None:
    twin = Twin(gpu_draft(draft_seed, graphs=False), gpu_draft(draft_seed, graphs=True))
    assert gpu_speculate(twin)[0] == gpu_speculate(None)[0]
    assert any(max(depths) > 1 for depths in twin.rounds)
    twin.frames.propose([], set())
    assert twin.frames.pages.free_count == PAGES


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_the_target_as_its_own_graph_draft_is_always_accepted() -> None:
    outputs, counters = gpu_speculate(gpu_draft(0, graphs=True))
    assert outputs == gpu_speculate(None)[0]
    assert counters["spec_accepted_tokens_draft"] == counters["spec_drafted_tokens_draft"] > 0
