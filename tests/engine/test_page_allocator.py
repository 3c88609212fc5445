"""Pages: never handed out twice, and never reused before the fence of their last use completes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.page_allocator import OutOfPages, PageAllocator


def test_allocate_and_release_at_a_completed_fence() -> None:
    pages = PageAllocator(4)
    taken = pages.allocate(3)
    assert len(set(taken)) == 3 and pages.free_count == 1
    with pytest.raises(OutOfPages):
        pages.allocate(2)
    pages.release(taken, last_use_fence=0)
    assert pages.free_count == 4


def test_retired_pages_wait_for_their_fence() -> None:
    pages = PageAllocator(4)
    a, b = pages.allocate(2), pages.allocate(2)
    pages.release(b, last_use_fence=7)
    pages.release(a, last_use_fence=5)  # out of order is fine
    assert pages.free_count == 0 and pages.retiring_count == 4
    pages.advance_completed(6)
    assert sorted(pages.allocate(2)) == sorted(a)
    pages.advance_completed(7)
    assert pages.free_count == 2
    with pytest.raises(ValueError):
        pages.advance_completed(3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "complete"]), st.integers(1, 5)), max_size=60))
def test_no_page_is_ever_owned_twice(ops: list[tuple[str, int]]) -> None:
    pages = PageAllocator(12)
    owned: list[list[int]] = []
    in_use: set[int] = set()
    retiring: dict[int, int] = {}  # page -> fence
    fence = completed = 0
    for op, n in ops:
        if op == "alloc" and n <= pages.free_count:
            got = pages.allocate(n)
            assert not (set(got) & in_use) and not (set(got) & set(retiring))
            in_use |= set(got)
            owned.append(got)
        elif op == "release" and owned:
            fence += 1
            got = owned.pop(0)
            in_use -= set(got)
            retiring.update({p: fence for p in got})
            pages.release(got, fence)
        elif op == "complete":
            completed = min(completed + n, fence)
            pages.advance_completed(completed)
            retiring = {p: f for p, f in retiring.items() if f > completed}
        assert pages.free_count + len(in_use) + len(retiring) == 12
