"""RequestScheduler: live slots, page reservation, and the choice of what the next step runs.

Policy: every decoding request advances one token per step; the remaining token budget of the step
(`prefill_chunk_size`) goes to prompts in arrival order, so long prompts load in chunks while decode keeps flowing.
When pages run out, the newest decoding request is preempted and later recomputed from its tokens (its sampling
randomness depends only on seed and position, so the outcome is unchanged).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from itertools import compress
from operator import and_, is_
from typing import TYPE_CHECKING

import numpy as np

from common.protocol import Logprobs
from engine.cache.disk_tier import DiskTier
from engine.cache.host_tier import HostTier
from engine.cache.page_allocator import PageAllocator
from engine.scheduler.cohort import AT_OUTPUT_INDEX, AT_PAGE_TABLE, AT_START, DecodeCohort
from engine.scheduler.plan import GENERATION, SAMPLE, SLOT, Completion, DecodeRows, Plan, Row, fields
from engine.scheduler.policy import Candidate, GraphCostModel, PolicyConfig, choose, decode_capacity, price
from engine.scheduler.prefix import PageCopy, PrefixReuse, Restore, Spill, StateCopy
from engine.scheduler.request import Phase, Request
from engine.scheduler.results import Finished, StepResult

if TYPE_CHECKING:
    from engine.scheduler.speculation import Choice, Proposer

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
                 host: HostTier | None = None, page_bytes: int = 0, disk: DiskTier | None = None) -> None:
        """`proposer`: speculative decoding's (engine/speculative/); None decodes one token per step.
        `snapshots`: a hybrid model's recurrent-state snapshot rows (of `snapshot_bytes` each), which its prefix
        reuse needs (PrefixReuse). `host`: the host tier evicted checkpoints move to, `page_bytes` a page; `disk`: the
        disk tier below it."""
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
        self.speculation = None
        if proposer is not None:
            from engine.scheduler.speculation import Speculation

            self.speculation = Speculation(proposer, self.costs, self.counters)
        self._completed_fence = 0
        # Prompt-token capacities of a step: page-aligned, doubling up to the chunk size.
        self._chunk_capacities = [page_size << i for i in range(32) if page_size << i < prefill_chunk_size]
        self._chunk_capacities.append(prefill_chunk_size)
        self.prefix.recompute_seconds = self._recompute_seconds

    def _recompute_seconds(self, tokens: int) -> float:
        """What prefilling `tokens` again would take, by the learned cost of a full prefill chunk (0.0: unknown)."""
        chunk = self.prefill_chunk_size
        return self.costs.last_known(("prefill", chunk)) * tokens / chunk

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

    def can_admit(self) -> bool:
        return len(self.waiting) < self.queue_capacity

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
        if self.speculation is None and not self.constrained and not self._prefilling and \
                not self.prefix.pending and (not self.waiting or None not in self.slots):
            plan = self._plan_steady()
            if plan is not None:
                return plan
        self._cohort, self._left = None, set()  # (a step planned row by row may change its requests' rows)
        decoders = self._decode_candidates()
        depths = self._draft_depths(decoders)
        # A request that would draft waits for its step in flight rather than take the second frame (its proposal
        # needs its last token) when drafting promises enough; one with a verify round in flight waits for that
        # round's accepted length. Either waits for its own completion only: other requests fill the frame.
        if self.speculation is not None:  # without a proposer no request ever drafts or verifies
            done = self._completed_fence
            decoders = [r for r in decoders if r.row_fence <= done or not self._verifying(r) and not (
                r in depths and depths[r].worth_draining)]
        prefills = self._prefill_candidates()
        choice = self._choose(decoders, prefills, time.monotonic(), depths)
        drafts = self._drafts(decoders, depths) if choice is not None and choice.shape[0] == "verify" else {}
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
                # Most steps: the previous decode row moved on by one position, on the same pages (_decode_row).
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
            rows.append(self._verify_row(request, draft) if draft else self._decode_row(request))
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
            length = self.prefix.stop_at(request, request.scheduled, length)
            if not self._reserve(request, request.scheduled + length, rows):
                break
            rows.append(self._row(request, length))
            planned.append(request)
            budget -= length
        copies = self.prefix.planned_copies()
        disk = self.prefix.planned_disk()
        if not rows and not copies and disk is None:
            return None
        shape = choice.shape if choice is not None else ("copy", 0)
        if shape[0] == "verify" and not drafts:  # no proposal came: a plain decode step after all
            shape = ("decode", shape[1])
        # The plan's kind as Plan.kind would find it: known from the rows made (a prefill row holds its tokens).
        kind = "verify" if verifies else "mixed" if decodes and len(rows) > decodes else "decode" if decodes \
            else "prefill"
        plan = Plan.of_kind(kind, tuple(rows), shape=shape,
                            copies=tuple((c.source, c.destination) for c in copies if isinstance(c, PageCopy)),
                            state_copies=tuple((c.source, c.destination) for c in copies if isinstance(c, StateCopy)),
                            spills=tuple((c.page, c.slot) for c in copies if isinstance(c, Spill)),
                            restores=tuple((c.slot, c.page) for c in copies if isinstance(c, Restore)), disk=disk)
        self._planned = (plan, copies, self._epoch_bumps, planned)
        return plan

    def _plan_steady(self) -> Plan | None:
        """A decode step of the cohort's requests, as columns; None when the step is not steady (some candidate
        has no row to move on, or a page is missing and none is free): it is planned row by row then. The same
        plan as the row-by-row one: nothing waits to prefill, copies, drafts or is constrained, so the decode step
        is the only candidate, and each row is its request's last decode row moved on, on pages allocated in row
        order."""
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

    def _choose(self, decoders: list[Request], prefills: list[Request], now: float,
                depths: dict[Request, Choice]) -> Candidate | None:
        """Score the step shapes on offer (PolicyConfig) and return the chosen one."""
        config = self.policy
        waiting = sum(r.prefill_target - r.scheduled for r in prefills)
        done = self._completed_fence
        drafting = [depths[r] for r in decoders if r in depths and r.row_fence <= done] if depths else []
        batch = decode_capacity(len(decoders))
        if decoders and waiting <= 0 and not drafting:
            # The decode step is the only candidate: choose() takes it whatever its value, which goes unscored (a
            # pass over every decoder saved on every steady decode step).
            return Candidate(len(decoders), 0, 0.0, ("decode", batch))
        candidates = []
        decode_value = 0
        if decoders:  # (none: a lone prompt's first step, where numpy's calls cost tens of µs of its first token)
            # price() over every decoder at once (numpy, the same arithmetic per element), summed in order as before.
            waited = now - np.array([r.last_commit for r in decoders], dtype=np.float64)
            values = (config.output_token_value * (1 + price(config, config.delivery_fairness, waited))).tolist()
            decode_value = sum(values)
            candidates.append(Candidate(len(decoders), 0, decode_value, ("decode", batch)))
            if drafting:
                from engine.scheduler.speculation import width_of

                value = sum(v * depths[r].expected if r in depths else v for v, r in zip(values, decoders))
                width = width_of(max(choice.depth for choice in drafting))
                candidates.append(Candidate(len(decoders), 0, value, ("verify", batch, width)))
        largest = self._chunk_capacities[-1]
        for capacity in self._chunk_capacities:
            tokens = min(capacity, waiting)
            if tokens <= 0:
                break
            value = self._prefill_value(prefills, tokens, now)
            if decoders:
                candidates.append(Candidate(len(decoders), tokens, decode_value + value, ("mixed", capacity)))
            elif tokens == waiting or capacity == largest or self.costs.last_known(("prefill", capacity)) > 0:
                # A smaller chunk of what waits is offered once its cost is known: exploring it would only delay
                # a first token (a 67-token prompt split into 64 + 3, a cold long one into every capacity).
                candidates.append(Candidate(0, tokens, value, ("prefill", capacity)))
            if tokens == waiting:
                break
        return choose(candidates, self.costs, config)

    def _prefill_value(self, prefills: list[Request], tokens: int, now: float) -> float:
        config, value = self.policy, 0.0
        for request in prefills:
            if tokens <= 0:
                break
            take = min(tokens, request.prefill_target - request.scheduled)
            waited = now - request.last_commit
            value += take * (1 + price(config, config.token_fairness, waited))
            if take == request.prefill_target - request.scheduled:
                value += config.terminal_value + config.terminal_age_price * 1000 * waited
            tokens -= take
        return value

    # --- speculation (engine/speculative/) ------------------------------------------------------------------------
    def _verifying(self, request: Request) -> bool:
        return request.speculation is not None and request.speculation.verifying

    def _draft_depths(self, decoders: list[Request]) -> dict[Request, Choice]:
        """The round of each decoding request that would draft now."""
        if self.speculation is None or not decoders:
            return {}
        batch = decode_capacity(len(decoders))
        depths = {r: self.speculation.depth(r, batch) for r in decoders if not self._verifying(r)}
        return {r: choice for r, choice in depths.items() if choice.depth > 0}

    def _drafts(self, decoders: list[Request], depths: dict[Request, Choice]) -> dict[Request, tuple]:
        done = self._completed_fence  # others' last token is pending:
        batch = [(r, depths[r]) for r in decoders if r in depths and r.row_fence <= done]
        live = {(r.slot, r.generation) for r in self.slots if r is not None}
        proposals = self.speculation.propose(batch, live)
        return {request: draft for (request, _), draft in zip(batch, proposals) if draft}

    def _verify_row(self, request: Request, draft: tuple[int, ...]) -> Row:
        start = request.scheduled  # the last committed token's position: it comes first, its KV unwritten yet
        end = start + 1 + len(draft)
        return Row(slot=request.slot, generation=request.generation, start=start, length=1 + len(draft),
                   tokens=(request.tokens[-1],) + draft, page_table=tuple(request.pages[: -(-end // self.page_size)]),
                   sample=True, output_index=start + 1 - request.prompt_len, sampling=request.sampling,
                   seed=request.seed, prompt_len=request.prompt_len, epoch=request.epoch, draft=draft,
                   proposer=self.speculation.proposer.name, rope_shift=request.rope_shift(start, end),
                   images=request.images)  # a vision model's eager step places text after images by them

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
                self.prefix.snapshot_at(request, request.scheduled)  # a checkpoint endpoint: the state there
        if plan.kind != "decode":  # (a decode row's request is decoding, and was placed steps ago)
            for row, request in zip(rows, requests):
                request.fresh = False
                if row.draft:
                    request.speculation.verifying = True
                if request.phase is PREFILL and request.scheduled == request.prefill_target:
                    self._set_phase(request, DECODE)

    def _decode_candidates(self) -> list[Request]:
        """Decoding requests with tokens left to draw; a constrained one only once its last step has completed
        (its mask depends on that step's token), while free ones keep a second step in flight."""
        # The output tokens that committed or submitted steps will have produced: a decoding request's scheduled
        # positions reach its prefill target (prompt and earlier outputs), and each position past the prompt's last
        # yields one.
        done = self._completed_fence
        return [r for r in self.slots if r is not None and r.phase is DECODE
                and r.scheduled - r.prompt_len + 1 < r.max_outputs
                and not (r.grammar is not None and r.row_fence > done)]

    def _prefill_candidates(self) -> list[Request]:
        running = [r for r in self.slots if r is not None and r.phase is PREFILL] if self._prefilling else []
        running.sort(key=lambda r: r.arrival)
        while self.waiting and None in self.slots and not self.prefix.awaits_snapshot(self.waiting[0]) and \
                not self.prefix.awaits_load(self.waiting[0]):
            request = self.waiting.popleft()
            self._place(request)
            running.append(request)
        return running

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

    def _decode_row(self, request: Request) -> Row:
        """A decode row. Between two decode steps of one epoch only its position and page table move: the
        previous decode row is moved on. Rebuilt whole on the epoch's first, after a verify round's rewind (pages
        went back), and while min_tokens bans the stop ids (`banned` depends on the position: such a row is not
        kept to move on). Its other position-dependent fields are constant past the prompt: no prompt targets,
        label queries or image spans lie there, so `scores` is () and `rope_shift` is the shift after the last
        image."""
        fields = request.decode_row
        if fields is None:
            row = self._row(request, 1)
            request.decode_row = None if row.banned else list(row)
            return row
        end = request.scheduled + 1
        pages = -(-end // self.page_size)
        if len(fields[AT_PAGE_TABLE]) != pages:
            fields[AT_PAGE_TABLE] = tuple(request.pages[:pages])
        fields[AT_START], fields[AT_OUTPUT_INDEX] = end - 1, end - request.prompt_len
        return tuple.__new__(Row, fields)

    def _row(self, request: Request, length: int) -> Row:
        start = request.scheduled
        end = start + length
        prefill = request.phase is PREFILL
        samples = (not prefill or end == request.prefill_target) and not request.scored
        targets = ()
        if prefill and request.sampling.prompt_logprobs is not None:
            targets = tuple(request.tokens[start + 1:min(end + 1, request.prompt_len)])
        return Row(
            slot=request.slot, generation=request.generation, start=start, length=length,
            tokens=tuple(request.tokens[start:end]) if prefill else None,
            page_table=tuple(request.pages[: -(-end // self.page_size)]),
            sample=samples, output_index=end - request.prompt_len, sampling=request.sampling, seed=request.seed,
            prompt_len=request.prompt_len, history=tuple(request.tokens[:start]) if request.fresh else None,
            prompt_targets=targets, epoch=request.epoch, images=request.images,
            rope_shift=request.rope_shift(start, end),
            banned=tuple(sorted(request.stop_ids)) if end - request.prompt_len < request.sampling.min_tokens else (),
            scores=tuple((p, ids) for p, ids in request.label_queries if start <= p < end),
            pool=request.pooling if request.pooling == "mean" or end == request.prefill_target and prefill else "")

    # --- completion ---------------------------------------------------------------------------------------------
    def complete(self, completion: Completion, plan: Plan) -> StepResult:
        sampled = self._validate(completion, plan)
        fence, error, slots = completion.fence, completion.error, self.slots
        steady = self._steady
        while steady and steady[0][0] < fence:  # (plans whose completions never came: the engine stopped them)
            steady.popleft()
        cohort = steady.popleft() if steady and steady[0][1] is plan.rows else None
        self._completed_fence = fence
        if completion.tier_seconds:
            self.prefix.page_copy_seconds.append(completion.tier_seconds / (len(plan.spills) + len(plan.restores)))
        if error is None and plan.rows:
            self.costs.observe(plan.shape, completion.duration)
            if self.speculation is not None:
                self.speculation.earn(completion.duration)
        self.pages.advance_completed(fence)
        self.prefix.advance_completed(fence)
        self.prefix.tiers_completed(fence, completion.unreadable, plan if error is not None else None)
        result = StepResult()
        if error is None and plan.kind != "verify":
            ending = self._complete_steady(cohort, completion, fence, result) if cohort is not None else \
                self._complete_rows(plan.rows, completion, fence, result)
            self._retire(fence)
            self._complete_prompt_logprobs(completion)
            self._complete_scores(completion, plan, result)
            for request, token in ending:
                result.finished.append(self._finish(request, self._end_reason(request, token)))
            return result
        for row in plan.rows:
            request = slots[row.slot]
            if request is None or request.generation != row.generation:
                continue
            if row.draft:
                request.speculation.verifying = False  # its accepted positions are published with its tokens below
            elif error is None:
                computed = row.start + row.length
                if computed >= request.publish_from:
                    self.prefix.publish(request, computed, fence, self._try_allocate)
        self._retire(fence)
        if error is not None:
            for row in plan.rows:
                request = slots[row.slot]
                if request is not None and request.generation == row.generation:
                    result.finished.append(self._finish(request, "error", error))
            return result
        self._complete_prompt_logprobs(completion)
        self._complete_scores(completion, plan, result)
        logprobs = completion.logprobs or (None,) * len(completion.tokens)
        accepted = completion.accepted or (0,) * len(completion.tokens)
        now = time.monotonic()  # every token of the step is committed now
        for row, token, lp, k in zip(sampled, completion.tokens, logprobs, accepted):
            request = slots[row.slot]
            if request is None or request.generation != row.generation or request.phase is FINISHED:
                continue  # the request ended while this step was in flight
            if not row.draft:
                reason = self._commit_token(request, token, lp, result, now)
            else:
                emitted, reason = self._emit(request, row.draft[:k] + (token,), lp, result, now)
                self.speculation.observe(request, row.proposer, len(row.draft), min(k, emitted), emitted <= k)
                # Only accepted positions hold KV worth keeping or publishing; the rejected ones give back pages.
                self.prefix.publish(request, min(row.start + 1 + k, len(request.tokens)), fence, self._try_allocate)
                if reason is None:
                    self._rewind(request, fence)
            if reason is not None:
                result.finished.append(self._finish(request, reason))
        return result

    def _complete_rows(self, rows: tuple[Row, ...], completion: Completion, fence: int,
                       result: StepResult) -> list[tuple[Request, int]]:
        """A step without drafts or error, in one loop over its rows without a call per row: each row's request
        publishes the blocks it completed (PrefixReuse.publish, for a few rows a step), and a sampling row commits
        its token as _commit_token does. The rows' requests that ended while the step was in flight are left out
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
                self.prefix.publish(request, computed, fence, self._try_allocate)
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

    def _complete_steady(self, steady: tuple[int, DecodeRows, DecodeCohort, int], completion: Completion,
                         fence: int, result: StepResult) -> list[tuple[Request, int]]:
        """_complete_rows for a step of a cohort's rows (DecodeCohort.complete): its requests are the cohort's,
        which all hold their slots still unless some request was placed, preempted or ended since it was planned."""
        _, rows, cohort, epoch_bumps = steady
        live = None
        if epoch_bumps != self._epoch_bumps:
            # A row is stale when its request left its slot (ended): the request in a slot is the row's placement
            # (the row's generation) exactly when it is the row's request, since a request is placed again only
            # after a preemption, which waits for its steps in flight.
            live = list(map(is_, map(self.slots.__getitem__, fields(rows, SLOT)), cohort.requests))
        result.requests, result.token_ids, result.logprobs, ending = cohort.complete(
            rows, live, completion.tokens, completion.logprobs or (None,) * len(completion.tokens),
            lambda request, computed: self.prefix.publish(request, computed, fence, self._try_allocate))
        result.distinct = True
        return ending

    def _retire(self, fence: int) -> None:
        """Requests that ended with steps in flight are gone once the last of those steps completed."""
        if self._retiring:
            for request in [r for r in self._retiring if r.last_fence <= fence]:
                self._retiring.discard(request)

    def _complete_prompt_logprobs(self, completion: Completion) -> None:
        for slot, generation, logprobs in completion.prompt_logprobs:
            request = self.slots[slot]
            if request is not None and request.generation == generation:
                request.prompt_logprobs.append(logprobs)

    def _emit(self, request: Request, tokens: tuple[int, ...], lp: Logprobs | None, result: StepResult,
              now: float) -> tuple[int, str | None]:
        """Commit tokens in order up to the first that ends the request: (tokens committed, finish reason)."""
        for count, token in enumerate(tokens, 1):
            if (reason := self._commit_token(request, token, lp, result, now)) is not None:
                return count, reason
        return len(tokens), None

    def _commit_token(self, request: Request, token: int, lp: Logprobs | None, result: StepResult,
                      now: float) -> str | None:
        """Commit one output token; the finish reason when it ends the request."""
        request.tokens.append(token)  # (its prefix keys catch up when the prefix cache next reads them)
        request.last_commit = now
        result.requests.append(request)
        result.token_ids.append(token)
        result.logprobs.append(lp)
        return self._end_reason(request, token)

    @staticmethod
    def _end_reason(request: Request, token: int) -> str | None:
        """Why `token`, just committed, ends the request; None when it does not."""
        if token in request.stop_ids:
            return "stop"
        # (request.outputs, without a property call per token)
        return "length" if len(request.tokens) - request.prompt_len >= request.max_outputs else None

    def _rewind(self, request: Request, fence: int) -> None:
        """After a verify round: the next step feeds the last committed token; pages past it go back."""
        request.scheduled = len(request.tokens) - 1
        request.decode_row = None  # moving a row on assumes its pages only grew since; here they shrink
        keep = -(-len(request.tokens) // self.page_size)
        self.pages.release(request.pages[keep:], fence)
        del request.pages[keep:]

    def _complete_scores(self, completion: Completion, plan: Plan, result: StepResult) -> None:
        """A scored prefill keeps the label logits it read, an embedding what its rows pooled, and either ends with
        the step that computed its prompt: it never holds a slot for decoding. Logits are kept by position, so a
        recomputed chunk reads them again."""
        if plan.kind == "decode":
            return  # no prompt rows, so no label queries
        for slot, generation, position, logits in completion.scores:
            request = self.slots[slot]
            if request is not None and request.generation == generation:
                request.label_logits[position] = logits
        for slot, generation, start, vector in completion.pooled:
            request = self.slots[slot]
            if request is not None and request.generation == generation:
                # A mean's sum starts over with a row at position 0 (a recompute after a preemption starts there).
                request.pooled = vector if start == 0 or request.pooling == "last" else request.pooled + vector
        for row in plan.rows:
            if row.tokens is None:
                continue  # a decode row: a scored request ends before any (docs/design.md, Beyond plain decoding)
            request = self.slots[row.slot]
            if request is not None and request.generation == row.generation and request.scored \
                    and row.start + row.length == request.prefill_target:
                result.finished.append(self._finish(request, "stop"))

    def _validate(self, completion: Completion, plan: Plan) -> list[Row]:
        """A completion must follow the last one and fit its plan; anything else is a broken executor. Returns the
        plan's sampled rows, which the completion's columns follow."""
        if completion.fence <= self._completed_fence:
            raise ValueError(f"completion fence {completion.fence} after {self._completed_fence}")
        if not (len(completion.slots) == len(completion.generations) == len(completion.tokens)):
            raise ValueError("completion columns differ in length")
        rows = plan.rows
        sampled = rows if type(rows) is DecodeRows else list(compress(rows, map(SAMPLE, rows)))  # (all sample)
        if completion.error is None and (list(fields(sampled, SLOT)) != list(completion.slots)
                                         or list(fields(sampled, GENERATION)) != list(completion.generations)):
            raise ValueError("completion rows differ from the plan's sampled rows")
        return sampled

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
