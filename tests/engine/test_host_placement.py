"""Where the host tier places a step's spills in its least-recently-used order (engine/cache/placement.py): as the
most recent while conversations return within what the tier holds, as the oldest (a stable part of them kept) when
they return after more traffic than it holds. At the scheduler's level, each step completed once committed; the
device's pages are all evicted after every turn, so that what a turn finds comes from the host."""

from __future__ import annotations

import random

from engine.cache.host_tier import HostTier
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler
from tests.engine.test_hybrid_host_tier import CHUNK, PAGE, PAGES, SLOTS, add, run

BLOCKS = 2  # a conversation's history: two blocks and a partial one


def scheduler(host_slots: int, placed: bool | None = None) -> RequestScheduler:
    """`placed`: the placement fixed (True: as the oldest, False: as the most recent); None: the duel's."""
    s = RequestScheduler(SLOTS, 4, PAGES, PAGE, CHUNK, host=HostTier(host_slots), page_bytes=10)
    if placed is not None:
        s.prefix.host.placement.spilled = lambda keys: placed
    return s


def history(conversation: int) -> list[int]:
    return [1000 * (conversation + 1) + t for t in range(BLOCKS * PAGE + 1)]


def turn(s: RequestScheduler, tokens: list[int]) -> Request:
    """A request of `tokens` to its end, then the device's pages all evicted."""
    request = add(s, tokens)
    run(s)
    s.prefix.free_pages(PAGES)
    run(s)
    return request


def returned(s: RequestScheduler, conversation: int) -> bool:
    """The conversation's second turn: whether it found its whole history."""
    return turn(s, history(conversation) + [7, 7, 7]).cached_tokens >= BLOCKS * PAGE


def revisited_once(s: RequestScheduler, conversations: int, seed: int) -> int:
    """Every conversation's first turn, then each one's second in a random order: how many found their history."""
    for c in range(conversations):
        turn(s, history(c))
    order = list(range(conversations))
    random.Random(seed).shuffle(order)
    return sum(returned(s, c) for c in order)


def returning_soon(s: RequestScheduler, conversations: int, lag: int) -> int:
    """Each conversation's second turn `lag` first turns after its first: how many found their history."""
    found = 0
    for c in range(conversations + lag):
        if c < conversations:
            turn(s, history(c))
        if c >= lag:
            found += returned(s, c - lag)
    return found


def test_conversations_that_return_soon_are_placed_most_recent() -> None:
    duel, recent, oldest = scheduler(24), scheduler(24, placed=False), scheduler(24, placed=True)
    assert returning_soon(recent, 40, lag=2) == 40
    assert returning_soon(oldest, 40, lag=2) < 10
    assert returning_soon(duel, 40, lag=2) == 40
    assert not duel.prefix.host.placement.bimodal and duel.counters["host_placed_oldest"] == 0


def test_more_conversations_than_the_tier_holds_keep_a_stable_part() -> None:
    """A host of 48 slots, 40 conversations of 2 blocks revisited once each: least-recently-used order gives up
    every history just before its turn comes, and each miss computes one again whose spills push out the next."""
    duel = [revisited_once(scheduler(48), 40, seed) for seed in range(3)]
    recent = [revisited_once(scheduler(48, placed=False), 40, seed) for seed in range(3)]
    assert sum(duel) >= 2 * sum(recent)
