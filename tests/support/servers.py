"""A real `flare run` server started as a user starts it, and what tests read from its /metrics."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from tests.support.ports import free_port

TEST_API_KEY = "test-api-key"


class Server:
    def __init__(self, core: Path, *extra: str, engine_address: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.engine_address = engine_address or \
            f"ipc://{tempfile.gettempdir()}/flare-test-{uuid.uuid4().hex[:12]}.sock"
        flare = Path(sys.executable).with_name("flare")
        self.process = subprocess.Popen([str(flare), "run", str(core), "--port", str(self.port),
                                         "--engine-address", self.engine_address, *extra],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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


def cancellations(base_url: str) -> float:
    """The engine's count of cancelled requests, as a frontend's /metrics relays it (twice a second)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        return float(re.search(r"^flare_engine_cancellations_total (\S+)$", response.read().decode(), re.M)[1])


def wait_for_cancellation(base_url: str, before: float, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while cancellations(base_url) <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    return cancellations(base_url) > before
