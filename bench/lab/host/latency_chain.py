"""Where a short prompt's time to the first token goes on the host, hop by hop (docs/host.md).

    python -m bench.lab.host.latency_chain --core DIR [--requests 100] [--new-len 64] [--step-ms 0] [--port 18421]

One request at a time on one kept-alive connection: an HTTP client (this process), a `flare-frontend` process and
bench/lab/host/loop_engine.py (the real engine loop; each step takes `--step-ms`, the device's share). Both servers run
with timing points wrapped around the functions named in FRONTEND_POINTS and ENGINE_POINTS (monotonic clock, the
same in every process), so each row is the time from one point to the next, per request: median, 10th and 90th
percentiles. Nothing in the served path changes but the wrappers' own cost (about a microsecond a point).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import http.client
import inspect
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.client import request_body
from bench.datasets import Prompt
from bench.lab.host.first_token import wait_healthy
from bench.tokens import Tokens
from common import protocol as wire

# (module, attribute path, point name, after the call rather than before, which calls count)
FRONTEND_POINTS = [
    ("frontend.api.openai_completions", "completions", "frontend: handler starts", False, None),
    ("frontend.server", "Frontend.on_pool", "frontend: prompt tokenized", True, None),  # a text prompt's tokens
    ("frontend.engine_client", "EngineClient._send", "frontend: Submit sent", False,
     lambda client, message: isinstance(message, wire.Submit)),
    ("frontend.engine_client", "EngineClient._dispatch", "frontend: Outputs received", False, None),
    ("frontend.api.openai_completions", "open_stream", "frontend: stream opens", False, None),
    ("frontend.streaming", "EventStream.flush", "frontend: first event written", False,
     lambda stream: bool(stream._held)),
]
ENGINE_POINTS = [
    ("engine.core", "Engine._admit", "engine: Submit decoded", False, None),
    ("engine.scheduler.scheduler", "RequestScheduler.plan", "engine: step planned", True, None),
    ("bench.lab.host.loop_engine", "TimedExecutor.submit", "engine: step submitted", False, None),
    ("bench.lab.host.loop_engine", "TimedExecutor.poll", "engine: completion polled", True, None),
    ("engine.core", "Engine._send", "engine: Outputs sent", False,
     lambda engine, identity, message: isinstance(message, wire.Outputs)),
]
FIRST_BYTE = "client: first byte"
SEND = "client: request sent"


def wrap_points(points: list[tuple], marks: list[tuple[str, float]]) -> None:
    """Each function of `points` records (point, time) before or after its calls (the first of a request's calls
    is the one `report` keeps). A call after which a point counts only when it returns something. A function this
    tree lacks is left out (an older tree, timed for comparison), and its hop joins the next."""
    for module_name, path, point, after, when in points:
        module = __import__(module_name, fromlist=["_"])
        *owners, name = path.split(".")
        owner = functools.reduce(getattr, owners, module)
        original = getattr(owner, name, None)
        if original is None:
            continue

        def record(args: tuple, result: object = True, point: str = point, when=when) -> None:
            if result and (when is None or when(*args)):
                marks.append((point, time.perf_counter()))

        if inspect.iscoroutinefunction(original):
            async def wrapped(*args, original=original, after=after, record=record):
                if not after:
                    record(args)
                result = await original(*args)
                if after:
                    record(args, result)
                return result
        else:
            def wrapped(*args, original=original, after=after, record=record):
                if not after:
                    record(args)
                result = original(*args)
                if after:
                    record(args, result)
                return result
        setattr(owner, name, wrapped)


def serve(role: str, marks_file: Path, argv: list[str]) -> None:
    """Run the frontend or the loop engine with its points; the marks go to `marks_file` when it exits."""
    marks: list[tuple[str, float]] = []
    wrap_points(FRONTEND_POINTS if role == "frontend" else ENGINE_POINTS, marks)
    atexit.register(lambda: marks_file.write_text(json.dumps(marks)))
    if role == "frontend":
        from frontend.main import main as frontend_main
        frontend_main(argv)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        from bench.lab.host.loop_engine import main as engine_main
        engine_main(argv)


def first_bytes(port: int, bodies: list[bytes]) -> list[tuple[str, float]]:
    connection = http.client.HTTPConnection("127.0.0.1", port)
    marks = []
    for body in bodies:
        marks.append((SEND, time.perf_counter()))
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
        response.read(1)
        marks.append((FIRST_BYTE, time.perf_counter()))
        response.read()
        time.sleep(0.01)  # one request at a time, as a lone user's
    connection.close()
    return marks


def report(marks: list[tuple[str, float]], requests: int, warm_up: int) -> None:
    """One row per hop: times from each point to the next, per request, in order of their medians' points."""
    order = [SEND, *(p[2] for p in FRONTEND_POINTS[:3]), *(p[2] for p in ENGINE_POINTS),
             *(p[2] for p in FRONTEND_POINTS[3:]), FIRST_BYTE]
    times: dict[str, list[float]] = {}
    for point, at in sorted(marks, key=lambda mark: mark[1]):
        seen = times.setdefault(point, [])
        if point == SEND or len(seen) < len(times.get(SEND, ())):  # a request's first time at this point
            seen.append(at)
    present = [point for point in order if len(times.get(point, ())) == requests]
    print("| hop | median ms | p10 ms | p90 ms |\n| --- | --- | --- | --- |")
    for a, b in [*zip(present, present[1:]), (SEND, FIRST_BYTE)]:
        spans = sorted((y - x) * 1e3 for x, y in zip(times[a][warm_up:], times[b][warm_up:]))
        label = "total" if (a, b) == (SEND, FIRST_BYTE) else f"{a} -> {b}"
        print(f"| {label} | {statistics.median(spans):.3f} | {spans[len(spans) // 10]:.3f} | "
              f"{spans[len(spans) * 9 // 10]:.3f} |")


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--serve":  # a server of the chain (below)
        serve(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.latency_chain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=os.environ.get("FLARE_CORE"), help="default: $FLARE_CORE")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--new-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--step-ms", type=float, default=0.0, help="how long each engine step takes")
    parser.add_argument("--port", type=int, default=18421)
    args = parser.parse_args(argv)
    if args.core is None:
        parser.error("--core (or FLARE_CORE) is required")
    work = Path(tempfile.mkdtemp(prefix="flare-chain-"))
    address = f"ipc://{work}/engine.sock"
    this = [sys.executable, "-m", "bench.lab.host.latency_chain", "--serve"]
    engine = subprocess.Popen([*this, "engine", str(work / "engine.json"), "--core", str(args.core), "--listen",
                               address, "--step-ms", str(args.step_ms)])
    frontend = subprocess.Popen([*this, "frontend", str(work / "frontend.json"), "--engine", address, "--core",
                                 str(args.core), "--port", str(args.port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(args.port)
        tokens, rng = Tokens.load(args.core), random.Random(0)
        model = json.loads((args.core / "manifest.json").read_text())["served_names"][0]
        warm_up = 5
        bodies = [json.dumps(request_body("completions", model, Prompt(None, tokens.text(rng, args.new_len),
                                                                       args.new_len, 1), ignore_eos=True)).encode()
                  for _ in range(args.requests + warm_up)]
        client_marks = first_bytes(args.port, bodies)
    finally:
        for process in (frontend, engine):
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    marks = client_marks + [tuple(m) for name in ("frontend.json", "engine.json")
                            for m in json.loads((work / name).read_text())]
    report(marks, args.requests + warm_up, warm_up)


if __name__ == "__main__":
    main()
