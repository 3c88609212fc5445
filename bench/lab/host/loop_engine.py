"""The engine's own loop (engine/core.py: ingest, admission, scheduling, publication) with an executor whose steps
take a fixed time and no device, so a benchmark times the host's whole path to the first token.

    python -m bench.lab.host.loop_engine --core DIR --listen ADDR [--step-ms 0]

The executor completes steps in submission order, each `--step-ms` after the previous one ended (one stream, as on a
GPU), from a watcher thread that wakes the loop through a pipe, as GraphExecutor's watcher does. Every sampled row
gets the token of " Hello". Beside bench/lab/host/null_engine.py, which answers each Submit at once and runs none of this.
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
import uuid
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from common import protocol as wire
from common.manifest import load_manifest
from engine.core import Engine
from engine.executor.base import Executor
from engine.sampling.grammar import GrammarCompiler
from engine.scheduler.plan import Completion, Plan
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry

MAX_IN_FLIGHT = 2
NUM_PAGES = 1 << 14  # pages are only counted here: plenty of them


def token_completion(fence: int, plan: Plan, token: int, duration: float) -> Completion:
    """A step's completion that gives `token` to each of its sampled rows."""
    sampled = [row for row in plan.rows if row.sample]
    return Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                      (token,) * len(sampled), duration)


class TimedExecutor:
    """Steps that take `step_seconds` each, one after another, completed by a watcher thread."""

    def __init__(self, num_pages: int, token: int, step_seconds: float) -> None:
        self.num_pages = num_pages
        self.token = token
        self.step_seconds = step_seconds
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self.late_masks = False  # (no grammar runs here)
        self._fence = 0
        self._in_flight = 0
        self._submitted: queue.SimpleQueue[tuple[Plan, int] | None] = queue.SimpleQueue()
        self._done: list[tuple[Plan, Completion]] = []
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="timed-completions", daemon=True)
        self._watcher.start()

    def can_submit(self) -> bool:
        return self._in_flight < MAX_IN_FLIGHT

    def next_fence(self) -> int:
        return self._fence + 1

    def submit(self, plan: Plan) -> None:
        self._fence += 1
        self._in_flight += 1
        self._submitted.put((plan, self._fence))

    def poll(self) -> list[tuple[Plan, Completion]]:
        try:
            os.read(self.wake_fd, 1 << 16)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        self._in_flight -= len(done)
        return done

    def close(self) -> None:
        self._submitted.put(None)
        self._watcher.join()
        os.close(self.wake_fd)
        os.close(self._wake_write)

    def _watch(self) -> None:
        free_at = 0.0  # when the previous step ends: a step starts at its submission or then, whichever is later
        while (item := self._submitted.get()) is not None:
            plan, fence = item
            free_at = max(free_at, time.perf_counter()) + self.step_seconds
            if (wait := free_at - time.perf_counter()) > 0:
                time.sleep(wait)
            with self._lock:
                self._done.append((plan, token_completion(fence, plan, self.token, self.step_seconds)))
            os.write(self._wake_write, b"x")


def serve(core: Path, listen: str, step_seconds: float) -> None:
    manifest = load_manifest(core, verify=False)
    caps = manifest.capacities
    token = Tokenizer.from_file(str(core / "tokenizer.json")).encode(" Hello", add_special_tokens=False).ids[0]
    executor = TimedExecutor(NUM_PAGES, token, step_seconds)
    scheduler = RequestScheduler(caps.max_active, caps.queue_capacity, NUM_PAGES, caps.page_size,
                                 caps.prefill_chunk_size, bytes(32))
    engine_on(core, listen, zmq.Context(), executor, scheduler).run()


def engine_on(core: Path, listen: str, context: zmq.Context, executor: Executor, scheduler: RequestScheduler,
              grammars: GrammarCompiler | None = None) -> Engine:
    """The engine loop of `core`'s card over `executor` and `scheduler`, its ROUTER bound to `listen` and its
    telemetry beside it, sockets of `context`."""
    manifest = load_manifest(core, verify=False)
    card = wire.ModelCard(manifest.served_names, manifest.checkpoint, manifest.architecture, manifest.context_limit,
                          manifest.eos_token_ids, manifest.created)
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.bind(listen)
    telemetry_socket = context.socket(zmq.XPUB)
    telemetry_address = wire.telemetry_address(listen)
    telemetry_socket.bind(telemetry_address)
    return Engine(card, executor, scheduler, int(manifest.config["vocab_size"]), socket,
                  EngineTelemetry(telemetry_socket, f"loop-engine-{uuid.uuid4().hex[:8]}"), telemetry_address,
                  grammars)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.loop_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True, help="a core, for its tokenizer, card and capacities")
    parser.add_argument("--listen", required=True, help="ZMQ address to bind")
    parser.add_argument("--step-ms", type=float, default=0.0, help="how long each step takes")
    args = parser.parse_args(argv)
    serve(args.core, args.listen, args.step_ms / 1000)


if __name__ == "__main__":
    main()
