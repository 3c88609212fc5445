"""Shared fixtures: the default core, and a real `flare run` server started as a user starts it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from common import ranks

ROOT = Path(__file__).resolve().parents[1]


def default_core() -> Path:
    return Path(os.environ.get("FLARE_CORE", ROOT / "cores" / "smollm2-135m"))


@pytest.fixture(scope="session")
def core_dir() -> Path:
    core = default_core()
    if not (core / "manifest.json").is_file():
        pytest.skip(f"no default core at {core} (make core builds it)")
    return core


@pytest.fixture(scope="session")
def fp32_core_dir(core_dir: Path) -> Path:
    """The default model with fp32 weights (transformers' parity and tensor parallelism need one): FLARE_FP32_CORE,
    else cores/smollm2-135m-fp32 (make core builds both), else the default core when it is itself dense."""
    from common.manifest import load_manifest

    core = Path(os.environ.get("FLARE_FP32_CORE", ROOT / "cores" / "smollm2-135m-fp32"))
    if (core / "manifest.json").is_file():
        return core
    if load_manifest(core_dir).quantization is None:
        return core_dir
    pytest.skip(f"no fp32 core at {core} (make core builds it)")


def free_port() -> int:
    """A port for a test's server, in a range of its own: `flare run` picks its ranks' ports below 20000 (CI saw a
    port from `bind(0)` taken by a `--tp 2` run's gloo connections before the frontend bound it)."""
    return ranks.free_port(20000, 32000)


class Server:
    def __init__(self, core: Path, *extra: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.engine_address = f"ipc://{tempfile.gettempdir()}/flare-test-{uuid.uuid4().hex[:12]}.sock"
        flare = Path(sys.executable).with_name("flare")
        self.process = subprocess.Popen([str(flare), "run", str(core), "--port", str(self.port),
                                         "--engine-address", self.engine_address, *extra],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flare run exited early:\n{self.process.stdout.read()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("flare run did not become healthy")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


@pytest.fixture(scope="session")
def server(core_dir: Path):
    server = Server(core_dir)
    yield server
    server.stop()


def cancellations(base_url: str) -> float:
    """The engine's count of cancelled requests, as a frontend's /metrics relays it (twice a second)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        return float(re.search(r"^flare_engine_cancellations_total (\S+)$", response.read().decode(), re.M)[1])


def wait_for_cancellation(base_url: str, before: float, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while cancellations(base_url) <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    return cancellations(base_url) > before


@pytest.fixture(scope="session")
def fp32_server(fp32_core_dir: Path):
    """A server of the fp32 core: for tests whose greedy tokens must not depend on what else runs in a step or what
    the prefix cache holds. A quantized core rounds activations to bfloat16 before every product, so the last-bit
    differences of CPU attention over other padding (torch's SDPA is not invariant to it) can flip a near tie;
    in fp32 they stay far below the margins (bench/results-cpu.md, CPU: quantized cores)."""
    server = Server(fp32_core_dir)
    yield server
    server.stop()


TEST_API_KEY = "test-api-key"


@pytest.fixture(scope="session")
def keyed_server(core_dir: Path):
    """A server started with --api-key TEST_API_KEY."""
    server = Server(core_dir, "--api-key", TEST_API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking_stack(core_dir: Path, tmp_path_factory):
    """A real frontend with Qwen3's template (it reasons) before the scripted engine: a 135M model does not think."""
    from tests.support.chat_family_cores import QWEN_TOKENS, differential_template, family_core
    from tests.support.scripted_engine import ScriptedStack

    stack = ScriptedStack(family_core(core_dir, tmp_path_factory.mktemp("qwen3") / "core", "qwen3",
                                      differential_template("qwen3"), QWEN_TOKENS))
    yield stack
    stack.stop()
