"""RequestScheduler: live slots, page reservation, and the choice of what the next step runs.

Policy: every decoding request advances one token per step; the remaining token budget of the step
(`prefill_chunk_size`) goes to prompts in arrival order, so long prompts load in chunks while decode keeps flowing.
When pages run out, the newest decoding request is preempted and later recomputed from its tokens (its sampling
randomness depends only on seed and position, so the outcome is unchanged).

Here: intake, placement, preemption, planning and commit. Beside it: the candidate steps and their values
(candidates.py), the rows built from requests (rows.py), steady decode steps as columns (cohort.py), which requests
draft (speculation.py), prefix reuse (prefix.py, which owns page_copies.py, snapshot_rows.py and host_traffic.py: the
host and disk tiers), and what a completed step commits to its requests (completion.py).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.candidates import CandidateSteps
from engine.scheduler.cohort import AT_OUTPUT_INDEX, AT_PAGE_TABLE, AT_START, DecodeCohort
from engine.scheduler.completion import StepCompleter, end_reason, validate
from engine.scheduler.copies import copy_fields
from engine.scheduler.plan import SLOT, Completion, DecodeRows, DiskDone, Plan, Row
from engine.scheduler.policy import GraphCostModel, PolicyConfig, decode_capacity
from engine.scheduler.prefix import PrefixReuse
from engine.scheduler.request import Phase, Request
from engine.scheduler.results import Finished, StepResult
from engine.scheduler.rows import decode_row, next_row, verify_row

if TYPE_CHECKING:
    from engine.scheduler.speculation import Proposer

# As module globals: looking a member up on the Enum class costs a quarter of a microsecond, once per live request
# in the per-step loops below.
WAITING, PREFILL, DECODE, FINISHED = Phase.WAITING, Phase.PREFILL, Phase.DECODE, Phase.FINISHED


NOTHING_PLANNED: tuple[None, tuple, int, list] = (None, (), 0, [])


class StalePlan(ValueError):
    """A plan whose requests changed (cancelled, finished, preempted) between planning and commit."""


class RequestScheduler:
    def __init__(self, max_active: int, queue_capacity: int, num_pages: int, page_size: int,
                 prefill_chunk_size: int, identity: bytes = bytes(32), policy: PolicyConfig = PolicyConfig(),
                 proposer: Proposer | None = None, snapshots: int | None = None, snapshot_bytes: int = 0,
                 host: HostTier | None = None, page_bytes: int = 0, disk: DiskTier | None = None,
                 late_masks: bool = False) -> None:
        """`proposer`: speculative decoding's (engine/speculative/); None decodes one token per step.
        `snapshots`: a hybrid model's recurrent-state snapshot rows (of `snapshot_bytes` each), which its prefix
        reuse needs (PrefixReuse). `host`: the host tier evicted checkpoints move to, `page_bytes` a page; `disk`: the
        disk tier below it. `late_masks`: the executor takes a step's grammar masks after its submit
        (Executor.late_masks), so constrained requests keep a second step in flight as free ones do."""
        self.max_active = max_active
        self.queue_capacity = queue_capacity
        self.page_size = page_size
        self.prefill_chunk_size = prefill_chunk_size
        self.pages = PageAllocator(num_pages)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_active
        self._generations = [0] * max_active
        self._by_id: dict[str, Request] = {}
        self._retiring: set[Request] = set()  # finished, but steps using the slot's state are still in flight
        self.constrained = 0  # requests added and not finished that have an output grammar (none: no grammar work)
        self.late_masks = late_masks
        self._prefilling = 0  # requests in the PREFILL phase (none: no pass over the slots for them)
        self.counters: Counter[str] = Counter()
        self.prefix = PrefixReuse(identity, page_size, self.pages, self.counters, snapshots, max_active,
                                  snapshot_bytes, host, page_bytes, disk)
        # The latest plan, its copies, the epoch bumps (placements, preemptions, ends) made before it was, and its
        # rows' requests: a plan whose requests no epoch bump touched since is current without looking at each.
        self._planned: tuple[Plan | None, tuple, int, list[Request]] = NOTHING_PLANNED
        self._epoch_bumps = 0
        self._decoding_starts = 0  # phase changes to DECODE: a new decode candidate
        self._cohort: DecodeCohort | None = None  # the steady decode steps' requests (engine/scheduler/cohort.py)
        self._left: set[Request] = set()  # requests whose epoch was bumped since the cohort's version
        # Committed plans of a cohort, in fence order until they complete: (fence, rows, cohort, epoch bumps made
        # before the plan was).
        self._steady: deque[tuple[int, DecodeRows, DecodeCohort, int]] = deque()
        self.policy = policy
        self.costs = GraphCostModel(policy)
        self.candidates = CandidateSteps(policy, self.costs, page_size, prefill_chunk_size)
        self.speculation = None
        if proposer is not None:
            from engine.scheduler.speculation import Speculation

            self.speculation = Speculation(proposer, self.costs, self.counters)
        self._completed_fence = 0
        self._committed_fence = 0
        self.prefix.tiers.recompute_seconds = self._recompute_seconds
        self.completer = StepCompleter(self.slots, self.prefix, self.pages, page_size, self.speculation,
                                       self._try_allocate, self._finish)

    def _recompute_seconds(self, tokens: int) -> float:
        """What prefilling `tokens` again would take, by the learned cost of the largest prefill step measured,
        scaled to them (0.0: none measured yet). Not the full chunk's alone: prompts shorter than a chunk never run
        one (a 4,000-token prompt is a step of 4,096 under an 8,192-token chunk), and the tiers' decisions would
        then go unmeasured for good."""
        for capacity in reversed(self.candidates.capacities):
            if seconds := self.costs.last_known(("prefill", capacity)):
                return seconds * tokens / capacity
        return 0.0

    # --- intake -------------------------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def retiring_count(self) -> int:
        return len(self._retiring)

    @property
    def cached_pages(self) -> int:
        return self.prefix.cache.stats.pages

    def can_admit(self, pending: int = 0) -> bool:
        """Whether one more request fits the queue; `pending`: requests admitted but not added yet (their grammars
        compile), which the bound counts too."""
        return len(self.waiting) + pending < self.queue_capacity

    def add(self, request: Request) -> None:
        request.prefill_target = len(request.tokens)
        self.constrained += request.grammar is not None
        self.prefix.track(request)
        self.waiting.append(request)
        self._by_id[request.request_id] = request

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def cancel(self, request: Request, reason: str = "abort") -> Finished:
        """Stop scheduling at once; pages come back once the last step using them completes."""
        if request.phase is WAITING and request in self.waiting:
            self.waiting.remove(request)
        return self._finish(request, reason)

    def in_flight(self, request: Request) -> bool:
        """Whether steps with the request's rows are submitted and not completed."""
        return request.row_fence > self._completed_fence

    def has_work(self) -> bool:
        return bool(self.waiting) or self.live > 0

    @property
    def prefilling(self) -> bool:
        """Whether some admitted request's prompt is not all computed yet."""
        return self._prefilling > 0

    # --- planning -----------------------------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        if self.speculation is None and (self.late_masks or not self.constrained) and not self._prefilling and \
                not self.prefix.pending and (not self.waiting or None not in self.slots):
            plan = self._plan_steady()
            if plan is not None:
                return plan
        self._cohort, self._left = None, set()  # (a step planned row by row may change its requests' rows)
        decoders = self._decode_candidates()
        speculation, depths, done = self.speculation, {}, self._completed_fence
        if speculation is not None:  # without a proposer no request ever drafts or verifies
            depths = speculation.rounds(decoders)
            decoders = speculation.stepping(decoders, depths, done)
        prefills = self._prefill_candidates()
        choice = self.candidates.choose(decoders, prefills, time.monotonic(), depths, done)
        drafts = speculation.drafts(decoders, depths, done, self.slots) \
            if choice is not None and choice.shape[0] == "verify" else {}
        rows: list[Row] = []  # their slots are never preempted by this plan
        planned: list[Request] = []  # each row's request, for commit
        verifies = False  # some row verifies drafts
        size = self.page_size
        for request in decoders:
            # None once preempted (by an earlier reservation of this plan too), and while min_tokens bans stop ids
            moved = request.decode_row
            start = request.scheduled
            if moved is not None and start < len(moved[AT_PAGE_TABLE]) * size and \
                    (not drafts or request not in drafts):
                # Most steps: the previous decode row moved on by one position, on the same pages (rows.decode_row).
                moved[AT_START], moved[AT_OUTPUT_INDEX] = start, start + 1 - request.prompt_len
                rows.append(tuple.__new__(Row, moved))
                planned.append(request)
                continue
            if request.slot < 0:
                continue  # preempted by an earlier reservation of this plan
            draft = drafts.get(request, ()) if drafts else ()
            end = request.scheduled + 1 + len(draft)
            # _reserve (and the prefix cache's eviction) only when a page is missing.
            if -(-end // size) > len(request.pages) and not self._reserve(request, end, rows):
                continue
            rows.append(verify_row(request, draft, size, speculation.proposer.name) if draft
                        else decode_row(request, size))
            planned.append(request)
            verifies = verifies or bool(draft)
        decodes = len(rows)  # rows so far: decode rows, unless some verify
        budget = choice.prefill_tokens if choice is not None else 0
        for request in prefills:
            if budget <= 0:
                break
            if request.slot < 0:
                continue  # preempted by an earlier reservation of this plan
            length = request.atomic_length(request.scheduled, min(budget, request.prefill_target - request.scheduled))
            length = self.prefix.snapshots.stop_at(request, request.scheduled, length)
            if not self._reserve(request, request.scheduled + length, rows):
                break
            rows.append(next_row(request, length, size))
            planned.append(request)
            budget -= length
        copies = self.prefix.planned_copies()
        disk = self.prefix.tiers.planned_disk()
        if not rows and not copies and disk is None:
            return None
        shape = choice.shape if choice is not None else ("copy", 0)
        if shape[0] == "verify" and not drafts:  # no proposal came: a plain decode step after all
            shape = ("decode", shape[1])
        # The plan's kind as Plan.kind would find it: known from the rows made (a prefill row holds its tokens).
        kind = "verify" if verifies else "mixed" if decodes and len(rows) > decodes else "decode" if decodes \
            else "prefill"
        plan = Plan.of_kind(kind, tuple(rows), shape=shape, disk=disk, **copy_fields(copies))
        self._planned = (plan, copies, self._epoch_bumps, planned)
        return plan

    def _plan_steady(self) -> Plan | None:
        """A decode step of the cohort's requests, as columns; None when the step is not steady (some candidate
        has no row to move on, or a page is missing and none is free): it is planned row by row then. The same
        plan as the row-by-row one: nothing waits to prefill, copies or drafts, and no constrained request waits
        for its last token (late masks), so the decode step is the only candidate, and each row is its request's
        last decode row moved on, on pages allocated in row order."""
        version = (self._epoch_bumps, self._decoding_starts)
        cohort = self._cohort
        if cohort is None or not cohort.steady(version):
            if cohort is not None and cohort.version[1] == version[1]:  # requests left it, none joined
                cohort = cohort.without(self._left, version)
            else:
                cohort = DecodeCohort.of(self._decode_candidates(), version, self.page_size)
            self._cohort = cohort
            self._left = set()
            if cohort is None or not cohort.requests:
                return None
        rows = cohort.plan(self.pages)
        if rows is None:
            return None
        plan = Plan.of_kind("decode", rows, shape=("decode", decode_capacity(len(rows))))
        self._planned = (plan, (), self._epoch_bumps, cohort.requests)
        return plan

    def commit(self, plan: Plan, fence: int) -> None:
        """Validate, then make the plan's reservations binding; a stale plan changes nothing."""
        planned, copies, epoch_bumps, requests = self._planned
        if planned is not plan:
            raise StalePlan("commit of a plan that is not the latest one planned")
        rows = plan.rows
        if epoch_bumps != self._epoch_bumps:  # some request was placed, preempted or ended since: which?
            for row, request in zip(rows, map(self.slots.__getitem__, map(SLOT, rows))):
                if request is None or request.generation != row.generation or request.epoch != row.epoch:
                    self._planned = NOTHING_PLANNED
                    raise StalePlan(f"slot {row.slot}.{row.generation} changed after planning")
        # (Each row's request is the one planned: a slot's request with the row's generation is that placement.)
        self._planned = NOTHING_PLANNED
        self._committed_fence = fence
        self.prefix.copies_committed(copies, fence, plan.disk)
        if type(rows) is DecodeRows:
            cohort = self._cohort
            if cohort is not None and cohort.requests is requests:
                ends = cohort.committed(rows)
                self._steady.append((fence, rows, cohort, epoch_bumps))
            else:
                ends = rows.columns[AT_START] + 1
            for request, end in zip(requests, ends.tolist()):
                request.scheduled = end
                request.row_fence = fence
            return
        for row, request in zip(rows, requests):
            request.scheduled = row.start + row.length
            request.row_fence = fence
            if self.prefix.hybrid and row.tokens is not None and (
                    request.scheduled == request.prefill_target or request.scheduled in request.message_ends):
                # A checkpoint endpoint: the state there.
                self.prefix.snapshots.snapshot_at(request, request.scheduled)
        if plan.kind != "decode":  # (a decode row's request is decoding, and was placed steps ago)
            for row, request in zip(rows, requests):
                request.fresh = False
                if row.draft:
                    request.speculation.verifying = True
                if request.phase is PREFILL and request.scheduled == request.prefill_target:
                    self._set_phase(request, DECODE)

    def _decode_candidates(self) -> list[Request]:
        """Decoding requests with tokens left to draw; a constrained one only once its last step has completed
        (its mask depends on that step's token) unless its masks may come after submit, while free ones keep a
        second step in flight."""
        # The output tokens that committed or submitted steps will have produced: a decoding request's scheduled
        # positions reach its prefill target (prompt and earlier outputs), and each position past the prompt's last
        # yields one.
        done, waits = self._completed_fence, not self.late_masks
        return [r for r in self.slots if r is not None and r.phase is DECODE
                and r.scheduled - r.prompt_len + 1 < r.max_outputs
                and not (waits and r.grammar is not None and r.row_fence > done)]

    def _prefill_candidates(self) -> list[Request]:
        running = [r for r in self.slots if r is not None and r.phase is PREFILL] if self._prefilling else []
        running.sort(key=lambda r: r.arrival)
        while self.waiting and None in self.slots and not self._awaits(self.waiting[0]):
            request = self.waiting.popleft()
            self._place(request)
            running.append(request)
        return running

    def _awaits(self, request: Request) -> bool:
        """Whether the request at the head of the queue had better wait before it takes a slot: for a snapshot
        that a step in flight makes, for checkpoints read from disk, for room to restore host blocks into."""
        prefix = self.prefix
        return prefix.awaits_snapshot(request) or prefix.awaits_load(request) or \
            prefix.awaits_room(request, self._completed_fence, self._committed_fence)

    def _set_phase(self, request: Request, phase: Phase) -> None:
        """Every phase change goes through here, which counts the requests prefilling, and those that start decoding
        (a decode cohort holds while none do)."""
        self._prefilling += (phase is PREFILL) - (request.phase is PREFILL)
        self._decoding_starts += phase is DECODE
        request.phase = phase

    def _place(self, request: Request) -> None:
        slot = self.slots.index(None)
        self._generations[slot] += 1
        request.slot, request.generation = slot, self._generations[slot]
        self._set_phase(request, PREFILL)
        request.scheduled = 0
        request.fresh = True
        self._bump_epoch(request)
        self.slots[slot] = request
        self.prefix.reuse(request, self._try_allocate)

    def _try_allocate(self, count: int) -> list[int] | None:
        self.prefix.free_pages(count)
        return self.pages.allocate(count) if self.pages.free_count >= count else None

    def _reserve(self, request: Request, positions: int, planned: list[Row]) -> bool:
        """Make sure the request owns pages for `positions` tokens, preempting others if pages run out (never the
        requests of the rows planned so far)."""
        needed = -(-positions // self.page_size) - len(request.pages)
        self.prefix.free_pages(needed)
        while needed > self.pages.free_count:
            if not self._preempt_one(request, {row.slot for row in planned}):
                return False
            self.prefix.free_pages(needed)  # the victim's cached pages are unpinned now: evictable
        if needed > 0:
            request.pages.extend(self.pages.allocate(needed))
        return True

    def _preempt_one(self, requester: Request, protected: set[int]) -> bool:
        """Recompute-preempt the newest request that arrived after `requester`, so the oldest always progresses
        and two requests never evict each other in turn."""
        done = self._completed_fence
        victims = [r for r in self.slots if r is not None and r.slot not in protected and r.row_fence <= done
                   and r.pages and r.arrival > requester.arrival]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.arrival)
        self._bump_epoch(victim)
        self.prefix.release(victim)
        victim.scheduled = 0
        victim.prefill_target = len(victim.tokens)
        self._set_phase(victim, WAITING)
        self.slots[victim.slot] = None
        victim.slot = -1
        self.waiting.appendleft(victim)
        return True

    def _bump_epoch(self, request: Request) -> None:
        """The request was placed, preempted or ended: plans made before touch it no more, and its next decode row
        is built anew."""
        request.epoch += 1
        request.decode_row = None
        if self._cohort is not None:
            self._left.add(request)
        self._epoch_bumps += 1

    # --- completion ---------------------------------------------------------------------------------------------
    def complete(self, completion: Completion, plan: Plan) -> StepResult:
        """The step of `plan` completed: its fence, cost, pages and tiers here, its rows' news by StepCompleter."""
        sampled = validate(completion, plan, self._completed_fence)
        fence, error = completion.fence, completion.error
        steady = self._steady
        while steady and steady[0][0] < fence:  # (plans whose completions never came: the engine stopped them)
            steady.popleft()
        cohort = steady.popleft() if steady and steady[0][1] is plan.rows else None
        self._completed_fence = fence
        if error is None and plan.rows:
            self.costs.observe(plan.shape, completion.duration)
            if self.speculation is not None:
                self.speculation.earn(completion.duration)
        self.pages.advance_completed(fence)
        self.prefix.advance_completed(fence)
        self.prefix.tiers.completed(completion, plan)
        result, completer = StepResult(), self.completer
        if error is None and plan.kind != "verify":
            if cohort is not None:
                _, rows, members, epoch_bumps = cohort
                ending = completer.cohort(rows, members, epoch_bumps != self._epoch_bumps, completion, fence, result)
            else:
                ending = completer.rows(plan.rows, completion, fence, result)
            self._retire(fence)
            completer.prompt_news(completion, plan, result)
            for request, token in ending:
                result.finished.append(self._finish(request, end_reason(request, token)))
            return result
        completer.settle(plan.rows, fence, error is not None)
        self._retire(fence)
        if error is not None:
            completer.fail(plan.rows, error, result)
            return result
        completer.prompt_news(completion, plan, result)
        completer.rounds(sampled, completion, fence, result)
        return result

    def disk_done(self, done: DiskDone) -> None:
        """A step's disk work ended, after the step (the executor's disk thread): the disk tier's files and the host
        slots they were written from or read into are its own from now on."""
        self.prefix.tiers.disk_done(done)

    def _retire(self, fence: int) -> None:
        """Requests that ended with steps in flight are gone once the last of those steps completed."""
        if self._retiring:
            for request in [r for r in self._retiring if r.last_fence <= fence]:
                self._retiring.discard(request)

    def _finish(self, request: Request, reason: str, error: str | None = None) -> Finished:
        self.constrained -= request.grammar is not None and request.phase is not FINISHED
        self._set_phase(request, FINISHED)
        request.finish_reason = reason
        self._bump_epoch(request)
        if self.prefix.hybrid and reason in ("stop", "length"):
            self.prefix.terminal(request, self._try_allocate)
        if self.in_flight(request):
            self._retiring.add(request)
        self.prefix.release(request)
        if request.slot >= 0 and self.slots[request.slot] is request:
            self.slots[request.slot] = None
        self._by_id.pop(request.request_id, None)
        return Finished(request, reason, error)
