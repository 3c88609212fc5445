"""`flare run`'s supervisor: starts K engine groups (replicas) of R ranks each and N frontends, waits for
readiness, drains on a signal, and when a child dies says which and why. With several replicas a replica whose rank
dies is restarted while the others serve; with one, the supervisor stops. On a terminal it then shows the dashboard
(common/dashboard/).

Children run in their own session, so a terminal's Ctrl-C reaches only the supervisor, which then stops them in
order: frontends first (they refuse new requests and give open responses five seconds), then the engine (rank 0
drains and stops the other ranks). When an engine rank dies, the others fail their requests and exit on their own
(engine/parallel/); the supervisor gives them time to, then stops the frontends and exits non-zero.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.api_keys import ApiKeyError, api_key, key_environment
from common.dashboard.relay import OutputRelay
from common.engine_flags import forwarded_engine_flags
from common.errors import CoreError
from common.links import LinkKeyError, exposure_problem, load_keys, private_ipc_directory
from common.manifest import Manifest, load_manifest
from common.ranks import RANK_GRACE, engine_commands, engine_names, first_failure, replica_gpus, settle

SYSTEM_ALLOCATOR = {"PYTHONMALLOC": "malloc", "MALLOC_ARENA_MAX": "2"}  # for frontends: frontend/heap.py says why

READY_TIMEOUT = 600.0
FRONTEND_DRAIN = 5.0


def _die_with_parent() -> None:
    """Children get SIGTERM if the supervisor dies without cleaning up (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()


def spawn(args: list[str], output: int | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`output`: a file descriptor for the child's stdout and stderr (default: the supervisor's own)."""
    return subprocess.Popen([sys.executable, "-m", *args], stdout=output, stderr=output, env=env,
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


def stop_all(frontends: list[subprocess.Popen], replicas: list["Replica"]) -> None:
    for child in frontends:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + FRONTEND_DRAIN + 3
    for child in frontends:
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.kill()
    for replica in replicas:
        rank0 = next(iter(replica.processes.values()))
        if rank0.poll() is None:
            rank0.send_signal(signal.SIGTERM)  # rank 0 drains, then stops the other ranks
    for engine in (child for replica in replicas for child in replica.processes.values()):
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            engine.kill()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """What every engine rank receives as given: the engine flags (common/engine_flags.py) and the link's."""
    return forwarded_engine_flags(args) + link_keys_flag(args) + \
        (["--insecure-engine-link"] if args.insecure_engine_link else [])


def link_keys_flag(args: argparse.Namespace) -> list[str]:
    """--engine-keys for every child on an engine link (a directory's path: the keys stay in their files)."""
    return ["--engine-keys", str(args.engine_keys)] if args.engine_keys else []


def replica_address(base: str, replica: int, replicas: int) -> str:
    """Replica r's request address: the base for one replica; else a sibling ipc path, or the TCP port 2r further
    (each engine binds its port and the next, for telemetry)."""
    if replicas == 1:
        return base
    if base.startswith("tcp://"):
        host, port = base.rsplit(":", 1)
        return f"{host}:{int(port) + 2 * replica}"
    return f"{base}.r{replica}"


class Replica:
    """One engine group (its ranks), started and, after a failure when other replicas serve on, restarted together."""

    def __init__(self, index: int, replicas: int, address: str, commands: list[list[str]], env: dict[str, str],
                 output: int | None) -> None:
        self.index, self.address, self.commands, self.env, self.output = index, address, commands, env, output
        self.names = engine_names(len(commands), index if replicas > 1 else None)
        self.processes: dict[str, subprocess.Popen] = {}
        self.start()

    def start(self) -> None:
        self.processes = {name: spawn(command, self.output, self.env)
                          for name, command in zip(self.names, self.commands)}

    def restart(self, failure: str) -> None:
        print(f"flare: replica {self.index}: {failure}; restarting it (the other replicas serve meanwhile)",
              file=sys.stderr, flush=True)
        settle(self.processes, RANK_GRACE)
        for child in self.processes.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        self.start()


def run(args: argparse.Namespace) -> int:
    try:
        manifest = load_manifest(args.core)
    except CoreError as exc:
        print(f"flare: error: {exc}", file=sys.stderr)
        return 1
    for flag in ("tp", "replicas", "frontends"):
        if getattr(args, flag) < 1:
            print(f"flare: error: --{flag} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 1
    try:
        gpus = replica_gpus(args.replicas, args.tp, os.environ.get("CUDA_VISIBLE_DEVICES")) \
            if args.replicas > 1 else [None]
    except ValueError as exc:
        print(f"flare: error: {exc}", file=sys.stderr)
        return 1
    try:
        key, link_keys = api_key(args), load_keys(args.engine_keys)
    except (ApiKeyError, LinkKeyError) as exc:
        print(f"flare: error: {exc}", file=sys.stderr)
        return 1
    if args.engine_address and (problem := exposure_problem(args.engine_address, link_keys,
                                                            args.insecure_engine_link)) is not None:
        print(f"flare: error: {problem}", file=sys.stderr)
        return 1
    # A fresh private directory: no other user of the host reaches the sockets, and no stale socket file (or engine
    # left over) from an earlier run answers this run's frontends.
    ipc_directory = None if args.engine_address else private_ipc_directory()
    try:
        return serve(args, manifest, gpus, ipc_directory, key)
    finally:
        if ipc_directory is not None:
            shutil.rmtree(ipc_directory, ignore_errors=True)


def serve(args: argparse.Namespace, manifest: Manifest, gpus: list[str | None], ipc_directory: Path | None,
          key: str | None) -> int:
    """Start the children and watch them until a signal or a failure; the exit status."""
    base = args.engine_address or f"ipc://{ipc_directory}/engine.sock"
    # On a terminal the dashboard takes the screen after loading; the children's output then goes through a relay.
    relay = OutputRelay() if sys.stderr.isatty() else None
    output = relay.write_fd if relay else None
    replicas = []
    for r, visible in enumerate(gpus):
        address = replica_address(base, r, args.replicas)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible} if visible is not None else dict(os.environ)
        commands = engine_commands(args.core, address, args.tp, engine_flags(args))
        replicas.append(Replica(r, args.replicas, address, commands, env, output))
    frontend_args = ["frontend.main", "--core", str(args.core), "--host", args.host, "--port", str(args.port),
                     "--routing", args.routing, *link_keys_flag(args)]
    for replica in replicas:
        frontend_args += ["--engine", replica.address]
    for flag in ("capacity", "body_limit", "body_timeout", "workers", "max_images", "max_image_bytes",
                 "max_image_pixels", "media_timeout", "allowed_origins", "pooling"):
        if getattr(args, flag) is not None:
            frontend_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.allowed_media_domains:
        frontend_args += ["--allowed-media-domains", *args.allowed_media_domains]
    # The key travels in the environment, never on a command line (common/api_keys.py); frontends run on the C
    # library's allocator (frontend/heap.py).
    frontends = {f"frontend {i}": spawn(frontend_args, output, {**key_environment(key), **SYSTEM_ALLOCATOR})
                 for i in range(args.frontends)}
    stop = False

    def engines() -> dict[str, subprocess.Popen]:
        return {name: child for replica in replicas for name, child in replica.processes.items()}

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        wait_ready(f"http://{args.host}:{args.port}/health", {**engines(), **frontends}, READY_TIMEOUT)
        print(f"flare: serving {manifest.served_names[0]} on http://{args.host}:{args.port} "
              f"({args.frontends} frontends, {args.replicas} replicas); Ctrl-C stops", file=sys.stderr, flush=True)
        if relay is not None:
            from common.dashboard.app import supervise  # textual loads only when the dashboard shows

            supervise(replicas[0].address, lambda: stop or any(
                c.poll() is not None for c in {**engines(), **frontends}.values()), relay, load_keys(args.engine_keys))
        while not stop:
            if (failure := first_failure(frontends)) is not None:
                raise RuntimeError(failure)
            for replica in replicas:
                if (failure := first_failure(replica.processes)) is not None:
                    if len(replicas) == 1:
                        raise RuntimeError(failure)
                    replica.restart(failure)
            time.sleep(0.2)
    except RuntimeError as exc:
        print(f"flare: error: {exc}", file=sys.stderr, flush=True)
        if args.tp > 1:  # the other ranks fail their requests (frontends still relay the errors) and exit
            print(f"flare: {settle(engines(), RANK_GRACE)}", file=sys.stderr, flush=True)
        stop_all(list(frontends.values()), replicas)
        if relay is not None:
            relay.close()
        return 1
    print("flare: stopping: frontends drain, then the engines", file=sys.stderr, flush=True)
    stop_all(list(frontends.values()), replicas)
    if relay is not None:
        relay.close()
    failed = [name for name, child in {**engines(), **frontends}.items()
              if child.returncode not in (0, -signal.SIGTERM)]
    if failed:
        print(f"flare: error: {', '.join(failed)} did not stop cleanly", file=sys.stderr)
        return 1
    return 0
