"""Scored prefills (decisions) through the real scheduler and eager executor on a tiny random model: label logits
at the queried positions, nothing generated, no slot kept, and questions about one state sharing its prefix."""

from __future__ import annotations

import pytest
import torch

from engine.scheduler.request import Phase
from tests.engine.test_engine import PROMPTS, assert_no_page_leaked, reference_greedy
from tests.support.engine_harness import Harness, tiny_model

LABELS = (7, 11, 300)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def reference_hidden(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), hidden]: the final hidden states of the whole prompt through the model at once, no cache
    reused."""
    from engine.model.attention import AttentionMetadata, PrefillSpan

    n = len(prompt)
    cache = torch.zeros(model.config.num_layers, 2, n, model.config.num_kv_heads, model.config.head_dim)
    meta = AttentionMetadata(torch.arange(n), torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), (PrefillSpan(0, n, n, torch.arange(n)),), 1)
    with torch.no_grad():
        return model(torch.tensor(prompt), torch.arange(n), cache, meta)


def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: the whole prompt through the model at once, no cache reused."""
    with torch.no_grad():
        return model.logits(reference_hidden(model, prompt))


def assert_scores(model, request, prompt: list[int]) -> None:
    expected = reference_logits(model, prompt)
    assert request.phase is Phase.FINISHED and request.finish_reason == "stop"
    assert request.outputs == 0, "a scored prefill generates nothing"
    for position, ids in request.label_queries:
        got = torch.tensor(request.label_logits[position])
        torch.testing.assert_close(got, expected[position, list(ids)], atol=1e-5, rtol=1e-5)


def test_label_logits_at_every_queried_position_beside_generating_requests(model) -> None:
    harness = Harness(model)  # 48-token chunks: the long prompt's queries fall in several steps
    long_prompt = [(i * 37) % 300 + 3 for i in range(130)]
    scored = [harness.add(long_prompt, label_queries=[(0, LABELS), (47, LABELS[:2]), (48, (5,)), (129, LABELS)]),
              harness.add([9, 8, 7, 6], label_queries=[(3, LABELS)])]
    generating = harness.add(list(range(10, 60)), temperature=0.0, max_tokens=8)
    harness.run()
    assert_scores(model, scored[0], long_prompt)
    assert_scores(model, scored[1], [9, 8, 7, 6])
    assert generating.tokens[50:] == reference_greedy(model, list(range(10, 60)), 8)
    assert harness.scheduler.live == 0
    assert_no_page_leaked(harness, 64)
    harness.close()


def test_questions_about_one_state_reuse_its_prefix(model) -> None:
    harness = Harness(model, page_size=16)
    state = [(i * 13) % 290 + 5 for i in range(100)]  # six whole pages
    prompts = [state + [300 + q, 301, 302] for q in range(10)]
    first = harness.add(prompts[0], label_queries=[(len(prompts[0]) - 1, LABELS)])
    harness.run()  # state first: the next questions find its pages
    rest = [harness.add(p, label_queries=[(len(p) - 1, LABELS)]) for p in prompts[1:]]
    harness.run()
    assert first.cached_tokens == 0
    assert [r.cached_tokens for r in rest] == [96] * 9
    assert harness.scheduler.counters["reused_tokens"] == 96 * 9
    for prompt, request in zip(prompts, [first, *rest]):
        assert_scores(model, request, prompt)
    harness.close()


def test_a_scored_prefill_under_page_pressure_still_reads_every_position(model) -> None:
    harness = Harness(model, num_pages=14, page_size=16)  # as test_engine's preemption test: pages run out
    generating = [harness.add(p, temperature=0.0, max_tokens=40) for p in PROMPTS]
    prompt = [(i * 7) % 250 + 4 for i in range(90)]
    scored = harness.add(prompt, label_queries=[(20, LABELS), (89, LABELS)])
    harness.run()
    assert_scores(model, scored, prompt)
    for p, request in zip(PROMPTS, generating):
        assert request.tokens[len(p):] == reference_greedy(model, p, 40)
    assert_no_page_leaked(harness, 14)
    harness.close()
