"""What the scripts that measure a `flare run` over HTTP share: the flags that start one from a core or name a
running server, the server's lifetime around the measurement, and the markdown table of the rows measured."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def add_server_flags(parser: argparse.ArgumentParser, port: int) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--core", type=Path, help="start `flare run CORE` and measure it")
    where.add_argument("--url", help="a running server")
    parser.add_argument("--port", type=int, default=port, help="with --core")
    parser.add_argument("--flare-arg", action="append", default=[], help="passed on to `flare run` (repeatable)")


def start_server(core: Path, port: int, extra: list[str]) -> subprocess.Popen:
    # `flare` as a module of this interpreter: it runs from a checkout whose scripts are not installed, too.
    process = subprocess.Popen([sys.executable, "-m", "common.cli", "run", str(core), "--port", str(port), *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"flare run exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("flare run did not become healthy")


def model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


@contextmanager
def served(args: argparse.Namespace, extra: list[str]) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the server the flags name: `flare run --core` with `extra` flags, started here and
    stopped after, or `--url`."""
    server = start_server(args.core, args.port, extra) if args.core else None
    url = args.url.rstrip("/").removesuffix("/v1") if args.url else f"http://127.0.0.1:{args.port}"
    try:
        yield url, model_name(url)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)


def print_rows(rows: list[dict]) -> None:
    """Rows of the same keys as a markdown table, floats with two decimals."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
