"""The scheduler and eager executor together on a tiny random model: batching, preemption, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.engine_harness import Harness, tiny_model

PROMPTS = [[5, 6, 7], list(range(10, 60)), list(range(100, 190)), [42]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def assert_no_page_leaked(harness: Harness, total: int) -> None:
    """Every page is free or held by the prefix cache once all requests ended."""
    scheduler = harness.scheduler
    assert scheduler.pages.retiring_count == 0
    assert scheduler.pages.free_count + scheduler.cached_pages == total


def reference_greedy(model, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding without any cache: the whole sequence through the model each step."""
    from engine.model.attention import AttentionMetadata, PrefillSpan

    tokens = list(prompt)
    for _ in range(count):
        n = len(tokens)
        cache = torch.zeros(model.config.num_layers, 2, n, model.config.num_kv_heads, model.config.head_dim)
        meta = AttentionMetadata(torch.arange(n), torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long), (PrefillSpan(0, n, n, torch.arange(n)),), 1)
        with torch.no_grad():
            hidden = model(torch.tensor(tokens), torch.arange(n), cache, meta)
        tokens.append(int(model.logits(hidden[-1:]).argmax()))
    return tokens[len(prompt):]


def test_batched_chunked_greedy_equals_one_sequence_at_a_time(model) -> None:
    harness = Harness(model)
    requests = [harness.add(p, temperature=0.0, max_tokens=12) for p in PROMPTS]
    harness.run()
    for prompt, request in zip(PROMPTS, requests):
        assert request.tokens[len(prompt):] == reference_greedy(model, prompt, 12)
    assert_no_page_leaked(harness, 64)
    harness.close()


def test_preemption_under_page_pressure_keeps_greedy_results(model) -> None:
    harness = Harness(model, num_pages=14, page_size=16)  # far fewer pages than the requests need at once
    requests = [harness.add(p, temperature=0.0, max_tokens=40) for p in PROMPTS]
    harness.run()
    for prompt, request in zip(PROMPTS, requests):
        assert request.tokens[len(prompt):] == reference_greedy(model, prompt, 40)
    assert_no_page_leaked(harness, 14)
    harness.close()


def test_a_seeded_request_draws_the_same_tokens_in_any_batch(model) -> None:
    alone = Harness(model)
    solo = alone.add(PROMPTS[1], temperature=1.0, top_p=0.95, seed=77, max_tokens=16)
    alone.run()
    crowded = Harness(model)
    for i, prompt in enumerate(PROMPTS):
        crowded.add(prompt, temperature=0.8, seed=i, max_tokens=20)
    again = crowded.add(PROMPTS[1], temperature=1.0, top_p=0.95, seed=77, max_tokens=16)
    crowded.run()
    assert solo.tokens == again.tokens
    other = Harness(model)
    different = other.add(PROMPTS[1], temperature=1.0, top_p=0.95, seed=78, max_tokens=16)
    other.run()
    assert different.tokens != solo.tokens
    for h in (alone, crowded, other):
        h.close()


def test_top_k_one_is_greedy_and_a_huge_presence_penalty_never_repeats(model) -> None:
    harness = Harness(model)
    top1 = harness.add(PROMPTS[2], temperature=1.5, top_k=1, seed=3, max_tokens=10)
    unique = harness.add(PROMPTS[0], temperature=0.0, presence_penalty=1e6, max_tokens=30)
    harness.run()
    assert top1.tokens[len(PROMPTS[2]):] == reference_greedy(model, PROMPTS[2], 10)
    outputs = unique.tokens[len(PROMPTS[0]):]
    assert len(set(outputs)) == len(outputs) == 30
    harness.close()


def test_logprobs_are_the_models_and_best_first(model) -> None:
    harness = Harness(model)
    request = harness.add(PROMPTS[0], temperature=0.0, max_tokens=3, logprobs=4, prompt_logprobs=2)
    pieces, prompt_pieces = [], []
    while harness.scheduler.has_work():
        for result in harness.step():
            pieces += [lp for r, _, lp in result.tokens if r is request]
    prompt_pieces = request.prompt_logprobs
    assert len(pieces) == 3 and all(len(p.top_ids[0]) == 4 for p in pieces)
    first = pieces[0]
    assert first.top_ids[0][0] == first.token_ids[0]  # greedy picks the best
    assert first.top_logprobs[0] == sorted(first.top_logprobs[0], reverse=True)
    assert math.isclose(first.logprobs[0], first.top_logprobs[0][0]) and first.logprobs[0] < 0
    assert sum(math.exp(x) for x in first.top_logprobs[0]) <= 1.0 + 1e-5
    assert [t for p in prompt_pieces for t in p.token_ids] == PROMPTS[0][1:]
    harness.close()


def test_cancel_returns_pages_only_after_in_flight_steps(model) -> None:
    harness = Harness(model, num_pages=32)
    request = harness.add(PROMPTS[2], temperature=0.0, max_tokens=50)
    harness.step()
    harness.scheduler.cancel(request)
    assert not harness.scheduler.has_work()
    harness.run()
    assert_no_page_leaked(harness, 32)
    harness.close()


def test_a_repeated_prefix_is_reused_and_changes_nothing(model) -> None:
    harness = Harness(model, page_size=16)
    prompt = list(range(1, 75))  # 4 whole blocks of 16, and 10 tokens more
    first = harness.add(prompt, message_ends=[37, 70], temperature=0.0, max_tokens=8)
    harness.run()
    second = harness.add(prompt + [200, 201], message_ends=[37, 70, 74], temperature=0.0, max_tokens=8)
    harness.run()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 70  # the exact checkpoint at the last shared message end
    assert second.tokens[len(prompt) + 2:] == reference_greedy(model, prompt + [200, 201], 8)
    assert harness.scheduler.counters["reused_tokens"] == 70
    assert_no_page_leaked(harness, 64)
    harness.close()


def test_a_finished_reply_is_reused_by_the_next_turn(model) -> None:
    harness = Harness(model, page_size=16)
    prompt = list(range(1, 20))
    turn = harness.add(prompt, message_ends=[19], temperature=0.0, max_tokens=30, ignore_eos=True)
    harness.run()
    conversation = turn.tokens[:-1] + [300, 301]  # the reply's last token has no KV yet
    follow = harness.add(conversation, message_ends=[19], temperature=0.0, max_tokens=4)
    harness.run()
    assert follow.cached_tokens == (len(turn.tokens) - 1) // 16 * 16  # whole blocks of prompt and reply
    assert follow.tokens[len(conversation):] == reference_greedy(model, conversation, 4)
    harness.close()


def test_decoding_requests_keep_receiving_tokens_while_a_long_prompt_loads(model) -> None:
    harness = Harness(model, num_pages=96, page_size=64, max_active=16, chunk=512)
    decoders = [harness.add([7 + i, 8, 9], temperature=0.0, max_tokens=40, ignore_eos=True) for i in range(8)]
    for _ in range(3):
        harness.step()  # the eight are decoding
    long = harness.add([i % 300 for i in range(4096)], temperature=0.0, max_tokens=2)
    last_seen = {id(r): 0 for r in decoders}
    largest_gap = step = 0
    while long.outputs == 0:
        step += 1
        for result in harness.step():
            for request, _, _ in result.tokens:
                if id(request) in last_seen:
                    largest_gap = max(largest_gap, step - last_seen[id(request)])
                    last_seen[id(request)] = step
    assert step >= 4096 // 512  # the prompt really loaded in chunks
    assert largest_gap <= 2, largest_gap
    harness.run()
    harness.close()


def test_stop_tokens_are_never_drawn_before_min_tokens(model) -> None:
    harness = Harness(model)
    free = harness.add(PROMPTS[1], temperature=0.0, max_tokens=6)
    harness.run()
    stop = free.tokens[len(PROMPTS[1])]  # what greedy draws first
    held = harness.add(PROMPTS[1], temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[stop])
    harness.run()
    outputs = held.tokens[len(PROMPTS[1]):]
    assert stop not in outputs[:3] and len(outputs) >= 3
    harness.close()


def test_cached_pages_of_preempted_requests_are_evicted_for_the_one_that_preempted_them(model) -> None:
    """A decoding request short of a page preempts newer ones whose pages are all cached blocks; unpinned by the
    preemption, those blocks must then be evicted for it (it used to wait for a page forever)."""
    harness = Harness(model, num_pages=12, page_size=16)
    prompts = [list(range(10, 70)), list(range(11, 71)), [(i * 7) % 250 + 4 for i in range(90)]]
    requests = [harness.add(p, temperature=0.0, max_tokens=m) for p, m in zip(prompts, (40, 40, 1))]
    harness.run()
    for prompt, request, count in zip(prompts, requests, (40, 40, 1)):
        assert request.tokens[len(prompt):] == reference_greedy(model, prompt, count)
    assert_no_page_leaked(harness, 12)
    harness.close()


def test_prompt_ids_are_checked_against_the_vocabulary() -> None:
    from engine.admission import ids_below

    assert ids_below([0, 5, 319], 320) and ids_below([], 320)
    for bad in ([320], [0, -1], [1 << 32], [-(1 << 40)], [1 << 63]):
        assert not ids_below(bad, 320), bad
