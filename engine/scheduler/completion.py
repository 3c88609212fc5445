"""The completion side of the scheduler: what a completed step commits to the requests of its rows (docs/design.md,
The engine loop).

RequestScheduler.complete keeps the step's bookkeeping (its fence, its learned cost, the pages and host slots it
frees) and hands the rows here. A row's news is taken only while its request still holds the row's slot (the same
placement: the row's generation); a request that ended while the step was in flight is left out. Each such row
publishes the blocks its positions completed (PrefixReuse.publish), a sampling row commits its token, a prompt row
keeps the prompt logprobs, label logits or pooled vector it read, and a verify round emits the drafts the target
accepted and its own token, then rewinds (docs/speculative.md). The requests that their news ends are finished
through the scheduler (`finish`), in row order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import compress
from operator import and_, is_
from typing import TYPE_CHECKING

from common.protocol import Logprobs
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.cohort import DecodeCohort
from engine.scheduler.plan import GENERATION, SAMPLE, SLOT, Completion, DecodeRows, Plan, Row, fields
from engine.scheduler.prefix import PrefixReuse
from engine.scheduler.request import Phase, Request
from engine.scheduler.results import Finished, StepResult

if TYPE_CHECKING:
    from engine.scheduler.speculation import Speculation

FINISHED = Phase.FINISHED  # (a module global: looked up once per row, not on the Enum class)


def validate(completion: Completion, plan: Plan, completed_fence: int) -> list[Row]:
    """A completion must follow the last one (`completed_fence`) and fit its plan; anything else is a broken
    executor. Returns the plan's sampled rows, which the completion's columns follow."""
    if completion.fence <= completed_fence:
        raise ValueError(f"completion fence {completion.fence} after {completed_fence}")
    if not (len(completion.slots) == len(completion.generations) == len(completion.tokens)):
        raise ValueError("completion columns differ in length")
    rows = plan.rows
    sampled = rows if type(rows) is DecodeRows else list(compress(rows, map(SAMPLE, rows)))  # (all sample)
    if completion.error is None and (list(fields(sampled, SLOT)) != list(completion.slots)
                                     or list(fields(sampled, GENERATION)) != list(completion.generations)):
        raise ValueError("completion rows differ from the plan's sampled rows")
    return sampled


def end_reason(request: Request, token: int) -> str | None:
    """Why `token`, just committed, ends the request; None when it does not."""
    if token in request.stop_ids:
        return "stop"
    # (request.outputs, without a property call per token)
    return "length" if len(request.tokens) - request.prompt_len >= request.max_outputs else None


def commit_token(request: Request, token: int, lp: Logprobs | None, result: StepResult, now: float) -> str | None:
    """Commit one output token; the finish reason when it ends the request."""
    request.tokens.append(token)  # (its prefix keys catch up when the prefix cache next reads them)
    request.last_commit = now
    result.requests.append(request)
    result.token_ids.append(token)
    result.logprobs.append(lp)
    return end_reason(request, token)


def emit(request: Request, tokens: tuple[int, ...], lp: Logprobs | None, result: StepResult,
         now: float) -> tuple[int, str | None]:
    """Commit tokens in order up to the first that ends the request: (tokens committed, finish reason)."""
    for count, token in enumerate(tokens, 1):
        if (reason := commit_token(request, token, lp, result, now)) is not None:
            return count, reason
    return len(tokens), None


class StepCompleter:
    """Takes completed steps' news into the requests of the scheduler's `slots` (the scheduler's own list)."""

    def __init__(self, slots: list[Request | None], prefix: PrefixReuse, pages: PageAllocator, page_size: int,
                 speculation: Speculation | None, allocate: Callable[[int], list[int] | None],
                 finish: Callable[..., Finished]) -> None:
        """`allocate`: pages for what a publication copies (the scheduler's, which may evict); `finish(request,
        reason, error=None)`: ends a request (RequestScheduler's, which gives its slot and pages back)."""
        self.slots = slots
        self.prefix = prefix
        self.pages = pages
        self.page_size = page_size
        self.speculation = speculation
        self.allocate = allocate
        self.finish = finish

    def rows(self, rows: tuple[Row, ...], completion: Completion, fence: int,
             result: StepResult) -> list[tuple[Request, int]]:
        """A step without drafts or error, in one loop over its rows without a call per row: each row's request
        publishes the blocks it completed (PrefixReuse.publish, for a few rows a step), and a sampling row commits
        its token as commit_token does. The rows' requests that ended while the step was in flight are left out
        (looked for after the loop, only when there are some). Returns the requests whose token ends them, with
        that token, in row order: they end once the step's other news is in."""
        tokens = completion.tokens
        now = time.monotonic()  # every token of the step is committed now
        requests = list(map(self.slots.__getitem__, map(SLOT, rows)))
        # Each row's token, None for a row that samples nothing (a decode step's rows all sample).
        if len(tokens) == len(rows):
            row_tokens = tokens
        else:
            sampled = iter(tokens)
            row_tokens = [next(sampled) if row.sample else None for row in rows]
        stale = False  # some row's request ended (or its slot holds a new one) while the step was in flight
        ending: list[tuple[Request, int]] = []
        for row, request, token in zip(rows, requests, row_tokens):
            if request is None or request.generation != row.generation:
                stale = True
                continue
            computed = row.start + row.length
            if computed >= request.publish_from:  # (a block completed, or a message end may be pending)
                self.prefix.publish(request, computed, fence, self.allocate)
            if token is None:
                continue
            history = request.tokens
            history.append(token)  # (its prefix keys catch up when the prefix cache next reads them)
            request.last_commit = now
            if token in request.stop_ids or len(history) - request.prompt_len >= request.max_outputs:
                ending.append((request, token))
        logprobs = completion.logprobs or (None,) * len(tokens)
        committed = requests
        if stale or row_tokens is not tokens:  # the news: the sampling rows whose request is still the row's
            live = [request is not None and request.generation == row.generation
                    for row, request in zip(rows, requests)]
            committed = list(compress(requests, map(and_, live, map(SAMPLE, rows))))
            if stale:
                kept = list(compress(live, map(SAMPLE, rows)))  # per sampling row
                tokens, logprobs = compress(tokens, kept), compress(logprobs, kept)
        result.requests, result.token_ids, result.logprobs = committed, list(tokens), list(logprobs)
        result.distinct = True
        return ending

    def cohort(self, rows: DecodeRows, cohort: DecodeCohort, changed: bool, completion: Completion, fence: int,
               result: StepResult) -> list[tuple[Request, int]]:
        """`rows` for a step of a cohort's rows (DecodeCohort.complete): its requests are the cohort's, which all
        hold their slots still unless some request was placed, preempted or ended since it was planned
        (`changed`)."""
        live = None
        if changed:
            # A row is stale when its request left its slot (ended): the request in a slot is the row's placement
            # (the row's generation) exactly when it is the row's request, since a request is placed again only
            # after a preemption, which waits for its steps in flight.
            live = list(map(is_, map(self.slots.__getitem__, fields(rows, SLOT)), cohort.requests))
        result.requests, result.token_ids, result.logprobs, ending = cohort.complete(
            rows, live, completion.tokens, completion.logprobs or (None,) * len(completion.tokens),
            lambda request, computed: self.prefix.publish(request, computed, fence, self.allocate))
        result.distinct = True
        return ending

    def settle(self, rows: tuple[Row, ...], fence: int, failed: bool) -> None:
        """Before a verify round's tokens (or a failed step's end): a verifying row's request verifies no more (its
        accepted positions are published with its tokens, `rounds`); another row publishes what it completed,
        unless the step `failed`."""
        slots = self.slots
        for row in rows:
            request = slots[row.slot]
            if request is None or request.generation != row.generation:
                continue
            if row.draft:
                request.speculation.verifying = False
            elif not failed:
                computed = row.start + row.length
                if computed >= request.publish_from:
                    self.prefix.publish(request, computed, fence, self.allocate)

    def fail(self, rows: tuple[Row, ...], error: str, result: StepResult) -> None:
        """The step of `rows` failed: the requests still in their slots end with its error."""
        for row in rows:
            request = self.slots[row.slot]
            if request is not None and request.generation == row.generation:
                result.finished.append(self.finish(request, "error", error))

    def prompt_news(self, completion: Completion, plan: Plan, result: StepResult) -> None:
        """What the plan's prompt rows read: prompt logprobs, label logits, pooled vectors. A scored prefill keeps
        the label logits it read, an embedding what its rows pooled, and either ends with the step that computed
        its prompt: it never holds a slot for decoding. Logits are kept by position, so a recomputed chunk reads
        them again."""
        slots = self.slots
        for slot, generation, logprobs in completion.prompt_logprobs:
            request = slots[slot]
            if request is not None and request.generation == generation:
                request.prompt_logprobs.append(logprobs)
        if plan.kind == "decode":
            return  # no prompt rows, so no label queries
        for slot, generation, position, logits in completion.scores:
            request = slots[slot]
            if request is not None and request.generation == generation:
                request.label_logits[position] = logits
        for slot, generation, start, vector in completion.pooled:
            request = slots[slot]
            if request is not None and request.generation == generation:
                # A mean's sum starts over with a row at position 0 (a recompute after a preemption starts there).
                request.pooled = vector if start == 0 or request.pooling == "last" else request.pooled + vector
        for row in plan.rows:
            if row.tokens is None:
                continue  # a decode row: a scored request ends before any (docs/design.md, Beyond plain decoding)
            request = slots[row.slot]
            if request is not None and request.generation == row.generation and request.scored \
                    and row.start + row.length == request.prefill_target:
                result.finished.append(self.finish(request, "stop"))

    def rounds(self, sampled: list[Row], completion: Completion, fence: int, result: StepResult) -> None:
        """The tokens of a step that verified drafts, row by row: a plain row commits its token; a verify row emits
        its accepted drafts and the target's token after them, teaches Speculation what the round accepted, and
        publishes its accepted positions only; a request that goes on rewinds to its last committed token."""
        slots = self.slots
        logprobs = completion.logprobs or (None,) * len(completion.tokens)
        accepted = completion.accepted or (0,) * len(completion.tokens)
        now = time.monotonic()  # every token of the step is committed now
        for row, token, lp, k in zip(sampled, completion.tokens, logprobs, accepted):
            request = slots[row.slot]
            if request is None or request.generation != row.generation or request.phase is FINISHED:
                continue  # the request ended while this step was in flight
            if not row.draft:
                reason = commit_token(request, token, lp, result, now)
            else:
                emitted, reason = emit(request, row.draft[:k] + (token,), lp, result, now)
                self.speculation.observe(request, row.proposer, len(row.draft), min(k, emitted), emitted <= k)
                # Only accepted positions hold KV worth keeping or publishing; the rejected ones give back pages.
                self.prefix.publish(request, min(row.start + 1 + k, len(request.tokens)), fence, self.allocate)
                if reason is None:
                    self._rewind(request, fence)
            if reason is not None:
                result.finished.append(self.finish(request, reason))

    def _rewind(self, request: Request, fence: int) -> None:
        """After a verify round: the next step feeds the last committed token; pages past it go back."""
        request.scheduled = len(request.tokens) - 1
        request.decode_row = None  # moving a row on assumes its pages only grew since; here they shrink
        keep = -(-len(request.tokens) // self.page_size)
        self.pages.release(request.pages[keep:], fence)
        del request.pages[keep:]
