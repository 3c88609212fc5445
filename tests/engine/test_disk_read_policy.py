"""The disk tier's reads against recomputation: a prompt waits for its checkpoints to be read from disk unless the
learned costs say that computing their tokens again is faster, the files already queued counted in (docs/design.md,
Host retention). At the scheduler's level: each step completed as soon as it is committed, no model."""

from __future__ import annotations

from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.scheduler.scheduler import RequestScheduler
from tests.engine.test_hybrid_host_tier import CHUNK, FIRST, PAGE, PAGES, SLOTS, add, evicted, run


def on_disk(file_seconds: float, prefill_seconds: float | None, chunk: int = CHUNK
            ) -> tuple[RequestScheduler, list[int]]:
    """A scheduler whose host tier (eight slots) gave the first conversation up to disk while five more passed
    through (their prompts in steps of 16 tokens, each taking 0.01 s), with these learned costs: a disk file's
    seconds, and a full prefill chunk's (None: the chunk never ran)."""
    s = RequestScheduler(SLOTS, 4, PAGES, PAGE, chunk, host=HostTier(8), page_bytes=10, disk=DiskTier(100, []))
    first = evicted(s, FIRST)
    for base in range(1, 6):
        evicted(s, [base * 50 + t for t in FIRST])
    disk = s.prefix.tiers.disk
    assert all(key in disk.disk and key not in s.prefix.host for key in first.history.block_keys[:2])
    disk.file_seconds.append(file_seconds)
    if prefill_seconds is not None:
        s.costs.observe(("prefill", chunk), prefill_seconds)
    return s, first.tokens


def test_a_prompt_waits_for_disk_reads_while_reading_is_faster() -> None:
    s, tokens = on_disk(file_seconds=0.001, prefill_seconds=1.0)
    second = add(s, tokens + [5, 6])
    plans = run(s)
    assert plans[0].disk.reads and plans[0].rows == ()  # it waited for them
    assert second.cached_tokens == 2 * PAGE and s.counters["disk_reads"] == 2 and s.counters["disk_declined"] == 0


def test_disk_reads_slower_than_recomputing_are_not_taken() -> None:
    s, tokens = on_disk(file_seconds=1.0, prefill_seconds=0.001)
    second = add(s, tokens + [5, 6])
    plans = run(s)
    assert not any(plan.disk is not None and plan.disk.reads for plan in plans)
    assert second.cached_tokens == 0 and s.counters["disk_declined"] == 1


def test_a_disk_slower_than_recomputing_is_not_written_to() -> None:
    """What the host gives up is then gone at once, its slot free for the next spills as without a disk tier, where
    waiting for files nobody would read back held the slots and refused the spills."""
    s = RequestScheduler(SLOTS, 4, PAGES, PAGE, CHUNK, host=HostTier(8), page_bytes=10, disk=DiskTier(100, []))
    s.prefix.tiers.disk.file_seconds.append(1.0)
    s.costs.observe(("prefill", CHUNK), 0.001)
    for base in range(6):
        last = evicted(s, [base * 50 + t for t in FIRST])
    assert s.counters["disk_writes"] == 0 and s.counters["disk_unwritten"] > 0
    assert len(s.prefix.tiers.disk.disk) == 0
    assert all(key in s.prefix.host for key in last.history.block_keys[:2])


def test_the_cost_of_recomputing_is_learned_from_steps_shorter_than_a_chunk() -> None:
    """Prompts shorter than the chunk never run a full one (here every step is 16 tokens of a 32-token chunk): the
    largest prefill step's learned cost, scaled to the tokens, is what the reads are weighed against."""
    s, tokens = on_disk(file_seconds=1.0, prefill_seconds=None, chunk=2 * CHUNK)
    second = add(s, tokens + [5, 6])
    run(s)
    assert second.cached_tokens == 0 and s.counters["disk_declined"] == 1
