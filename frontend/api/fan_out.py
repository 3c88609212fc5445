"""Routes whose one HTTP request fans out into several engine submissions (decisions: a prefill per prompt about a
state; embeddings: one per input) answer with every result or with none."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def all_or_nothing(jobs: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure, after cancelling the rest."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
