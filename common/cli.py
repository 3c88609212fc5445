"""`flare run CORE [--tp R]`: the supervisor. Starts the engine (R ranks) and N frontends, waits for readiness, drains
on a signal, and when a child dies says which and why.
On a terminal it then shows the dashboard (common/dashboard/); `flare dashboard --engine ADDR` attaches one later.

Children run in their own session, so a terminal's Ctrl-C reaches only the supervisor, which then stops them in
order: frontends first (they refuse new requests and give open responses five seconds), then the engine (rank 0
drains and stops the other ranks). When an engine rank dies, the others fail their requests and exit on their own
(engine/parallel/); the supervisor gives them time to, then stops the frontends and exits non-zero.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common.dashboard.relay import OutputRelay
from common.errors import CoreError
from common.manifest import load_manifest
from common.ranks import RANK_GRACE, engine_commands, engine_names, first_failure, settle

READY_TIMEOUT = 600.0
FRONTEND_DRAIN = 5.0


def _die_with_parent() -> None:
    """Children get SIGTERM if the supervisor dies without cleaning up (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()


def spawn(args: list[str], output: int | None = None) -> subprocess.Popen:
    """`output`: a file descriptor for the child's stdout and stderr (default: the supervisor's own)."""
    return subprocess.Popen([sys.executable, "-m", *args], stdout=output, stderr=output,
                            preexec_fn=_die_with_parent)


def wait_ready(url: str, children: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (failure := first_failure(children)) is not None:
            raise RuntimeError(f"{failure} during startup")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready after {timeout:.0f}s")


def stop_all(frontends: list[subprocess.Popen], engines: list[subprocess.Popen]) -> None:
    for child in frontends:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + FRONTEND_DRAIN + 3
    for child in frontends:
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
    if engines[0].poll() is None:
        engines[0].send_signal(signal.SIGTERM)  # rank 0 drains, then stops the other ranks
    for engine in engines:
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            engine.kill()


def run(args: argparse.Namespace) -> int:
    try:
        manifest = load_manifest(args.core)
    except CoreError as exc:
        print(f"flare: error: {exc}", file=sys.stderr)
        return 1
    if args.tp < 1:
        print(f"flare: error: --tp must be at least 1, got {args.tp}", file=sys.stderr)
        return 1
    # A random part, so a stale socket file (or an engine left over) from an earlier run with the same pid never
    # answers this run's frontends.
    address = args.engine_address or f"ipc://{tempfile.gettempdir()}/flare-{os.getpid()}-{secrets.token_hex(4)}.sock"
    # On a terminal the dashboard takes the screen after loading; the children's output then goes through a relay.
    relay = OutputRelay() if sys.stderr.isatty() else None
    output = relay.write_fd if relay else None
    engines = dict(zip(engine_names(args.tp), (spawn(command, output) for command in
                                                engine_commands(args.core, address, args.tp, args.device,
                                                                speculative_args(args)))))
    frontend_args = ["frontend.main", "--engine", address, "--core", str(args.core), "--host", args.host,
                     "--port", str(args.port)]
    for flag in ("api_key", "capacity", "body_limit", "workers"):
        if getattr(args, flag) is not None:
            frontend_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    frontends = [spawn(frontend_args, output) for _ in range(args.frontends)]
    children = {**engines, **{f"frontend {i}": f for i, f in enumerate(frontends)}}
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        wait_ready(f"http://{args.host}:{args.port}/health", children, READY_TIMEOUT)
        print(f"flare: serving {manifest.served_names[0]} on http://{args.host}:{args.port} "
              f"({args.frontends} frontends); Ctrl-C stops", file=sys.stderr, flush=True)
        if relay is not None:
            from common.dashboard.app import supervise  # textual loads only when the dashboard shows

            supervise(address, lambda: stop or any(c.poll() is not None for c in children.values()), relay)
        while not stop:
            if (failure := first_failure(children)) is not None:
                raise RuntimeError(failure)
            time.sleep(0.2)
    except RuntimeError as exc:
        print(f"flare: error: {exc}", file=sys.stderr, flush=True)
        if len(engines) > 1:  # the other ranks fail their requests (frontends still relay the errors) and exit
            print(f"flare: {settle(engines, RANK_GRACE)}", file=sys.stderr, flush=True)
        stop_all(frontends, list(engines.values()))
        if relay is not None:
            relay.close()
        return 1
    print("flare: stopping: frontends drain, then the engine", file=sys.stderr, flush=True)
    stop_all(frontends, list(engines.values()))
    if relay is not None:
        relay.close()
    failed = [name for name, child in children.items() if child.returncode not in (0, -signal.SIGTERM)]
    if failed:
        print(f"flare: error: {', '.join(failed)} did not stop cleanly", file=sys.stderr)
        return 1
    return 0


def speculative_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine's speculative decoding flags (docs/speculative.md)."""
    extra = ("--speculative", args.speculative) if args.speculative else ()
    return extra + (("--draft", str(args.draft)) if args.draft else ())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flare", description="Flare: serve a core over HTTP.")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="start the engine and frontends for a core")
    run_parser.add_argument("core", type=Path)
    run_parser.add_argument("--frontends", type=int, default=1)
    run_parser.add_argument("--host", default="127.0.0.1")
    run_parser.add_argument("--port", type=int, default=8000)
    run_parser.add_argument("--device", help="cpu or cuda (default: the engine's choice)")
    run_parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one engine process each")
    run_parser.add_argument("--api-key", help="require this bearer token (or x-api-key) on every route but "
                                              "/health and /metrics")
    run_parser.add_argument("--capacity", type=int, help="requests each frontend admits at once "
                                                       "(default: the engine's queue plus its slots)")
    run_parser.add_argument("--body-limit", type=int, help="largest request body in bytes (frontend default 32 MiB)")
    run_parser.add_argument("--workers", type=int, help="template/tokenizer threads per frontend (default 2)")
    run_parser.add_argument("--speculative", choices=("auto", "ngram", "draft", "off"),
                            help="speculative decoding: ngram (copy proposals), draft (the --draft model), off; "
                                 "default auto: draft with --draft, else ngram")
    run_parser.add_argument("--draft", type=Path, help="DRAFT_CORE: a smaller core with the same tokenizer that "
                                                       "proposes drafts")
    run_parser.add_argument("--engine-address", help="ZMQ address for the engine (default: an ipc socket)")
    dashboard_parser = commands.add_parser("dashboard", help="watch a running engine in the terminal")
    dashboard_parser.add_argument("--engine", required=True,
                                  help="the engine's request address, as given to flare-engine --listen")
    args = parser.parse_args(argv)
    if args.command == "dashboard":
        from common.dashboard.app import attach  # textual loads only for this command

        sys.exit(attach(args.engine))
    sys.exit(run(args))


if __name__ == "__main__":
    main()
