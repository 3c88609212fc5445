"""Which evicted blocks the host tier takes when it cannot take them all, and which it gives up first (docs/design.md,
Host retention). The device evicts a conversation's blocks deepest first; a lookup can restore only a run that starts
at the device's prefix, so a host short of slots keeps each conversation's first blocks, and gives up the ends of
conversations before their beginnings. At the scheduler's level: each step completed as soon as it is committed."""

from __future__ import annotations

from engine.cache.host_tier import HostTier
from engine.scheduler.scheduler import RequestScheduler
from tests.engine.test_hybrid_host_tier import CHUNK, PAGE, PAGES, SLOTS, add, run

FOUR_BLOCKS = list(range(1, 18))


def scheduler(host_slots: int) -> RequestScheduler:
    return RequestScheduler(SLOTS, 4, PAGES, PAGE, CHUNK, host=HostTier(host_slots), page_bytes=10)


def evicted(s: RequestScheduler, tokens: list[int]) -> list[bytes]:
    """A request of `tokens` to its end, then every checkpoint evicted from the device; its block keys."""
    request = add(s, tokens)
    run(s)
    s.prefix.free_pages(PAGES)
    run(s)
    return request.history.block_keys[: len(request.tokens) // PAGE]


def test_a_host_short_of_slots_keeps_a_conversations_first_blocks() -> None:
    s = scheduler(host_slots=3)
    keys = evicted(s, FOUR_BLOCKS)
    assert len(keys) == 4 and [key in s.prefix.host for key in keys] == [True, True, True, False]
    second = add(s, FOUR_BLOCKS + [2, 7, 5, 6])
    run(s)
    assert second.cached_tokens == 3 * PAGE


def test_the_host_gives_up_the_ends_of_conversations_first() -> None:
    s = scheduler(host_slots=6)
    first = evicted(s, FOUR_BLOCKS[:13])
    assert all(key in s.prefix.host for key in first)
    evicted(s, [100 + t for t in FOUR_BLOCKS[:13]])  # three blocks more: one of the first conversation's goes
    assert [key in s.prefix.host for key in first] == [True, True, False]
    second = add(s, FOUR_BLOCKS[:13] + [5, 6])
    run(s)
    assert second.cached_tokens == 2 * PAGE
