"""The engine loop's timing of its second step in flight (engine/core.py `_deferral`): the real Engine on inproc
sockets, with an executor whose steps complete only when the test releases them."""

from __future__ import annotations

import uuid

import zmq

from common import protocol as wire
from engine.core import Engine
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
    """Two steps in flight at most, each completed (token 1, STEP_SECONDS) only by release()."""

    def __init__(self) -> None:
        self.wake_fd = -1
        self.late_masks = False  # (no grammar runs here)
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

    def release(self) -> None:
        first = self._fence - len(self.in_flight) + 1
        self._done += [(plan, token_completion(first + i, plan, 1, STEP_SECONDS)) for i, plan in
                       enumerate(self.in_flight)]
        self.in_flight = []

    def poll(self) -> list[tuple[Plan, Completion]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        pass


def make_engine(max_active: int = 8) -> tuple[Engine, HeldExecutor, zmq.Socket]:
    context = zmq.Context.instance()
    address = f"inproc://engine-loop-{uuid.uuid4().hex[:8]}"
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    telemetry = context.socket(zmq.XPUB)
    telemetry.bind(address + "-telemetry")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"test")
    dealer.connect(address)
    executor = HeldExecutor()
    card = wire.ModelCard(["test"], "test", "llama", 4096, [0])
    scheduler = RequestScheduler(max_active, 64, 64, 16, 512, bytes(range(32)))
    engine = Engine(card, executor, scheduler, 1000, router, EngineTelemetry(telemetry, "engine-loop"),
                    address + "-telemetry")
    return engine, executor, dealer


def submit(engine: Engine, dealer: zmq.Socket, prompt: list[int]) -> str:
    request_id = uuid.uuid4().hex
    dealer.send(wire.encode(wire.Submit(request_id, prompt, wire.SamplingParams(max_tokens=50))))
    for _ in range(100):  # inproc delivery is asynchronous: turn until the engine has it
        engine.turn()
        if any(r is not None and r.request_id == request_id for r in engine.scheduler.slots):
            return request_id
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
