"""The engine loop's timing of its second step in flight (engine/core.py `_deferral`): the real Engine on inproc
sockets, with an executor whose steps complete only when the test releases them."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import zmq

from common import protocol as wire
from engine.core import Engine
from engine.sampling.grammar import GrammarCompiler
from engine.scheduler.plan import Completion, Plan
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry

STEP_SECONDS = 1.0  # what every released step reports: far longer than the loop's lead


def token_completion(fence: int, plan: Plan, token: int, duration: float) -> Completion:
    """A step's completion that gives `token` to each of its sampled rows."""
    sampled = [row for row in plan.rows if row.sample]
    return Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                      (token,) * len(sampled), duration)


class HeldExecutor:
    """Two steps in flight at most, each completed (`token`, STEP_SECONDS) only by release(); with `late_masks`, it
    keeps the masks given late."""

    def __init__(self, token: int = 1, late_masks: bool = False) -> None:
        self.wake_fd = -1
        self.token = token
        self.late_masks = late_masks
        self.given: list[bytes] = []
        self._fence = 0
        self.in_flight: list[Plan] = []
        self._done: list[tuple[Plan, Completion]] = []

    def can_submit(self) -> bool:
        return len(self.in_flight) < 2

    def next_fence(self) -> int:
        return self._fence + 1

    def submit(self, plan: Plan) -> None:
        self._fence += 1
        self.in_flight.append(plan)

    def give_masks(self, masks: bytes) -> None:
        self.given.append(masks)

    def release(self, steps: int = 2) -> None:
        """Complete the first `steps` in flight."""
        first = self._fence - len(self.in_flight) + 1
        self._done += [(plan, token_completion(first + i, plan, self.token, STEP_SECONDS)) for i, plan in
                       enumerate(self.in_flight[:steps])]
        self.in_flight = self.in_flight[steps:]

    def poll(self) -> list[tuple[Plan, Completion]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        pass


def make_engine(max_active: int = 8, executor: HeldExecutor | None = None, vocab: int = 1000,
                grammars: GrammarCompiler | None = None, queue: int = 64) -> tuple[Engine, HeldExecutor, zmq.Socket]:
    context = zmq.Context.instance()
    address = f"inproc://engine-loop-{uuid.uuid4().hex[:8]}"
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    telemetry = context.socket(zmq.XPUB)
    telemetry.bind(address + "-telemetry")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"test")
    dealer.connect(address)
    executor = executor or HeldExecutor()
    card = wire.ModelCard(["test"], "test", "llama", 4096, [0])
    scheduler = RequestScheduler(max_active, queue, 64, 16, 512, bytes(range(32)), late_masks=executor.late_masks)
    engine = Engine(card, executor, scheduler, vocab, router, EngineTelemetry(telemetry, "engine-loop"),
                    address + "-telemetry", grammars)
    return engine, executor, dealer


def submit(engine: Engine, dealer: zmq.Socket, prompt: list[int], constraint: wire.Constraint | None = None,
           max_tokens: int = 50) -> str:
    request_id = uuid.uuid4().hex
    dealer.send(wire.encode(wire.Submit(request_id, prompt, wire.SamplingParams(max_tokens=max_tokens),
                                        constraint=constraint)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # inproc delivery (and a grammar's compile) is asynchronous: turn until admitted
        engine.turn()
        if any(r is not None and r.request_id == request_id for r in engine.scheduler.slots):
            return request_id
        time.sleep(0.001)
    raise AssertionError("the engine never admitted the request")


def test_a_second_decode_step_waits_for_the_first_to_near_its_end_unless_a_prompt_arrives() -> None:
    engine, executor, dealer = make_engine()
    first = submit(engine, dealer, [5, 6, 7, 8])
    # Nothing measured yet: steps of unknown cost go two deep at once, as before.
    engine.turn()
    assert len(executor.in_flight) == 2
    executor.release()  # both shapes (the prompt's, a decode of one row) now cost STEP_SECONDS
    engine.turn()
    engine.turn()
    assert len(executor.in_flight) == 1 and executor.in_flight[0].kind == "decode"  # the second is deferred
    assert engine._sleep_ms() < 1000 * STEP_SECONDS  # ... and the loop wakes for it before the first ends

    second = submit(engine, dealer, [9, 10, 11])  # a prompt that arrives meanwhile joins the very next step
    assert len(executor.in_flight) == 2
    slots = {r.slot for r in executor.in_flight[1].rows}
    requests = {r.request_id: r for r in engine.scheduler.slots if r is not None}
    assert requests[second].slot in slots and requests[first].slot in slots


def test_a_full_server_does_not_defer_its_second_step() -> None:
    """No prompt could join the next step, so waiting for one would only risk an idle GPU."""
    engine, executor, dealer = make_engine(max_active=1)
    submit(engine, dealer, [5, 6, 7, 8])
    engine.turn()
    executor.release()  # costs known, as above
    engine.turn()
    engine.turn()
    assert len(executor.in_flight) == 2


def test_a_late_step_gets_its_masks_before_the_step_before_it_publishes_its_tokens(core_dir) -> None:
    """The late step's sampling waits on the GPU for its masks; the frontends can wait for the tokens of the step
    that completed, so the masks go first."""
    manifest = json.loads((core_dir / "manifest.json").read_text())
    vocab = manifest["config"]["vocab_size"]
    grammars = GrammarCompiler((core_dir / "tokenizer.json").read_text(), vocab, manifest["eos_token_ids"])
    token = grammars.tokenizer.tokenize_str("a")[0]
    executor = HeldExecutor(token, late_masks=True)
    engine, _, dealer = make_engine(executor=executor, vocab=vocab, grammars=grammars)
    published_before: list[bool] = []  # per masks given: had the frontend any message then
    give = executor.give_masks
    executor.give_masks = lambda masks: (published_before.append(bool(dealer.poll(0))), give(masks))
    submit(engine, dealer, [9, 10, 11, 12], wire.Constraint("regex", "a{1,200}"))
    for _ in range(3):
        assert len(executor.in_flight) == 2 and executor.in_flight[1].masks_later
        while dealer.poll(0):
            dealer.recv()
        executor.release(1)
        engine.turn()
        outputs = wire.decode_engine_message(dealer.recv())  # (the step's token, published after the masks)
        assert isinstance(outputs, wire.Outputs) and outputs.token_ids == [[token]]
    assert published_before == [False] * 3 and len(executor.given) == 3
    allowed = np.flatnonzero(np.unpackbits(np.frombuffer(executor.given[-1], np.uint8), bitorder="little"))
    assert token in allowed and len(allowed) < vocab
    grammars.close()


def test_requests_whose_grammars_compile_count_against_the_queue(core_dir) -> None:
    """Admission counts the requests whose grammars compile off the loop beside those waiting for a slot: a burst of
    constrained requests in one turn's intake cannot pass the queue's bound before any has compiled."""
    manifest = json.loads((core_dir / "manifest.json").read_text())
    vocab = manifest["config"]["vocab_size"]
    grammars = GrammarCompiler((core_dir / "tokenizer.json").read_text(), vocab, manifest["eos_token_ids"])
    engine, _, dealer = make_engine(vocab=vocab, grammars=grammars, queue=2)
    submit(engine, dealer, [5, 6, 7, 8])  # in a slot now; the router knows this dealer
    burst = [wire.Submit(uuid.uuid4().hex, [9, 10, 11], wire.SamplingParams(max_tokens=5),
                         constraint=wire.Constraint("regex", "a{1,20}")) for _ in range(3)]
    for message in burst:
        engine._admit(b"test", message)
    rejected = []
    while dealer.poll(1000):
        if isinstance(message := wire.decode_engine_message(dealer.recv()), wire.Rejected):
            rejected.append(message)
    assert [(r.request_id, r.status) for r in rejected] == [(burst[2].request_id, 503)]
    assert "queue is full" in rejected[0].message
    grammars.close()

