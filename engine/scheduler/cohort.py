"""DecodeCohort: the requests of steady decode steps, with their rows' fields kept as columns (docs/design.md, Scheduler and prefix checkpoints).

At 256 live requests a decode step built as a Row per request, then read back field by field by commit, complete
and the graph executor's frame, cost a Python pass per field per request. A steady step (every row the same request
as the step before, moved on by one position) changes only the rows' starts and output indexes, which move together
as int64 arrays, and the page tables of the few rows that reach a new page. The cohort holds what stays; each plan
takes its columns as a DecodeRows (engine/scheduler/plan.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import compress
from operator import attrgetter, contains

import numpy as np

from common.protocol import Logprobs
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.plan import DecodeRows, Row
from engine.scheduler.request import Request

# Where a decode row's fields (Request.decode_row, a list in Row order) hold what moves from step to step.
AT_START, AT_PAGE_TABLE, AT_OUTPUT_INDEX, AT_PROMPT_LEN = (
    Row._fields.index(name) for name in ("start", "page_table", "output_index", "prompt_len"))
# The fields of a request's decode rows that differ between requests (the others, but for start, page table and output
# index, are the same in every decode row: one token, sampled, from the device, with no history, prompt targets, bans,
# label queries or drafts, as engine/scheduler/rows.py decode_row says).
PER_REQUEST = tuple(Row._fields.index(name) for name in (
    "slot", "generation", "sampling", "seed", "prompt_len", "epoch", "images", "rope_shift"))
DECODE_ROW = attrgetter("decode_row")


class DecodeCohort:
    """Decoding requests, in slot order, whose next rows are their last decode rows moved on. Made by the scheduler
    when every decode candidate has such a row (Request.decode_row), and valid while its `version` (the scheduler's
    counts of epoch bumps and of requests that started decoding) holds: nobody placed, preempted, ended, or newly
    decoding. When some requests leave (ended, preempted, or drew their last output), the rest keep their columns
    (`without`)."""

    def __init__(self, requests: list[Request], version: tuple[int, int], page_size: int) -> None:
        self.requests = requests
        self.version = version
        self.page_size = page_size
        rows = list(map(DECODE_ROW, requests))
        self.constant = {i: value for i, value in enumerate(rows[0]) if i not in PER_REQUEST}
        self.fields = {i: [row[i] for row in rows] for i in PER_REQUEST}  # Row index -> a value per request
        self.tables = [row[AT_PAGE_TABLE] for row in rows]  # (a decode_row's table may be short: `plan` catches up)
        self.table_ends = np.fromiter(map(len, self.tables), np.int64, len(requests)) * page_size
        self.scheduled = np.array([r.scheduled for r in requests], dtype=np.int64)
        self.prompt_lens = np.array(self.fields[AT_PROMPT_LEN], dtype=np.int64)
        # A request stops being a decode candidate once its scheduled positions reach this (its last output drawn),
        # and ends once its tokens are more than this.
        self.limits = self.prompt_lens + np.array([r.max_outputs for r in requests], dtype=np.int64) - 1
        self.stop_ids = [r.stop_ids for r in requests]
        self.histories = [r.tokens for r in requests]  # (a request's token list is the same list all its life)
        # PrefixReuse.publish has no work for a request before its computed positions reach this.
        self.publish_from = np.array([r.publish_from for r in requests], dtype=np.int64)

    @classmethod
    def of(cls, requests: list[Request], version: tuple[int, int], page_size: int) -> DecodeCohort | None:
        """The cohort of these decode candidates; None when some has no decode row to move on (its first in this
        epoch, or min_tokens still bans its stop ids): the scheduler plans that step row by row. (A constrained
        request is in a cohort only where its masks may come after submit: RequestScheduler.plan.)"""
        if not requests or None in [r.decode_row for r in requests]:
            return None
        return cls(requests, version, page_size)

    def steady(self, version: tuple[int, int]) -> bool:
        """Whether the next decode step's rows are this cohort's: nothing changed, and no request drew its last."""
        return self.version == version and bool((self.scheduled < self.limits).all())

    def without(self, left: set[Request], version: tuple[int, int]) -> DecodeCohort:
        """This cohort less the requests that left it (ended or preempted: `left` may hold others too) and those
        that drew their last output: a copy of each column without their rows."""
        gone = sorted({i for i, request in enumerate(self.requests) if request in left} |
                      set(np.flatnonzero(self.scheduled >= self.limits).tolist()))

        def rest(column: list) -> list:
            column = list(column)
            for i in reversed(gone):
                del column[i]
            return column

        keep = np.ones(len(self.requests), dtype=bool)
        keep[gone] = False
        cohort = object.__new__(DecodeCohort)
        cohort.version, cohort.page_size, cohort.constant = version, self.page_size, self.constant
        cohort.requests, cohort.tables, cohort.stop_ids, cohort.histories = map(
            rest, (self.requests, self.tables, self.stop_ids, self.histories))
        cohort.fields = {i: rest(column) for i, column in self.fields.items()}
        cohort.table_ends, cohort.scheduled, cohort.prompt_lens, cohort.limits, cohort.publish_from = (
            column[keep] for column in (self.table_ends, self.scheduled, self.prompt_lens, self.limits,
                                        self.publish_from))
        return cohort

    def plan(self, pages: PageAllocator) -> DecodeRows | None:
        """The next decode step's rows: each request's last decode row at its next position. A row whose position
        lies past its table takes the pages its request lacks, in row order, as the scheduler's _reserve would;
        None (nothing allocated) when the free pages are too few: eviction or preemption must decide."""
        grow = np.flatnonzero(self.scheduled >= self.table_ends)
        if len(grow):
            size, requests = self.page_size, self.requests
            rows, ends = grow.tolist(), (self.scheduled[grow] + 1).tolist()
            missing = [max(-(-end // size) - len(requests[i].pages), 0) for i, end in zip(rows, ends)]
            if sum(missing) > pages.free_count:
                return None
            for i, end, count in zip(rows, ends, missing):
                request = requests[i]
                if count > 0:
                    request.pages.extend(pages.allocate(count))
                table = tuple(request.pages[:-(-end // size)])
                self.tables[i] = request.decode_row[AT_PAGE_TABLE] = table
                self.table_ends[i] = len(table) * size
        count = len(self.requests)
        columns: list = [(value,) * count for value in self.constant.values()]
        for i, column in self.fields.items():  # (PER_REQUEST and `constant` are each in Row order)
            columns.insert(i, column)
        columns[AT_START] = self.scheduled
        columns[AT_PAGE_TABLE] = tuple(self.tables)
        columns[AT_OUTPUT_INDEX] = self.scheduled + 1 - self.prompt_lens
        return DecodeRows(tuple(columns))

    def committed(self, rows: DecodeRows) -> np.ndarray:
        """A plan of this cohort's rows was committed: each request's scheduled positions, now one more."""
        self.scheduled = rows.columns[AT_START] + 1
        return self.scheduled

    def complete(self, rows: DecodeRows, live: list[bool] | None, tokens: tuple[int, ...],
                 logprobs: tuple[Logprobs | None, ...], publish: Callable[[Request, int], None]
                 ) -> tuple[list[Request], list[int], list[Logprobs | None], list[tuple[Request, int]]]:
        """A completed step of this cohort's rows, whose requests hold their slots still where `live` says (None:
        all do): publication of the blocks that reach a request's `publish_from`, then each token's commit, as
        StepCompleter.rows (engine/scheduler/completion.py) does row by row. Returns the live rows' requests, tokens
        and logprobs, and the requests whose token ends them, with that token, in row order."""
        requests, computed = self.requests, rows.columns[AT_START] + 1
        due = np.flatnonzero(computed >= self.publish_from).tolist()
        limits, stop_ids, histories = self.limits, self.stop_ids, self.histories
        if live is not None:
            due = [i for i in due if live[i]]
            requests, tokens, logprobs, stop_ids, histories = (
                list(compress(column, live)) for column in (requests, tokens, logprobs, stop_ids, histories))
            limits = limits[np.fromiter(live, bool, len(live))]
        for i in due:  # (publish_from may lag, by a cohort that `without` made meanwhile: a call with no work)
            request = self.requests[i]
            publish(request, int(computed[i]))
            self.publish_from[i] = request.publish_from
        for history, token in zip(histories, tokens):
            history.append(token)  # (its prefix keys catch up when the prefix cache next reads them)
        now = time.monotonic()  # every token of the step is committed now
        for request in requests:
            request.last_commit = now
        # Which tokens end their request: a pass at C speed for each reason, and a look at the rows only when some
        # token does (most steps none).
        ending: list[tuple[Request, int]] = []
        long = np.fromiter(map(len, histories), np.int64, len(requests)) > limits
        if long.any() or any(map(contains, stop_ids, tokens)):
            ending = [(request, token) for request, token, stops, at_limit in zip(requests, tokens, stop_ids, long)
                      if at_limit or token in stops]
        return requests, list(tokens), list(logprobs), ending
