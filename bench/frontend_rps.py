"""Requests per second that frontend processes sustain in front of an engine that answers at once.

    python -m bench.frontend_rps --core DIR [--frontends 1,2] [--seconds 10] [--connections 16]

Starts bench/null_engine.py and N `flare-frontend` processes on one port (SO_REUSEPORT), frontend i pinned to CPU i
with taskset, and drives small chat requests (8 tokens back, streamed and not) with `wrk` (Debian package `wrk`),
pinned to the last CPU. Prints one row per (frontends, streamed). On a machine with few cores the load generator
and the null engine share the frontends' cores: say so when quoting the figures.
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
    processes = [subprocess.Popen([sys.executable, "-m", "bench.null_engine", "--core", str(core), "--listen",
                                   address])]
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


def drive(port: int, stream: bool, seconds: int, connections: int) -> tuple[float, int]:
    """(requests per second, non-2xx responses) from wrk."""
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
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rate, int(errors.group(1)) if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.frontend_rps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--frontends", default="1,2", help="comma-separated frontend counts")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=16)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        parser.error("needs wrk (apt-get install wrk)")
    print(f"{'frontends':>9} {'streamed':>8} {'req/s':>9} {'req/s per frontend':>19} {'non-2xx':>8}")
    for count in (int(n) for n in args.frontends.split(",")):
        port = 18000 + count
        processes = start(args.core, count, port)
        try:
            for stream in (False, True):
                drive(port, stream, 2, args.connections)  # warm-up
                rate, errors = drive(port, stream, args.seconds, args.connections)
                print(f"{count:>9} {str(stream):>8} {rate:>9.0f} {rate / count:>19.0f} {errors:>8}", flush=True)
        finally:
            stop(processes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
