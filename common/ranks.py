"""Engine ranks as the supervisor sees them: one `flare-engine` process per tensor-parallel rank, and, when the group
fails, which rank took it down."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

# The exit status of a rank that left because the group failed (another rank died, went silent or could not run a
# step), as opposed to one that crashed or was killed on its own.
GROUP_FAILED = 3
# The exit status of an engine whose device failed for good (engine/executor/faults.py).
DEVICE_FAULT = 4
# Seconds the other ranks get to notice a dead rank, fail their requests and exit (a heartbeat timeout is 5 s).
RANK_GRACE = 15.0


def free_port(low: int = 10000, high: int = 20000) -> int:
    """A port of [low, high) that nothing is bound to now. Below the kernel's ephemeral range (32768-60999 on Linux),
    which outgoing connections and port-0 binds draw from: a port asked of the kernel could be taken by another
    process's connection (a starting rank's gloo mesh, say) before its own process binds it; these cannot."""
    while True:
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def engine_commands(core: Path, address: str, world_size: int, extra: list[str] = ()) -> list[list[str]]:
    """Module and arguments of each rank; rank 0 serves the frontends at `address`. `extra` (device, capacities,
    dtype) goes to every rank, which must all agree on them."""
    common = ["--core", str(core), *extra]
    if world_size == 1:
        return [["engine.main", "--rank", "0", "--listen", address, *common]]
    group = ["--world-size", str(world_size), "--dist-address", f"127.0.0.1:{free_port()}",
             "--threads", str(max((os.cpu_count() or 1) // world_size, 1))]  # the ranks share this host's cores
    return [["engine.main", "--rank", str(rank), *group, *common, *(["--listen", address] if rank == 0 else [])]
            for rank in range(world_size)]


def engine_names(world_size: int, replica: int | None = None) -> list[str]:
    """How the supervisor names each rank; `replica` when there are several."""
    prefix = "engine" if replica is None else f"replica {replica} engine"
    return [prefix] if world_size == 1 else [f"{prefix} rank {rank}" for rank in range(world_size)]


def replica_gpus(replicas: int, world_size: int, visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica: consecutive runs of `world_size` of the visible GPUs (all, by index,
    when the variable is unset), so replica r's rank k uses its k-th GPU."""
    pool = visible.split(",") if visible else [str(i) for i in range(replicas * world_size)]
    if len(pool) < replicas * world_size:
        raise ValueError(f"{replicas} replicas of {world_size} ranks need {replicas * world_size} GPUs; "
                         f"CUDA_VISIBLE_DEVICES={visible} names {len(pool)}")
    return [",".join(pool[r * world_size:(r + 1) * world_size]) for r in range(replicas)]


def describe(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    if status == GROUP_FAILED:
        return "left the failed group (status 3)"
    if status == DEVICE_FAULT:
        return "stopped after a device fault (status 4): see its log"
    return f"exited with status {status}"


def first_failure(children: dict[str, subprocess.Popen]) -> str | None:
    """The exited child to blame: one that failed on its own rather than one that left a failed group."""
    exited = [(name, child.returncode) for name, child in children.items() if child.poll() is not None]
    if not exited:
        return None
    name, status = min(exited, key=lambda item: item[1] == GROUP_FAILED)
    return f"{name} {describe(status)}"


def settle(engines: dict[str, subprocess.Popen], grace: float) -> str:
    """After a rank died: wait for the others to fail their requests and exit, and say how each ended."""
    deadline = time.monotonic() + grace
    for child in engines.values():
        try:
            child.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    return "; ".join(f"{name} {describe(child.returncode)}" if child.returncode is not None
                     else f"{name} is still running after {grace:.0f}s" for name, child in engines.items())
