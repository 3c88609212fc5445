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
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq
from tokenizers import Tokenizer

from bench.lab.gpu.serving import JSON64
from bench.lab.host.loop_engine import NUM_PAGES, TimedExecutor, engine_on
from common import protocol as wire
from common.manifest import load_manifest
from engine.core import Engine
from engine.sampling.grammar import GrammarCompiler, mask_words
from engine.scheduler.plan import GENERATION, SAMPLE, SLOT, TOKENS, Completion, Plan, fields
from engine.scheduler.scheduler import RequestScheduler
from frontend.chat.structured import json_schema_text

MAX_ACTIVE = 256  # as the serving rows run (--max-active 256)
STEP_TOKENS = 8192  # the step budget on an H200
PROMPT = 64


class EmulatedGpu(TimedExecutor):
    """The executor protocol over one emulated stream (see the module's docstring); `late_masks` as the graph
    executor's, or off."""

    def __init__(self, late_masks: bool, forward: float, sample: float, per_token: float, vocab: int,
                 token: int) -> None:
        self._forward, self._sample, self._per_token = forward, sample, per_token
        self._words = mask_words(vocab)
        self._late = 0  # the fence submitted with its masks to come
        self._masks: dict[int, tuple[bytes, float]] = {}  # fence -> (masks, when given)
        self._submitted_at: dict[int, float] = {}
        self._given = threading.Condition()
        self._rng = np.random.default_rng(0)
        self.busy = self.waited = 0.0
        self.span: list[float] = []  # the first step's start, the last one's end
        super().__init__(NUM_PAGES, token, 0.0)
        self.late_masks = late_masks

    def submit(self, plan: Plan) -> None:
        fence, now = self._fence + 1, time.perf_counter()
        with self._given:
            if plan.masks_later:
                self._late = fence
            else:
                self._masks[fence] = (plan.masks, now)
        self._submitted_at[fence] = now
        super().submit(plan)

    def give_masks(self, masks: bytes) -> None:
        with self._given:
            self._masks[self._late] = (masks, time.perf_counter())
            self._given.notify()

    def _watch(self) -> None:
        free_at = 0.0
        while (item := self._submitted.get()) is not None:
            plan, fence = item
            start = max(free_at, self._submitted_at.pop(fence))
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
        tokens = np.full(len(rows), self.token)
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
           results: multiprocessing.Queue, prompt_len: int = PROMPT) -> None:  # type: ignore[type-arg]
    """Keeps `concurrency` requests of `prompt_len` random tokens in flight until `requests` ended; puts (output
    tokens, seconds)."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(address)
    rng = np.random.default_rng(1)
    sent = ended = tokens = 0

    def send() -> None:
        nonlocal sent
        prompt = rng.integers(100, 20000, prompt_len).tolist()
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


def json_constraint() -> wire.Constraint:
    """The 8b-c64-json serving row's schema, as a frontend puts it on the wire."""
    schema = json.loads(JSON64)["response_format"]["json_schema"]["schema"]
    return wire.Constraint("json_schema", json_schema_text(schema, "response_format"))


def served(engine: Engine, address: str, requests: int, concurrency: int, max_tokens: int,
           constraint: wire.Constraint | None, prompt_len: int) -> tuple[int, float]:
    """The engine's loop on a thread of its own while `client` runs in a process of its own (a fork would copy the
    engine's threads' state); (output tokens, seconds) once every request ended and the loop stopped."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    process = spawn.Process(target=client,
                            args=(address, requests, concurrency, max_tokens, constraint, results, prompt_len))
    process.start()
    loop = threading.Thread(target=engine.run, name="engine-loop")
    loop.start()
    tokens, seconds = results.get()
    process.join()
    engine.stop()
    loop.join()
    return tokens, seconds


def run(core: Path, late_masks: bool, constrained: bool, args: argparse.Namespace) -> dict[str, float]:
    manifest = load_manifest(core, verify=False)
    vocab = int(manifest.config["vocab_size"])
    tokenizer = (core / "tokenizer.json").read_text()
    token = Tokenizer.from_str(tokenizer).encode(" {", add_special_tokens=False).ids[0]
    executor = EmulatedGpu(late_masks, args.forward_ms / 1000, args.sample_ms / 1000, args.prefill_us / 1e6, vocab,
                           token)
    scheduler = RequestScheduler(MAX_ACTIVE, 4 * MAX_ACTIVE, NUM_PAGES, manifest.capacities.page_size, STEP_TOKENS,
                                 bytes(32), late_masks=late_masks)
    grammars = GrammarCompiler(tokenizer, vocab, manifest.eos_token_ids)
    context, address = zmq.Context(), f"ipc://{tempfile.mkdtemp()}/engine.sock"
    engine = engine_on(core, address, context, executor, scheduler, grammars)
    tokens, seconds = served(engine, address, args.requests, args.concurrency, args.max_tokens,
                             json_constraint() if constrained else None, PROMPT)
    executor.close()
    grammars.close()
    context.destroy(linger=0)
    steps = executor.span[1] - executor.span[0] if executor.span else 0.0
    return {"tok/s": tokens / seconds, "busy": executor.busy / steps if steps else 0.0,
            "waited": 1000 * executor.waited / max(executor.next_fence() - 1, 1)}


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
