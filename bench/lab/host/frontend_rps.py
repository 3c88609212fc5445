"""Requests per second that frontend processes sustain in front of an engine that answers at once.

    python -m bench.lab.host.frontend_rps --core DIR [--frontends 1,2] [--seconds 10] [--connections 16]

Starts bench/lab/host/null_engine.py and N `flare-frontend` processes on one port (SO_REUSEPORT), frontend i pinned to CPU i
with taskset, and drives small chat requests (8 tokens back, streamed and not) with `wrk` (Debian package `wrk`);
wrk and the null engine are pinned to the last CPU. Prints one row per (frontends, streamed). On a machine with few
cores the load generator and the null engine share the frontends' cores: say so when quoting the figures.

Besides wall-clock req/s, each row gives the CPU time the frontend processes spent per request (user + system, from
/proc/PID/stat around the measured run) and what that makes on a core of their own (1000 / CPU ms): a figure that
other work on the machine slows far less than it slows req/s. The null engine's CPU per request and the 1-minute
load average at the end of the run are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import NamedTuple

LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
"""


def body(model: str, stream: bool) -> str:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                       "stream": stream})


def start(core: Path, frontends: int, port: int) -> list[subprocess.Popen]:
    address = f"ipc://{tempfile.gettempdir()}/flare-null-{uuid.uuid4().hex[:8]}.sock"
    cpus = os.cpu_count() or 1
    processes = [subprocess.Popen(["taskset", "-c", str(cpus - 1), sys.executable, "-m", "bench.lab.host.null_engine",
                                   "--core", str(core), "--listen", address])]
    for i in range(frontends):
        processes.append(subprocess.Popen(["taskset", "-c", str(i % cpus), sys.executable, "-m", "frontend.main",
                                           "--engine", address, "--core", str(core), "--port", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                time.sleep(1.0)  # every frontend of the port up, not only the first
                return processes
        except OSError:
            time.sleep(0.2)
    stop(processes)
    raise RuntimeError("frontends did not come up")


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Run(NamedTuple):
    rate: float  # requests per second, wall clock
    requests: int
    errors: int  # non-2xx responses


def drive(port: int, stream: bool, seconds: int, connections: int) -> Run:
    """One wrk run."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
            model = json.load(response)["data"][0]["id"]
        script.write(LUA.format(body=body(model, stream)))
    cpu = str((os.cpu_count() or 1) - 1)
    out = subprocess.run(["taskset", "-c", cpu, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", script.name,
                          f"http://127.0.0.1:{port}/v1/chat/completions"], capture_output=True, text=True,
                         check=True).stdout
    os.unlink(script.name)
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return Run(rate, requests, int(errors.group(1)) if errors else 0)


def measure(processes: list[subprocess.Popen], port: int, stream: bool, seconds: int, connections: int
            ) -> tuple[Run, float, float]:
    """A wrk run and the CPU milliseconds per request it cost the frontends (all of them) and the null engine."""
    engine, frontends = processes[0].pid, [p.pid for p in processes[1:]]
    engine_before, frontends_before = cpu_seconds(engine), sum(cpu_seconds(pid) for pid in frontends)
    run = drive(port, stream, seconds, connections)
    engine_cpu = cpu_seconds(engine) - engine_before
    frontends_cpu = sum(cpu_seconds(pid) for pid in frontends) - frontends_before
    per_request = 1000 / max(run.requests, 1)
    return run, frontends_cpu * per_request, engine_cpu * per_request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.frontend_rps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--frontends", default="1,2", help="comma-separated frontend counts")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=16)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        parser.error("needs wrk (apt-get install wrk)")
    print(f"{'frontends':>9} {'streamed':>8} {'req/s':>7} {'req/s per frontend':>18} {'frontend CPU ms/req':>19} "
          f"{'req/s on one core':>17} {'engine CPU ms/req':>17} {'non-2xx':>7} {'load avg':>8}")
    for count in (int(n) for n in args.frontends.split(",")):
        port = 18000 + count
        processes = start(args.core, count, port)
        try:
            for stream in (False, True):
                drive(port, stream, 2, args.connections)  # warm-up
                run, frontend_ms, engine_ms = measure(processes, port, stream, args.seconds, args.connections)
                print(f"{count:>9} {str(stream):>8} {run.rate:>7.0f} {run.rate / count:>18.0f} {frontend_ms:>19.3f} "
                      f"{1000 / frontend_ms:>17.0f} {engine_ms:>17.3f} {run.errors:>7} {os.getloadavg()[0]:>8.2f}",
                      flush=True)
        finally:
            stop(processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
