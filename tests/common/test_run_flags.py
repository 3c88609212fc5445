"""`flare run`'s engine flags reach every rank and its frontend flags every frontend, and the engine refuses nonsense
before it loads anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.cli import main as flare_main
from common.ranks import engine_commands
from engine.main import parse_args
from frontend.main import parse_args as frontend_args


def test_capacity_flags_reach_every_rank(monkeypatch: pytest.MonkeyPatch, core_dir: Path) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("common.supervisor.engine_commands",
                        lambda *args: seen.extend(engine_commands(*args)) or sys.exit(0))
    with pytest.raises(SystemExit):
        flare_main(["run", str(core_dir), "--tp", "2", "--max-active", "8", "--max-batched-tokens", "2048",
                    "--kv-cache-fraction", "0.5", "--dtype", "bfloat16", "--eager"])
    assert len(seen) == 2
    for command in seen:
        for flag in ("--max-active=8", "--max-batched-tokens=2048", "--kv-cache-fraction=0.5", "--dtype=bfloat16",
                     "--eager"):
            assert flag in command
        parse_args(command[1:])  # the engine accepts what it is given


def test_frontend_flags_reach_every_frontend(monkeypatch: pytest.MonkeyPatch, core_dir: Path) -> None:
    def spawn(args: list[str], *_: object) -> None:
        if args[0] == "frontend.main":
            sys.exit(args[1:])  # the engines' commands are not started either: this runs nothing

    monkeypatch.setattr("common.supervisor.spawn", spawn)
    with pytest.raises(SystemExit) as frontend:
        flare_main(["run", str(core_dir), "--allowed-origins", "http://app.example,http://other.example",
                    "--body-timeout", "5"])
    given = frontend_args(frontend.value.code)
    assert given.allowed_origins == "http://app.example,http://other.example" and given.body_timeout == 5


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-fraction", "1.5"], "--kv-cache-fraction must be in (0, 1]"),
    (["--max-active", "0"], "--max-active must be at least 1"),
    (["--max-batched-tokens", "-4"], "--max-batched-tokens must be at least 1"),
])
def test_engine_refuses_bad_capacities(core_dir: Path, flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "engine.main", "--core", str(core_dir), "--listen",
                             "ipc:///tmp/flare-never.sock", *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr
