"""Host time from request to first token, for a prompt after a long cached prefix and for a short prompt alone
(64 new tokens after a cached 16,000-token prefix should cost little more than 64 tokens alone: docs/host.md).

    python -m bench.lab.host.first_token --core DIR [--prefix-len 16000] [--new-len 64] [--requests 40]
                              [--part engine,submit,frontend] [--engine null|loop] [--step-ms 0]
                              [--profile engine|frontend]

Every part runs on the CPU, no model, one request at a time:
- engine: the real Engine loop (Engine.turn) on inproc ZMQ sockets, with an executor that completes every step the
  moment it is submitted. Timed: from sending the encoded Submit to receiving the Outputs with the first token, i.e.
  decoding, validation, admission, prefix keys and lookup, planning, completion and publication. The long prompts'
  prefix was prefilled once before.
- frontend: bench/lab/host/null_engine.py and a `flare-frontend` process (on a copy of the core whose context limit holds the
  prompt), streamed /v1/completions requests with a text prompt, as `flare-bench --dataset shared-prefix` sends them.
  Timed: from sending the request (its JSON already encoded) to the first byte of the first server-sent event. The
  null engine's decoding of the Submit is inside this time. `--engine loop` puts bench/lab/host/loop_engine.py in its place:
  the real engine loop, whose executor's steps take `--step-ms` and complete through a watcher thread, so the time
  is the host's whole path to the first token (minus `--step-ms`, the prefill on the device).
- submit: the frontend's own work up to the Submit's bytes (JSON, prompt, tokens, sampling, encoding), in this
  process and thread: the steadiest view of the frontend's part on a busy machine.
Prints the median and the 10th/90th percentiles per (part, prompt), and the difference of the medians; the engine
and frontend parts add CPU time per request (the engine's thread; the frontend process, over 200 requests each).
`--profile engine` runs the engine part under cProfile (top functions by cumulative time), `--profile frontend` the
frontend process (by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import http.client
import json
import os
import pstats
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq

from bench.client import request_body
from bench.datasets import Prompt
from bench.lab.host.loop_engine import token_completion
from bench.tokens import Tokens
from common import protocol as wire
from common.manifest import load_manifest
from engine.core import Engine
from engine.scheduler.plan import Completion, Plan
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry

VOCAB = 49152
CONTEXT = 1 << 16
CPU_ROUNDS = 200  # requests per prompt kind whose CPU time is measured (the clock ticks in 10 ms)


class InstantExecutor:
    """Completes each step as it is submitted: token 1 for every sampled row, no device."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.wake_fd = -1
        self.late_masks = False  # (no grammar runs here)
        self._fence = 0
        self._done: list[tuple[Plan, Completion]] = []

    def can_submit(self) -> bool:
        return len(self._done) < 2

    def next_fence(self) -> int:
        return self._fence + 1

    def submit(self, plan: Plan) -> None:
        self._fence += 1
        self._done.append((plan, token_completion(self._fence, plan, 1, 1e-3)))

    def poll(self) -> list[tuple[Plan, Completion]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        pass


class EngineBench:
    """An Engine on inproc sockets, fed by a DEALER as a frontend would."""

    def __init__(self, page_size: int, num_pages: int) -> None:
        context = zmq.Context.instance()
        address = f"inproc://host-path-{uuid.uuid4().hex[:8]}"
        router = context.socket(zmq.ROUTER)
        router.bind(address)
        telemetry = context.socket(zmq.XPUB)
        telemetry.bind(address + "-telemetry")
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, b"bench")
        self.dealer.connect(address)
        card = wire.ModelCard(["bench"], "bench", "llama", CONTEXT, [0])
        scheduler = RequestScheduler(64, 256, num_pages, page_size, 8192, bytes(range(32)))
        self.engine = Engine(card, InstantExecutor(num_pages), scheduler, VOCAB, router,
                             EngineTelemetry(telemetry, "engine-bench"), address + "-telemetry")

    def first_token(self, prompt: list[int]) -> float:
        """Seconds from sending the Submit to receiving its first token (of two: its end is not timed)."""
        payload = wire.encode(wire.Submit(uuid.uuid4().hex, prompt, wire.SamplingParams(max_tokens=2)))
        started = time.perf_counter()
        self.dealer.send(payload)
        message = None
        while not isinstance(message, wire.Outputs):  # heartbeats may come first
            while not self.dealer.poll(0):
                self.engine.turn()
            message = wire.decode_engine_message(self.dealer.recv())
        elapsed = time.perf_counter() - started
        assert isinstance(message, wire.Outputs) and message.token_ids == [[1]], message
        while self.engine.scheduler.has_work():  # the request's end, before the next one is timed
            self.engine.turn()
        while self.dealer.poll(0):
            self.dealer.recv()
        return elapsed


def engine_part(prefix_len: int, new_len: int, requests: int, page_size: int, profile: bool
                ) -> dict[str, list[float]]:
    rng = random.Random(0)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]

    def fresh(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    bench = EngineBench(page_size, num_pages=4 * (prefix_len + new_len) // page_size + 256)
    bench.first_token(prefix + fresh(new_len))  # the prefix is cached from here on
    cases = {f"{new_len} tokens": lambda: fresh(new_len),
             f"{new_len} after {prefix_len} cached": lambda: prefix + fresh(new_len)}
    profiler = cProfile.Profile() if profile else None
    times = interleaved(cases, requests, bench.first_token, profiler)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    for name, make in cases.items():  # the engine's CPU time (this thread), which other load disturbs less
        spent = []
        for _ in range(requests):
            prompt = make()
            started = time.thread_time()
            bench.first_token(prompt)
            spent.append(time.thread_time() - started)
        times[f"{name}, CPU"] = spent
    return times


def interleaved(cases: dict[str, Callable[[], object]], requests: int, measure: Callable[[object], float],
                profiler: cProfile.Profile | None = None) -> dict[str, list[float]]:
    """Each case `requests` times, alternating, after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(requests + 1):
        for name, make in cases.items():
            argument = make()
            if profiler is not None and i:
                profiler.enable()
            elapsed = measure(argument)
            if profiler is not None:
                profiler.disable()
            if i:
                times[name].append(elapsed)
    return times


def submit_part(core: Path, prefix_len: int, new_len: int, requests: int) -> dict[str, list[float]]:
    """The frontend's work from a request body to the Submit's bytes, in this thread (no server, no pool): JSON,
    prompt, tokens (the prefix tokenizer has seen the long prompt), sampling parameters, encoding."""
    from frontend.api.openai_completions import completion_prompts
    from frontend.api.sampling import sampling_params
    from frontend.model import ServedModel

    work = Path(tempfile.mkdtemp(prefix="flare-host-path-"))
    model = ServedModel(long_context_core(core, work / "core"))
    shutil.rmtree(work, ignore_errors=True)
    tokens, rng = Tokens(model.tokenizer), random.Random(0)
    system = tokens.text(rng, prefix_len)

    def body(system: str | None) -> bytes:
        prompt = Prompt(system, tokens.text(rng, new_len), new_len, 1)
        return json.dumps(request_body("completions", model.name, prompt, ignore_eos=True)).encode()

    def submit_bytes(raw: bytes) -> float:
        started = time.perf_counter()
        request = json.loads(raw.decode("utf-8"))
        ids = model.encode_text(completion_prompts(model, request)[0])
        params = sampling_params(model, request, len(ids), 1)
        wire.encode(wire.Submit(uuid.uuid4().hex, ids, params))
        return time.perf_counter() - started

    submit_bytes(body(system))
    return interleaved({f"{new_len} tokens": lambda: body(None),
                        f"{new_len} after {prefix_len} seen": lambda: body(system)}, requests, submit_bytes)


def long_context_core(core: Path, into: Path) -> Path:
    """The core's files linked into `into`, with a manifest whose context limit holds the long prompt."""
    into.mkdir()
    for file in core.iterdir():
        if file.name != "manifest.json":
            (into / file.name).symlink_to(file.resolve())
    manifest = json.loads((core / "manifest.json").read_text())
    manifest["context_limit"] = max(manifest["context_limit"], CONTEXT)
    (into / "manifest.json").write_text(json.dumps(manifest))
    return into


def first_event(port: int, body: bytes) -> float:
    """Seconds from sending a streamed request to the first byte of its first event; the rest is read and dropped."""
    connection = http.client.HTTPConnection("127.0.0.1", port)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
    response.read(1)
    elapsed = time.perf_counter() - started
    response.read()
    connection.close()
    return elapsed


def frontend_part(core: Path, prefix_len: int, new_len: int, requests: int, profile: bool, port: int,
                  engine: list[str]) -> dict[str, list[float]]:
    """`engine`: the stand-in engine's module and options, to which --core and --listen are added."""
    work = Path(tempfile.mkdtemp(prefix="flare-host-path-"))
    processes: list[subprocess.Popen] = []
    try:
        core = long_context_core(core, work / "core")
        model = load_manifest(core, verify=False).served_names[0]
        address = f"ipc://{work}/engine.sock"
        processes.append(subprocess.Popen([sys.executable, "-m", *engine, "--core", str(core), "--listen", address]))
        profiling = ["-m", "cProfile", "-o", str(work / "frontend.prof")] if profile else []
        processes.append(subprocess.Popen([sys.executable, *profiling, "-m", "frontend.main", "--engine", address,
                                           "--core", str(core), "--port", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_healthy(port)
        tokens, rng = Tokens.load(core), random.Random(0)
        system = tokens.text(rng, prefix_len)

        def body(system: str | None) -> bytes:
            prompt = Prompt(system, tokens.text(rng, new_len), new_len, 1)
            return json.dumps(request_body("completions", model, prompt, ignore_eos=True)).encode()

        first_event(port, body(system))  # the frontend's prefix tokenizer has seen the system prompt
        cases = {f"{new_len} tokens": lambda: body(None),
                 f"{new_len} after {prefix_len} cached": lambda: body(system)}
        times = interleaved(cases, requests, lambda b: first_event(port, b))
        for name, make in cases.items():  # CPU time, which other load on the machine disturbs less than wall time
            bodies = [make() for _ in range(CPU_ROUNDS)]
            before = [cpu_seconds(p.pid) for p in processes]
            for data in bodies:
                first_event(port, data)
            spent = [(cpu_seconds(p.pid) - b) / CPU_ROUNDS for p, b in zip(processes, before)]
            times[f"{name}, CPU of the frontend (engine: {spent[0] * 1e3:.3f} ms)"] = [spent[1]]
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGINT if process is processes[-1] else signal.SIGTERM)  # cProfile writes
            process.wait(10)
    if profile:
        pstats.Stats(str(work / "frontend.prof")).sort_stats("tottime").print_stats(45)
    shutil.rmtree(work, ignore_errors=True)
    return times


def cpu_seconds(pid: int) -> float:
    """User plus system time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the frontend did not become healthy within 60 s")


def report(part: str, times: dict[str, list[float]]) -> None:
    """Two rows per pair of cases (alone, after the prefix), then their difference."""
    names = list(times)
    for short, long in zip(names[::2], names[1::2]):
        medians = []
        for name in (short, long):
            values = sorted(times[name])
            p10, p90 = values[len(values) // 10], values[(len(values) * 9) // 10]
            medians.append(statistics.median(values))
            print(f"| {part} | {name} | {medians[-1] * 1e3:.3f} | {p10 * 1e3:.3f} | {p90 * 1e3:.3f} |")
        print(f"| {part} | difference | {(medians[1] - medians[0]) * 1e3:.3f} | | |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.first_token", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=os.environ.get("FLARE_CORE"),
                        help="a core, for the frontend part's tokenizer and template (default: $FLARE_CORE)")
    parser.add_argument("--prefix-len", type=int, default=16000)
    parser.add_argument("--new-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=40, help="timed requests per prompt kind")
    parser.add_argument("--page-size", type=int, default=16, help="the engine's KV page (prefix key block) size")
    parser.add_argument("--part", default="engine,submit,frontend")
    parser.add_argument("--profile", choices=("engine", "frontend"))
    parser.add_argument("--port", type=int, default=18411)
    parser.add_argument("--engine", choices=("null", "loop"), default="null",
                        help="the frontend part's engine: bench/lab/host/null_engine.py or bench/lab/host/loop_engine.py")
    parser.add_argument("--step-ms", type=float, default=0.0, help="--engine loop: how long each step takes")
    args = parser.parse_args(argv)
    parts = args.part.split(",")
    print("| part | prompt | median ms | p10 ms | p90 ms |\n| --- | --- | --- | --- | --- |")
    if "engine" in parts:
        report("engine", engine_part(args.prefix_len, args.new_len, args.requests, args.page_size,
                                     args.profile == "engine"))
    if ("frontend" in parts or "submit" in parts) and args.core is None:
        parser.error("the frontend and submit parts need --core (or FLARE_CORE)")
    if "submit" in parts:
        report("submit", submit_part(args.core, args.prefix_len, args.new_len, args.requests))
    if "frontend" in parts:
        engine = ["bench.lab.host.null_engine", "--reply", "Hello there."] if args.engine == "null" else \
            ["bench.lab.host.loop_engine", "--step-ms", str(args.step_ms)]
        report("frontend", frontend_part(args.core, args.prefix_len, args.new_len, args.requests,
                                         args.profile == "frontend", args.port, engine))


if __name__ == "__main__":
    main()
