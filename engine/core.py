"""The engine loop (docs/design.md, The engine loop): ingest, publish completions, plan and submit, sleep."""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict, deque
from dataclasses import replace

import zmq

from common import protocol as wire
from common.links import Drops
from common.mrope import mrope_delta
from common.vision import ImageProcessing
from engine.admission import ModelBounds, submit_problem
from engine.executor.base import Executor
from engine.publication import RequestColumns, embedding, join_logprobs, label_logits, news_of, take
from engine.sampling.grammar import GrammarCompiler, GrammarSpec, constrained_rows, mask_words, plan_masks
from engine.scheduler.plan import Completion, Plan
from engine.scheduler.request import Request
from engine.scheduler.results import Finished, StepResult
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry

log = logging.getLogger("flare.engine")

FINISH_COUNTERS = {"stop": "completions", "length": "completions", "abort": "cancellations", "error": "failures"}
HEARTBEAT_INTERVAL = 1.0
FRONTEND_TIMEOUT = 10.0  # a frontend silent this long is gone: its requests are aborted
FAREWELL = 0.5  # seconds a failed engine keeps its socket open after failing its requests
PERSIST_SECONDS = 20.0  # what a clean stop spends writing the prefix cache to the disk tier, at most
# With a step in flight and no prompt waiting, the next step is planned this long before the one in flight is
# expected to end: the host's plan and submit take under a millisecond at 256 live requests, and the loop's sleep
# wakes within a millisecond of its deadline.
SUBMIT_LEAD = 0.002


class Engine:
    def __init__(self, card: wire.ModelCard, executor: Executor, scheduler: RequestScheduler,
                 vocab_size: int, socket: zmq.Socket, telemetry: EngineTelemetry, telemetry_address: str,
                 grammars: GrammarCompiler | None = None, vision: ImageProcessing | None = None) -> None:
        self.card = card
        self.vision = vision  # a vision model's image settings
        self.executor = executor
        self.scheduler = scheduler
        self.bounds = ModelBounds(vocab_size, card.context_limit, scheduler.page_size, scheduler.pages.num_pages,
                                  card.served_names[0], vision)
        self.socket = socket
        self.telemetry = telemetry
        self.telemetry_address = telemetry_address
        self.engine_id = telemetry.engine_id
        self.counters = telemetry.counters
        self.draining = False
        self.stopping = False
        self._frontends: dict[bytes, float] = {}  # identity -> last time heard from
        self._owned: dict[bytes, set[str]] = defaultdict(set)
        # When each step in flight is expected to end (monotonic seconds; 0.0 where its shape's cost is unknown).
        self._expected_ends: deque[float] = deque()
        self._defer_until = 0.0  # when the next step is due, if the last turn deferred it (_deferral)
        self._seed = random.SystemRandom()
        self._last_heartbeat = 0.0
        self.grammars = grammars  # None: structured output is refused (no tokenizer for the grammar engine)
        self._compiling: dict[str, tuple[bytes, wire.Submit]] = {}  # request id -> submit awaiting its grammar
        self._late: Plan | None = None  # the step submitted with Plan.masks_later, until its masks are given
        self._columns = RequestColumns.of([])  # the last published step's
        self.drops = Drops(log, "engine socket")  # messages of the wrong shape or undecodable
        self.unsent = Drops(log, "engine socket, sending")  # to frontends gone (or peers that only said Hello)

    # --- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.executor.wake_fd, zmq.POLLIN)
        if self.grammars is not None:
            poller.register(self.grammars.wake_fd, zmq.POLLIN)
        while not (self.stopping and not self._expected_ends):
            self.turn()
            # Whatever could be submitted was; sleep until a message, a completion or the next heartbeat.
            poller.poll(self._sleep_ms())
        if self.scheduler.prefix.persists:
            self._persist(poller)

    def _persist(self, poller: zmq.Poller) -> None:
        """A clean stop's last steps: the copies that requests' ends left, then the prefix cache's checkpoints
        written to the disk tier (PrefixReuse.persist), for at most PERSIST_SECONDS (the supervisor waits 30 s for
        an engine to exit)."""
        prefix, deadline = self.scheduler.prefix, time.monotonic() + PERSIST_SECONDS
        progress = True  # (the first steps make the copies pending from requests' ends, the last the last writes)
        while True:
            while prefix.pending or prefix.writing or self._expected_ends:
                if time.monotonic() > deadline:
                    log.warning("stopping before the prefix cache was all written to disk")
                    return
                self.turn()
                poller.poll(self._sleep_ms())
            if not progress:
                break
            progress = prefix.persist()
        log.info("prefix cache written to disk in %.1fs", PERSIST_SECONDS - (deadline - time.monotonic()))

    def turn(self) -> None:
        """One pass of the loop without its sleep (bench/lab/host/first_token.py drives the engine's host work with
        it)."""
        self._ingest()
        self._admit_compiled()
        completed = []
        for plan, completion in self.executor.poll():
            self._expected_ends.popleft()
            completed.append((plan, completion, self._advance_grammars(self.scheduler.complete(completion, plan))))
        # A late step's masks before the tokens go out: its sampling waits for them on the GPU, the frontends can wait.
        failed: list[Finished] = []
        if self._late is not None and len(self._expected_ends) == 1:  # the steps before it have completed
            masks, failed = self._masks(self._late, self._matchers())
            self.executor.give_masks(masks)
            self._late = None
        for step in completed:
            self.publish_step(*step)
        if failed:
            self._publish(StepResult(failed))
        if self.scheduler.prefix.persists:  # (a disk tier's work ends after its steps)
            for done in self.executor.disk_done():
                self.scheduler.disk_done(done)
        while self.executor.can_submit():
            self._defer_until = self._deferral()
            if self._defer_until or (plan := self.scheduler.plan()) is None:
                break
            self.count_start(plan)
            self.scheduler.commit(plan, self.executor.next_fence())
            self.executor.submit(self._with_masks(plan))
            self._expect_end(plan)
        self._heartbeat()
        self.telemetry.maybe_publish(self.scheduler)

    def _sleep_ms(self) -> int:
        wake = min(self._last_heartbeat + HEARTBEAT_INTERVAL, self.telemetry.next_publish)
        if self._defer_until:
            wake = min(wake, self._defer_until)
        return max(int((wake - time.monotonic()) * 1000), 1)

    def _deferral(self) -> float:
        """0.0 to plan a step now, else when to (monotonic seconds). The first step in flight, always; a second one,
        when a prompt waits for it, when every slot is taken (no prompt could join it), or SUBMIT_LEAD before the
        first is expected to end: planned earlier, a prompt that arrives in the meantime would wait for the step
        after it (the queue time of the 8b-sharegpt serving row, docs/gpu.md). A step that ends before its expected
        end leaves the GPU idle for the host's planning, so a full server does not defer."""
        scheduler = self.scheduler
        if not self._expected_ends or scheduler.waiting or scheduler.prefilling or None not in scheduler.slots:
            return 0.0
        due = self._expected_ends[-1] - SUBMIT_LEAD
        return due if self._expected_ends[-1] and due > time.monotonic() else 0.0

    def _expect_end(self, plan: Plan) -> None:
        """A submitted step's expected end: its shape's cost after the steps before it (or from now)."""
        cost = self.scheduler.costs.estimate(plan.shape)
        now = time.monotonic()
        last = self._expected_ends[-1] if self._expected_ends else 0.0
        self._expected_ends.append(max(now, last) + cost if cost > 0 and (last > 0 or not self._expected_ends)
                                   else 0.0)

    def publish_step(self, plan: Plan, completion: Completion, result: StepResult) -> None:
        """A completed step's telemetry, and its tokens and finishes (its grammars advanced) to their frontends."""
        if completion.error is None:
            self.telemetry.observe_step(plan, completion.duration)
        self._publish(result)

    def count_start(self, plan: Plan) -> None:
        """Counters of a step about to be submitted: prompt tokens, and the queue time of requests it starts."""
        if plan.kind == "decode":
            return  # no prompt tokens, and a request's first step is a prompt step
        now, slots = time.monotonic(), self.scheduler.slots
        for row in plan.rows:
            request = slots[row.slot]
            if row.tokens is not None:
                self.counters["prompt_tokens"] += max(min(row.start + row.length, row.prompt_len) - row.start, 0)
            if request is not None and not request.started:
                request.started = True
                self.telemetry.observe_queue_time(now - request.arrival)

    def stop(self) -> None:
        """Abort what is left and leave the loop once steps in flight have completed."""
        self._end_all("abort")

    def fail(self, error: str) -> None:
        """The executor cannot go on (a tensor-parallel rank is gone, the device failed): every request ends with
        this error, and the frontends get a moment to read it (submits meanwhile are refused) before the caller
        closes the socket: messages sent just before a close were seen lost."""
        self._end_all("error", error)
        deadline = time.monotonic() + FAREWELL
        while (left := deadline - time.monotonic()) > 0:
            self._ingest()
            self.socket.poll(max(int(left * 1000), 1))

    def _end_all(self, reason: str, error: str | None = None) -> None:
        self.draining = True
        self.stopping = True
        for request in [r for r in self.scheduler.slots if r is not None] + list(self.scheduler.waiting):
            self._publish(StepResult([replace(self.scheduler.cancel(request, reason), error=error)]))
        for request_id, (identity, _) in list(self._compiling.items()):
            self._send(identity, wire.Rejected(request_id, 503, "the engine is shutting down"))
        self._compiling.clear()

    # --- intake -------------------------------------------------------------------------------------------------
    def _ingest(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]  # the ROUTER's prefix: a frontend's DEALER sends one frame after it
            if len(frames) != 2:
                self.drops.drop(identity, f"{len(frames) - 1} frames where a message has one")
                continue
            try:
                message = wire.decode_frontend_message(frames[1])
            except Exception as exc:  # a broken or hostile peer must not stop the engine
                self.drops.drop(identity, f"undecodable: {exc}")
                continue
            self._frontends[identity] = time.monotonic()
            if isinstance(message, wire.Submit):
                self._admit(identity, message)
            elif isinstance(message, wire.Abort):
                self._abort(identity, message.request_ids)
            elif isinstance(message, wire.Hello):
                self._send(identity, wire.Welcome(self.engine_id, self.card, self.scheduler.max_active,
                                                  self.scheduler.queue_capacity, HEARTBEAT_INTERVAL,
                                                  self.telemetry_address, self.scheduler.prefix.identity,
                                                  self.scheduler.page_size))
            elif isinstance(message, wire.Goodbye):
                self._abort(identity, list(self._owned.pop(identity, ())))
                self._frontends.pop(identity, None)

    def _admit(self, identity: bytes, submit: wire.Submit) -> None:
        rejection = self._validate(submit)
        if rejection is not None:
            self._send(identity, rejection)
            self.counters["rejections"] += 1
            return
        if submit.constraint is not None:  # admitted once its grammar has compiled, off the loop
            self._compiling[submit.request_id] = (identity, submit)
            self._owned[identity].add(submit.request_id)
            self.grammars.submit(submit.request_id, GrammarSpec(submit.constraint.kind, submit.constraint.text))
            return
        self._start(identity, submit, None)

    def _start(self, identity: bytes, submit: wire.Submit, grammar: object | None) -> None:
        params = submit.sampling
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                      else frozenset(self.card.eos_token_ids))
        request = Request(
            request_id=submit.request_id, owner=identity, prompt_len=len(submit.prompt),
            tokens=submit.prompt, sampling=params,  # the Submit was decoded for this request alone: no copy
            seed=params.seed if params.seed is not None else self._seed.getrandbits(63),
            stop_ids=stop_ids, max_outputs=0 if submit.label_queries or submit.pooling else
            min(params.max_tokens, self.card.context_limit - len(submit.prompt)),
            arrival=time.monotonic(), message_ends=list(submit.message_ends),
            label_queries=[(q.position, tuple(q.token_ids)) for q in submit.label_queries],
            grammar=grammar, images=tuple(submit.images), cache_salt=submit.cache_salt, pooling=submit.pooling,
            image_spans=tuple((i.offset, i.offset + self.vision.tokens(i.grid),
                               mrope_delta([(i.offset, i.grid)], self.vision.merge_size)) for i in submit.images))
        request.last_commit = request.arrival
        self.scheduler.add(request)
        self._owned[identity].add(request.request_id)
        self.counters["admissions"] += 1

    def _validate(self, submit: wire.Submit) -> wire.Rejected | None:
        def reject(status: int, message: str, hint: str = "") -> wire.Rejected:
            return wire.Rejected(submit.request_id, status, message, hint)

        if self.draining:
            return reject(503, "the engine is draining and admits no new requests")
        if not self.scheduler.can_admit(len(self._compiling)):  # (a burst of constrained requests compiles first)
            return reject(503, f"the engine's queue is full ({self.scheduler.queue_capacity} waiting)",
                          "capacity_hint: raise capacities.queue_capacity or max_active in the core manifest")
        if (problem := submit_problem(submit, self.bounds)) is not None:
            return reject(problem.status, problem.message, problem.hint)
        if self.scheduler.get(submit.request_id) is not None or submit.request_id in self._compiling:
            return reject(400, f"request id {submit.request_id!r} is already in use")
        if submit.constraint is not None and self.grammars is None:
            return reject(400, "structured output is not available: this engine has no grammar engine")
        return None

    # --- structured output (engine/sampling/grammar.py) --------------------------------------------------------
    def _admit_compiled(self) -> None:
        if self.grammars is None:
            return
        for request_id, future in self.grammars.take_done():
            identity, submit = self._compiling.pop(request_id, (None, None))
            if submit is None:
                continue  # aborted while compiling
            error = future.exception()
            if error is not None:
                self._owned[identity].discard(request_id)
                self.counters["rejections"] += 1
                self._send(identity, wire.Rejected(request_id, 400, f"the output grammar does not compile: {error}"))
            elif self.draining:
                self._owned[identity].discard(request_id)
                self._send(identity, wire.Rejected(request_id, 503, "the engine is draining and admits no new "
                                                                    "requests"))
            else:
                self._owned[identity].discard(request_id)
                self._start(identity, submit, future.result())

    def _with_masks(self, plan: Plan) -> Plan:
        """The committed plan with its rows' grammar masks; with a step in flight, the masks come once it has
        completed (Plan.masks_later), where the executor can take them late: its tokens advance the matchers
        first, while this step's forward runs."""
        if not self.scheduler.constrained or not constrained_rows(plan, matchers := self._matchers()):
            return plan
        if self._expected_ends and self.executor.late_masks:
            self._late = plan
            return replace(plan, masks_later=True)
        masks, failed = self._masks(plan, matchers)
        if failed:
            self._publish(StepResult(failed))
        return replace(plan, masks=masks)

    def _matchers(self) -> dict[int, object]:
        """Each live constrained request's matcher, by slot."""
        return {r.slot: r.grammar for r in self.scheduler.slots if r is not None and r.grammar is not None}

    def _masks(self, plan: Plan, matchers: dict[int, object]) -> tuple[bytes, list[Finished]]:
        """The plan's grammar masks from its requests' matchers (`_matchers`) as they are now, and the ends of the
        requests whose matcher failed to compute one (the caller publishes them); the step's token for such a
        request is then discarded as for any request that ended."""
        masks = plan_masks(plan, matchers, mask_words(self.bounds.vocab_size), self.grammars.executor)
        failed = [self._grammar_failed(self.scheduler.slots[slot]) for slot, matcher in matchers.items()
                  if matcher.is_error()]
        return masks, failed

    def _grammar_failed(self, request: Request) -> Finished:
        error = request.grammar.get_error()
        return replace(self.scheduler.cancel(request, "error"), error=f"the output grammar reached a dead end: {error}")

    def _advance_grammars(self, result: StepResult) -> StepResult:
        """Every committed token advances its request's matcher. A grammar that is complete ends its request
        ("stop"); a token the matcher refuses (only possible if the mask was overridden, e.g. min_tokens banning
        the end of sequence a complete grammar needs) ends it with an error, never a hang. A request that ended
        has nothing to gain from its matcher, so without live constrained requests there is nothing to do."""
        if not self.scheduler.constrained:
            return result
        for request, token in zip(result.requests, result.token_ids):
            if request.grammar is None or token in request.stop_ids and request.finish_reason == "stop":
                continue
            matcher = request.grammar
            if not matcher.consume_token(token):
                if request.finish_reason is None:
                    result.finished.append(self._grammar_failed(request))
            elif matcher.is_stopped() and request.finish_reason is None:
                result.finished.append(self.scheduler.cancel(request, "stop"))
        return result

    def _abort(self, identity: bytes, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._compiling.get(request_id, (None,))[0] == identity:
                del self._compiling[request_id]
                self._owned[identity].discard(request_id)
                continue
            request = self.scheduler.get(request_id)
            if request is not None and request.owner == identity:
                self._publish(StepResult([self.scheduler.cancel(request)]))

    # --- output -------------------------------------------------------------------------------------------------
    def _publish(self, result: StepResult) -> None:
        # Passes over the step's columns; a column nobody has anything for this step (no finishes, no logprobs) is
        # filled without a call per request: at 256 live requests these loops are the engine's per-step host cost.
        now = time.monotonic()
        requests, news = news_of(result)
        for request in requests:
            request.last_publish = now
            request.bursts += 1
        logprobs: dict[Request, list[wire.Logprobs]] = {}
        if result.logprobs.count(None) != len(result.logprobs):
            for request, lp in zip(result.requests, result.logprobs):
                if lp is not None:
                    logprobs.setdefault(request, []).append(lp)
        finished: dict[Request, Finished] = {f.request: f for f in result.finished}
        if finished:
            told = set(requests)
            ended = [r for r in finished if r not in told]
            requests, news = requests + ended, news + [[] for _ in ended]
        self.counters["output_tokens"] += len(result.token_ids)
        if self._columns.requests != requests:  # (list equality: identity per element, at C speed)
            self._columns = RequestColumns.of(requests)
        columns = self._columns
        if columns.owner is not None:
            groups = {columns.owner: (columns, news)}
        else:
            groups = defaultdict(lambda: ([], []))
            for request, tokens in zip(requests, news):
                group = groups[request.owner]
                group[0].append(request)
                group[1].append(tokens)
            groups = {owner: (RequestColumns.of(group), tokens) for owner, (group, tokens) in groups.items()}
        for owner, (columns, token_ids) in groups.items():
            requests = columns.requests
            nothing = [None] * len(requests)
            ends = [finished.get(r) for r in requests] if finished else nothing
            labels = [label_logits(r, end) for r, end in zip(requests, ends)] if finished else []
            embeddings = [embedding(r, end) for r, end in zip(requests, ends)] if finished else []
            self._send(owner, wire.Outputs(
                request_ids=columns.request_ids, token_ids=token_ids,
                finish_reasons=[f.reason if f else None for f in ends] if finished else nothing,
                errors=[f.error if f else None for f in ends] if finished else nothing,
                prompt_tokens=columns.prompt_tokens, cached_tokens=columns.cached_tokens,
                logprobs=[join_logprobs(logprobs.get(r, [])) for r in requests] if logprobs else nothing,
                prompt_logprobs=[join_logprobs(take(r.prompt_logprobs)) if tokens and r.prompt_logprobs else None
                                 for r, tokens in zip(requests, token_ids)] if columns.prompt_logprobs else nothing,
                label_logits=labels if any(labels) else [], embeddings=embeddings if any(embeddings) else []))
        for request, end in finished.items():
            self._owned[request.owner].discard(request.request_id)
            self.counters[FINISH_COUNTERS[end.reason]] += 1

    def _send(self, identity: bytes, message: wire.EngineMessage) -> None:
        try:
            self.socket.send_multipart([identity, wire.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # an unroutable or full peer loses this message, not the engine
            self.unsent.drop(identity, f"could not send: {exc}")

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat < HEARTBEAT_INTERVAL:
            return
        self._last_heartbeat = now
        for identity, seen in list(self._frontends.items()):
            if now - seen > FRONTEND_TIMEOUT:
                log.warning("frontend %r went silent; aborting its %d requests", identity,
                            len(self._owned.get(identity, ())))
                self._abort(identity, list(self._owned.pop(identity, ())))
                del self._frontends[identity]
            else:
                self._send(identity, wire.Heartbeat(self.engine_id, self.draining))
