"""The grammar engine's worker processes (frontend/chat/grammar_check.py): they validate, and each runs under a cap
on its address space, so a grammar that llguidance expands without end kills a worker, not the host's memory."""

from __future__ import annotations

import resource

from frontend.chat.grammar_check import WORKER_MEMORY, IsolatedValidator


def test_workers_validate_under_a_bounded_address_space() -> None:
    validator = IsolatedValidator(workers=1)
    try:
        assert validator.check("regex", "[a-z]+")[0] is False
        assert validator.check("lark", "start: (")[0] is True
        limit = validator._current().submit(resource.getrlimit, resource.RLIMIT_AS).result(30)
        assert limit == (WORKER_MEMORY, WORKER_MEMORY)
    finally:
        validator.close()
