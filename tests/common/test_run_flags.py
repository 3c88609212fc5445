"""`flare run`'s engine flags reach every rank and its frontend flags every frontend, the two commands take the same
engine flags, and the engine refuses nonsense before it loads anything."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from common.cli import add_run_parser
from common.cli import main as flare_main
from common.engine_flags import DTYPE_NAMES
from common.ranks import engine_commands
from common.supervisor import engine_flags
from engine.main import make_parser, parse_args
from engine.model.loader import DTYPES
from frontend.main import parse_args as frontend_args

# Flags only `flare-engine` has: the group's shape, which `flare run` derives (common/ranks.py), and the engine's own
# CPU threads.
ENGINE_ONLY = {"--rank", "--world-size", "--dist-address", "--core", "--listen", "--threads"}


def run_parser() -> argparse.ArgumentParser:
    return add_run_parser(argparse.ArgumentParser().add_subparsers())


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each long flag a parser takes, with its action (argparse keeps no public list of them)."""
    return {flag: action for action in parser._actions for flag in action.option_strings if flag.startswith("--")}


def non_default(action: argparse.Action, directory: Path) -> list[str]:
    """The flag with a value other than its default that either command accepts."""
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(choice for choice in action.choices if choice != action.default)]
    value = {int: "3", float: "0.5", Path: str(directory), None: "cpu"}[action.type]
    return [flag, value]


def test_both_commands_take_the_same_engine_flags() -> None:
    engine, run = options(make_parser()), options(run_parser())
    assert set(engine) - set(run) == ENGINE_ONLY


def test_every_engine_flag_given_to_flare_run_reaches_the_engine(tmp_path: Path) -> None:
    engine_parser = make_parser()
    shared = {flag: action for flag, action in options(run_parser()).items()
              if flag in options(engine_parser) and flag != "--help"}
    given = run_parser().parse_args(["core", *(word for action in shared.values()
                                               for word in non_default(action, tmp_path))])
    engine = parse_args(["--core", "core", "--listen", "ipc:///tmp/flare-never.sock", *engine_flags(given)])
    for flag, action in shared.items():
        assert getattr(engine, action.dest) == getattr(given, action.dest), flag
        assert getattr(engine, action.dest) != engine_parser.get_default(action.dest), flag


def test_dtype_choices_are_the_engines() -> None:
    assert set(DTYPE_NAMES) <= set(DTYPES)


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
    (["--host-cache-bytes", str(1 << 60)], f"--host-cache-bytes {1 << 60} is more than 90% of the host memory"),
])
def test_engine_refuses_bad_capacities(core_dir: Path, flags: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "engine.main", "--core", str(core_dir), "--listen",
                             "ipc:///tmp/flare-never.sock", *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr
