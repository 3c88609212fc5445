"""A hybrid model's exact checkpoints through the real scheduler and eager executor (tests/support/engine_harness.py):
a request that restores a snapshot continues exactly as one that computed its whole prompt; a restored request that
is cancelled leaves the snapshot for the next; snapshot rows are bounded, the oldest evicted; endpoints on a page
boundary get snapshots too; a next turn sent as the last one ends waits for its terminal snapshot. (Over HTTP against
transformers: tests/e2e/test_hybrid_families.py.)"""

from __future__ import annotations

import pytest
import torch

from engine.scheduler.request import Phase
from tests.support.engine_harness import Harness, tiny_model

SYSTEM_END, USER_END = 158, 166  # message ends of the first prompt (neither on a page boundary of 16)


def prompt(length: int, seed: int = 1) -> list[int]:
    torch.manual_seed(seed)
    return torch.randint(0, 300, (length,)).tolist()


def generate(harness: Harness, tokens: list[int], max_tokens: int, ends: list[int] = ()) -> tuple[int, list[int]]:
    request = harness.add(tokens, message_ends=list(ends), max_tokens=max_tokens, temperature=0, ignore_eos=True)
    harness.run()
    return request.cached_tokens, request.tokens[len(tokens):]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_restored_snapshot_continues_exactly_where_its_request_stood(device: str) -> None:
    """On a GPU too, where a hybrid model runs the same torch reference with eager steps."""
    model = tiny_model(family="qwen3_5").to(device)
    first = prompt(169)
    turns = [(first, 6, [SYSTEM_END, USER_END])]
    reused = Harness(model, device=device)
    cached, reply = generate(reused, *turns[0])
    assert cached == 0
    with_reply = first + reply + first[-10:]  # the next turn: the first, its reply, more
    second = generate(reused, with_reply, 6)
    reused.close()
    fresh = Harness(model, snapshots=0, device=device)  # every prompt computed from position 0
    expected = [generate(fresh, first, 6, [SYSTEM_END, USER_END]), generate(fresh, with_reply, 6)]
    fresh.close()
    assert expected[0][1] == reply and expected[1][0] == 0
    # The first turn's terminal endpoint: its prompt and reply but the last token, which no step consumed.
    assert second[0] >= len(first) + len(reply) - 1
    assert second[1] == expected[1][1]


def test_a_restored_request_cancelled_leaves_the_snapshot_for_the_next() -> None:
    model = tiny_model(family="qwen3_5")
    base = prompt(169)
    longer = base + base[-9:]
    harness = Harness(model)
    generate(harness, base, 1, [SYSTEM_END, USER_END])
    cancelled = harness.add(longer, max_tokens=50, temperature=0, ignore_eos=True)
    while len(cancelled.tokens) < len(longer) + 3:
        harness.step()
    assert cancelled.cached_tokens == len(base)
    harness.scheduler.cancel(cancelled)
    harness.run()
    assert cancelled.phase is Phase.FINISHED
    cached, tokens = generate(harness, longer, 5)
    harness.close()
    fresh = Harness(model, snapshots=0)
    assert (cached, tokens) == (len(base), generate(fresh, longer, 5)[1])
    fresh.close()


def test_snapshot_rows_are_bounded_and_the_oldest_evicted() -> None:
    model = tiny_model(family="qwen3_5")
    harness = Harness(model, snapshots=3)
    outputs = [generate(harness, prompt(40, seed), 3, [20]) for seed in range(4)]
    prefix = harness.scheduler.prefix
    assert prefix.cache.snapshots <= 3
    assert harness.scheduler.counters["snapshot_evictions"] > 0
    # The latest prompt's snapshots survive: it continues from its terminal endpoint.
    again = generate(harness, prompt(40, 3) + outputs[3][1] + [7, 8], 3)
    harness.close()
    fresh = Harness(model, snapshots=0)
    assert again[0] >= 40 + 3 - 1 and again[1] == generate(fresh, prompt(40, 3) + outputs[3][1] + [7, 8], 3)[1]
    fresh.close()


def test_endpoints_on_a_page_boundary_get_snapshots_on_their_blocks() -> None:
    """A message end and a terminal endpoint that fall on a page boundary (of 16): the block ending there takes the
    snapshot, and a later prompt that extends it continues from there with the tokens of a full computation."""
    model = tiny_model(family="qwen3_5")
    first = prompt(176)
    harness = Harness(model)
    generate(harness, first, 1, [160])  # message end 160; terminal endpoint 176, the whole prompt
    branch = first[:160] + prompt(20, seed=2)  # the message end's prefix, then other text
    after = first + [9, 10, 11]  # the whole first prompt, then more
    got = [generate(harness, branch, 4), generate(harness, after, 4)]
    harness.close()
    fresh = Harness(model, snapshots=0)
    assert got == [(160, generate(fresh, branch, 4)[1]), (176, generate(fresh, after, 4)[1])]
    fresh.close()


def test_the_next_turn_sent_as_the_last_ends_waits_for_its_terminal_snapshot() -> None:
    """The next turn arrives before the step that copies the ended request's terminal snapshot has run: it waits
    that step for its slot, then restores the terminal snapshot rather than the prompt end's."""
    model = tiny_model(family="qwen3_5")
    first = prompt(100)
    harness = Harness(model)
    ended = harness.add(first, max_tokens=4, temperature=0, ignore_eos=True)
    while ended.phase is not Phase.FINISHED:
        harness.step()
    turn = ended.tokens + [7, 8]
    cached, tokens = generate(harness, turn, 4)
    harness.close()
    fresh = Harness(model, snapshots=0)
    assert (cached, tokens) == (len(first) + 3, generate(fresh, turn, 4)[1])  # all but the last output token
    fresh.close()
