"""Structured output through the real engine loop over an emulated GPU: how much of the GPU's time the loop keeps
busy when every request is constrained, with the masks given late (the forward runs while the host advances the
matchers and computes the next masks) or with the step, against free text (docs/gpu.md, Two steps in flight).

    python -m bench.lab.host.constrained_loop --core DIR [--requests 128] [--concurrency 64] [--max-tokens 128]
        [--forward-ms 5.5] [--sample-ms 0.2] [--prefill-us 20]

The executor emulates one GPU stream: a step's forward starts once the step before it has sampled (or at its
submit, if later) and takes `--forward-ms` plus `--prefill-us` a prompt token; its sampling starts once the forward
is done and the masks are given, and takes `--sample-ms`; the step completes then, each constrained row drawing a
random token its mask allows (free rows the token of " {"). The defaults are the 8B's c64 steps on the H200. The
grammars are llguidance's on the core's tokenizer, the schema of the 8b-c64-json serving row; the client is another
process on an ipc socket, keeping `--concurrency` requests of 64 prompt tokens in flight. Prints per variant the
output tokens a second, the emulated GPU's busy share from the first step to the last, and how long forwards waited
for their masks (mean ms a step).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import zmq
from tokenizers import Tokenizer

from bench.lab.gpu.serving import JSON64
from common import protocol as wire
from common.manifest import load_manifest
from engine.core import Engine
from engine.sampling.grammar import GrammarCompiler, mask_words
from engine.scheduler.plan import GENERATION, SAMPLE, SLOT, TOKENS, Completion, Plan, fields
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry
from frontend.chat.structured import json_schema_text

MAX_IN_FLIGHT = 2
MAX_ACTIVE = 256  # as the serving rows run (--max-active 256)
STEP_TOKENS = 8192  # the step budget on an H200
PROMPT = 64


class EmulatedGpu:
    """The executor protocol over one emulated stream (see the module's docstring); `late_masks` as the graph
    executor's, or off."""

    def __init__(self, late_masks: bool, forward: float, sample: float, per_token: float, vocab: int,
                 token: int) -> None:
        self.late_masks = late_masks
        self.num_pages = 1 << 14
        self.fault: str | None = None
        self._forward, self._sample, self._per_token = forward, sample, per_token
        self._words, self._token = mask_words(vocab), token
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._fence = self._in_flight = 0
        self._late = 0  # the fence submitted with its masks to come
        self._masks: dict[int, tuple[bytes, float]] = {}  # fence -> (masks, when given)
        self._given = threading.Condition()
        self._steps: queue.SimpleQueue[tuple[int, Plan, float] | None] = queue.SimpleQueue()
        self._done: list[tuple[Plan, Completion]] = []
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(0)
        self.busy = self.waited = 0.0
        self.span: list[float] = []  # the first step's start, the last one's end
        self._thread = threading.Thread(target=self._run, name="emulated-gpu", daemon=True)
        self._thread.start()

    def can_submit(self) -> bool:
        return self._in_flight < MAX_IN_FLIGHT

    def next_fence(self) -> int:
        return self._fence + 1

    def submit(self, plan: Plan) -> None:
        self._fence += 1
        self._in_flight += 1
        now = time.perf_counter()
        if plan.masks_later:
            self._late = self._fence
        else:
            with self._given:
                self._masks[self._fence] = (plan.masks, now)
        self._steps.put((self._fence, plan, now))

    def give_masks(self, masks: bytes) -> None:
        with self._given:
            self._masks[self._late] = (masks, time.perf_counter())
            self._given.notify()

    def poll(self) -> list[tuple[Plan, Completion]]:
        try:
            os.read(self.wake_fd, 1 << 16)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        self._in_flight -= len(done)
        return done

    def disk_done(self) -> list:
        return []

    def close(self) -> None:
        self._steps.put(None)
        self._thread.join()

    def _run(self) -> None:
        free_at = 0.0
        while (item := self._steps.get()) is not None:
            fence, plan, submitted = item
            start = max(free_at, submitted)
            prompt_tokens = sum(len(tokens) for tokens in fields(plan.rows, TOKENS) if tokens)
            forward_end = start + self._forward + self._per_token * prompt_tokens
            sleep_until(forward_end)
            with self._given:
                while fence not in self._masks:
                    self._given.wait()
                masks, given = self._masks.pop(fence)
            # The stream's own times: this thread's wake-ups are late (a CPU, the GIL), a GPU's would not be.
            sampling = max(forward_end, given)
            end = sampling + self._sample
            sleep_until(end)
            free_at = end
            self.busy += end - start - (sampling - forward_end)
            self.waited += sampling - forward_end
            self.span = [self.span[0] if self.span else start, end]
            with self._lock:
                self._done.append((plan, self._completion(fence, plan, masks, end - start)))
            os.write(self._wake_write, b"x")

    def _completion(self, fence: int, plan: Plan, masks: bytes, duration: float) -> Completion:
        rows = plan.rows
        sample = np.fromiter(fields(rows, SAMPLE), bool, len(rows))
        tokens = np.full(len(rows), self._token)
        if masks:  # a random allowed word of each row, then a random allowed bit of it: numpy over every row at once
            words = np.frombuffer(masks, np.int32).reshape(len(rows), self._words)
            word = np.argmax(self._rng.random(words.shape) * (words != 0), axis=1)
            bits = (words[np.arange(len(rows)), word].view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
            drawn = word * 32 + np.argmax(self._rng.random(bits.shape) * bits, axis=1)
            tokens = np.where((words == -1).all(axis=1), tokens, drawn)
        slots = [s for s, sampled in zip(fields(rows, SLOT), sample) if sampled]
        generations = [g for g, sampled in zip(fields(rows, GENERATION), sample) if sampled]
        return Completion(fence, tuple(slots), tuple(generations), tuple(tokens[sample].tolist()), duration)


def sleep_until(moment: float) -> None:
    if (left := moment - time.perf_counter()) > 0:
        time.sleep(left)


def client(address: str, requests: int, concurrency: int, max_tokens: int, constraint: wire.Constraint | None,
           results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Keeps `concurrency` requests in flight until `requests` ended; puts (output tokens, seconds)."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(address)
    rng = np.random.default_rng(1)
    sent = ended = tokens = 0

    def send() -> None:
        nonlocal sent
        prompt = rng.integers(100, 20000, PROMPT).tolist()
        params = wire.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=sent)
        socket.send(wire.encode(wire.Submit(f"r{sent}", prompt, params, constraint=constraint)))
        sent += 1

    started = time.perf_counter()
    for _ in range(min(concurrency, requests)):
        send()
    while ended < requests:
        message = wire.decode_engine_message(socket.recv())
        if not isinstance(message, wire.Outputs):
            continue
        tokens += sum(map(len, message.token_ids))
        for reason, error in zip(message.finish_reasons, message.errors):
            if reason is not None:
                ended += 1
                if error:
                    print(f"a request failed: {error}", flush=True)
                if sent < requests:
                    send()
    results.put((tokens, time.perf_counter() - started))
    socket.close(linger=0)
    context.term()


def run(core: Path, late_masks: bool, constrained: bool, args: argparse.Namespace) -> dict[str, float]:
    manifest = load_manifest(core, verify=False)
    vocab = int(manifest.config["vocab_size"])
    tokenizer = (core / "tokenizer.json").read_text()
    token = Tokenizer.from_str(tokenizer).encode(" {", add_special_tokens=False).ids[0]
    card = wire.ModelCard(manifest.served_names, manifest.checkpoint, manifest.architecture, manifest.context_limit,
                          manifest.eos_token_ids, manifest.created)
    executor = EmulatedGpu(late_masks, args.forward_ms / 1000, args.sample_ms / 1000, args.prefill_us / 1e6, vocab,
                           token)
    scheduler = RequestScheduler(MAX_ACTIVE, 4 * MAX_ACTIVE, executor.num_pages, manifest.capacities.page_size,
                                 STEP_TOKENS, bytes(32), late_masks=late_masks)
    context = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/engine.sock"
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.bind(address)
    telemetry_socket = context.socket(zmq.XPUB)
    telemetry_address = wire.telemetry_address(address)
    telemetry_socket.bind(telemetry_address)
    grammars = GrammarCompiler(tokenizer, vocab, manifest.eos_token_ids)
    engine = Engine(card, executor, scheduler, vocab, socket,
                    EngineTelemetry(telemetry_socket, f"constrained-{uuid.uuid4().hex[:8]}"), telemetry_address,
                    grammars)
    schema = json.loads(JSON64)["response_format"]["json_schema"]["schema"]
    constraint = wire.Constraint("json_schema", json_schema_text(schema, "response_format")) if constrained else None
    spawn = multiprocessing.get_context("spawn")  # (a fork would copy the engine's threads' state)
    results = spawn.Queue()
    process = spawn.Process(
        target=client, args=(address, args.requests, args.concurrency, args.max_tokens, constraint, results))
    process.start()
    loop = threading.Thread(target=engine.run, name="engine-loop")
    loop.start()
    tokens, seconds = results.get()
    process.join()
    engine.stop()
    loop.join()
    executor.close()
    grammars.close()
    socket.close(linger=0)
    telemetry_socket.close(linger=0)
    context.term()
    steps = executor.busy and (executor.span[1] - executor.span[0])
    return {"tok/s": tokens / seconds, "busy": executor.busy / steps if steps else 0.0,
            "waited": 1000 * executor.waited / max(engine.executor._fence, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.constrained_loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--forward-ms", type=float, default=5.5)
    parser.add_argument("--sample-ms", type=float, default=0.2)
    parser.add_argument("--prefill-us", type=float, default=20.0)
    args = parser.parse_args(argv)
    print("| variant | output tok/s | GPU busy | forward's wait for masks, ms a step |")
    print("| --- | ---: | ---: | ---: |")
    for name, late, constrained in (("free text", True, False), ("constrained, masks with the step", False, True),
                                    ("constrained, late masks", True, True)):
        result = run(args.core, late, constrained, args)
        print(f"| {name} | {result['tok/s']:,.0f} | {100 * result['busy']:.1f}% | {result['waited']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
