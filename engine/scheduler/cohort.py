"""DecodeCohort: the requests of steady decode steps, with their rows' fields kept as columns (DESIGN.md, Scheduling).

At 256 live requests a decode step built as a Row per request, then read back field by field by commit, complete
and the graph executor's frame, cost a Python pass per field per request. A steady step (every row the same request
as the step before, moved on by one position) changes only the rows' starts and output indexes, which move together
as int64 arrays, and the page tables of the few rows that reach a new page. The cohort holds what stays; each plan
takes its columns as a DecodeRows (engine/scheduler/plan.py).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from engine.scheduler.plan import DecodeRows, Row
from engine.scheduler.request import Request

# Where a decode row's fields (Request.decode_row, a list in Row order) hold what moves from step to step.
AT_START, AT_PAGE_TABLE, AT_OUTPUT_INDEX, AT_PROMPT_LEN = (
    Row._fields.index(name) for name in ("start", "page_table", "output_index", "prompt_len"))
DECODE_ROW = attrgetter("decode_row")


class DecodeCohort:
    """Decoding requests, in slot order, whose next rows are their last decode rows moved on. Made by the scheduler
    when every decode candidate has such a row (Request.decode_row), and valid while its `version` (the scheduler's
    count of epoch bumps and phase changes) holds: nobody placed, preempted, ended, or newly decoding."""

    def __init__(self, requests: list[Request], version: tuple[int, int], page_size: int) -> None:
        self.requests = requests
        self.version = version
        self.page_size = page_size
        # The rows' fields in Row order; those at AT_START, AT_PAGE_TABLE and AT_OUTPUT_INDEX are replaced per plan.
        self.columns = list(zip(*map(DECODE_ROW, requests)))
        self.tables = list(self.columns[AT_PAGE_TABLE])  # (a decode_row's table may be short: `grow` catches up)
        self.table_ends = np.fromiter(map(len, self.tables), np.int64, len(requests)) * page_size
        self.scheduled = np.array([r.scheduled for r in requests], dtype=np.int64)
        self.prompt_lens = np.array(self.columns[AT_PROMPT_LEN], dtype=np.int64)
        # A request stops being a decode candidate once its scheduled positions reach this (its last output drawn).
        self.limits = self.prompt_lens + np.array([r.max_outputs for r in requests], dtype=np.int64) - 1

    @classmethod
    def of(cls, requests: list[Request], version: tuple[int, int], page_size: int) -> DecodeCohort | None:
        """The cohort of these decode candidates; None when some has no decode row to move on (its first in this
        epoch, or min_tokens still bans its stop ids): the scheduler plans that step row by row."""
        if not requests or None in map(DECODE_ROW, requests):
            return None
        return cls(requests, version, page_size)

    def steady(self, version: tuple[int, int]) -> bool:
        """Whether the next decode step's rows are this cohort's: nothing changed, and no request drew its last."""
        return self.version == version and bool((self.scheduled < self.limits).all())

    def missing_pages(self) -> tuple[np.ndarray, list[int]]:
        """The rows whose next position lies past their page table, and how many pages each request lacks for it
        (0 when it holds them already)."""
        grow = np.flatnonzero(self.scheduled >= self.table_ends)
        size, requests = self.page_size, self.requests
        ends = (self.scheduled[grow] + 1).tolist()
        return grow, [-(-end // size) - len(requests[i].pages) for i, end in zip(grow.tolist(), ends)]

    def grow(self, rows: np.ndarray) -> None:
        """The tables of these rows, to the pages their requests hold for the next position (allocated already)."""
        size = self.page_size
        for i in rows.tolist():
            request = self.requests[i]
            table = tuple(request.pages[:-(-(int(self.scheduled[i]) + 1) // size)])
            self.tables[i] = request.decode_row[AT_PAGE_TABLE] = table
            self.table_ends[i] = len(table) * size

    def rows(self) -> DecodeRows:
        """The next decode step's rows: each request's last decode row at its next position."""
        columns = list(self.columns)
        columns[AT_START] = self.scheduled
        columns[AT_PAGE_TABLE] = tuple(self.tables)
        columns[AT_OUTPUT_INDEX] = self.scheduled + 1 - self.prompt_lens
        return DecodeRows(tuple(columns))

    def committed(self, rows: DecodeRows) -> np.ndarray:
        """A plan of this cohort's rows was committed: each request's scheduled positions, now one more."""
        self.scheduled = rows.columns[AT_START] + 1
        return self.scheduled
