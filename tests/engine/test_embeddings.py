"""Embeddings (docs/design.md, Embeddings) through the real scheduler and eager executor on a tiny random model: the
last token's or the mean final hidden state, over prompts longer than a step's chunk, beside generating requests,
under page pressure, and after a reused prefix."""

from __future__ import annotations

import pytest
import torch

from engine.scheduler.request import Phase
from tests.engine.test_engine import PROMPTS, assert_no_page_leaked, reference_greedy
from tests.engine.test_scored_prefill import reference_hidden
from tests.support.engine_harness import Harness, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def assert_embedding(model, request, prompt: list[int]) -> None:
    hidden = reference_hidden(model, prompt)
    expected = hidden.mean(dim=0) if request.pooling == "mean" else hidden[-1]
    assert request.phase is Phase.FINISHED and request.finish_reason == "stop"
    assert request.outputs == 0, "an embedding generates nothing"
    torch.testing.assert_close(torch.from_numpy(request.embedding()), expected, atol=1e-5, rtol=1e-5)


def test_last_and_mean_pooling_over_chunks_beside_generating_requests(model) -> None:
    harness = Harness(model)  # 48-token chunks: the long prompts take three steps
    long_prompt = [(i * 37) % 300 + 3 for i in range(130)]
    embeddings = [harness.add(long_prompt, pooling="mean"), harness.add(long_prompt, pooling="last"),
                  harness.add([9, 8, 7, 6], pooling="mean"), harness.add([42], pooling="last")]
    generating = harness.add(list(range(10, 60)), temperature=0.0, max_tokens=8)
    harness.run()
    for request, prompt in zip(embeddings, [long_prompt, long_prompt, [9, 8, 7, 6], [42]]):
        assert_embedding(model, request, prompt)
    assert generating.tokens[50:] == reference_greedy(model, list(range(10, 60)), 8)
    assert harness.scheduler.live == 0
    assert_no_page_leaked(harness, 64)
    harness.close()


def test_a_mean_under_page_pressure_counts_each_position_once(model) -> None:
    harness = Harness(model, num_pages=14, page_size=16)  # as test_engine's preemption test: pages run out
    generating = [harness.add(p, temperature=0.0, max_tokens=40) for p in PROMPTS]
    prompt = [(i * 7) % 250 + 4 for i in range(90)]
    mean = harness.add(prompt, pooling="mean")
    harness.run()
    assert_embedding(model, mean, prompt)
    for p, request in zip(PROMPTS, generating):
        assert request.tokens[len(p):] == reference_greedy(model, p, 40)
    assert_no_page_leaked(harness, 14)
    harness.close()


def test_last_pooling_reuses_a_cached_prefix_and_mean_pooling_does_not(model) -> None:
    harness = Harness(model, page_size=16)
    prefix = [(i * 13) % 290 + 5 for i in range(64)]  # four whole pages
    first = harness.add(prefix + [300], pooling="last")
    harness.run()
    last, mean = harness.add(prefix + [301, 302], pooling="last"), harness.add(prefix + [303], pooling="mean")
    harness.run()
    assert (first.cached_tokens, last.cached_tokens, mean.cached_tokens) == (0, 64, 0)
    assert_embedding(model, last, prefix + [301, 302])
    assert_embedding(model, mean, prefix + [303])
    harness.close()
