"""Pressure on a real engine and frontend, started as separate processes the way a user starts them: an overload
burst, a client that disconnects mid-stream, and the engine killed under load and started again. Engine state is
read from the frontend's /metrics (the engine's telemetry relayed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.ports import free_port

pytestmark = pytest.mark.slow

CAPACITY = 4
QUESTION = [{"role": "user", "content": "Tell me a long story about the sea."}]


def wait_for(condition: Callable[[], bool], seconds: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


class Deployment:
    """flare-engine and flare-frontend as two processes on one ipc address."""

    def __init__(self, core: Path, logs: Path) -> None:
        self.core = core
        self.logs = logs
        self.address = f"ipc:///tmp/flare-resilience-{uuid.uuid4().hex[:12]}.sock"
        self.bin = Path(sys.executable).parent
        self.engine = self.start_engine()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.frontend = subprocess.Popen(
            [str(self.bin / "flare-frontend"), "--engine", self.address, "--core", str(core), "--port",
             str(self.port), "--capacity", str(CAPACITY)],
            stdout=(logs / "frontend.log").open("a"), stderr=subprocess.STDOUT)
        if not wait_for(lambda: self.healthy() and "flare_engine_live_requests" in self.metrics(), 300, 0.2):
            self.stop()
            raise RuntimeError(f"the deployment did not come up; see {logs}")

    def start_engine(self) -> subprocess.Popen:
        return subprocess.Popen([str(self.bin / "flare-engine"), "--rank", "0", "--core", str(self.core), "--listen",
                                 self.address], stdout=(self.logs / "engine.log").open("a"), stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        try:
            text = httpx.get(f"{self.base_url}/metrics", timeout=2).text
        except httpx.HTTPError:
            return {}
        pairs = (line.split() for line in text.splitlines() if line and not line.startswith("#"))
        return {p[0]: float(p[1]) for p in pairs if len(p) == 2}

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=timeout)

    def stop(self) -> None:
        for process in (self.frontend, self.engine):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (self.frontend, self.engine):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def deployment(core_dir, tmp_path_factory):
    deployment = Deployment(core_dir, tmp_path_factory.mktemp("resilience"))
    yield deployment
    deployment.stop()


def idle(metrics: dict[str, float]) -> bool:
    """No request holds a slot or a page: every page is free or merely cached (evictable)."""
    return (metrics.get("flare_engine_live_requests") == 0 and metrics.get("flare_engine_pending_requests") == 0
            and metrics.get("flare_engine_retiring_pages") == 0)


def test_an_overload_burst_gets_only_200_429_503_and_frees_everything(deployment: Deployment) -> None:
    before = deployment.metrics()
    total_pages = before["flare_engine_free_pages"] + before["flare_engine_cached_pages"]

    def one(i: int) -> int:
        response = httpx.post(f"{deployment.base_url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 8, "ignore_eos": True})
        return response.status_code

    with ThreadPoolExecutor(10 * CAPACITY) as pool:
        statuses = list(pool.map(one, range(10 * CAPACITY)))
    assert set(statuses) <= {200, 429, 503} and 200 in statuses and 429 in statuses, statuses
    assert wait_for(lambda: idle(after := deployment.metrics()) and after["flare_engine_free_pages"]
                    + after["flare_engine_cached_pages"] == total_pages, 5), deployment.metrics()


def test_a_disconnect_mid_stream_frees_the_engine_within_a_second(deployment: Deployment) -> None:
    with httpx.stream("POST", f"{deployment.base_url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True,
            "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert wait_for(lambda: deployment.metrics().get("flare_engine_live_requests") == 1, 5)
    # The connection is closed: the handler is cancelled and aborts its engine request.
    assert wait_for(lambda: idle(deployment.metrics()), 1.0), deployment.metrics()


def test_the_engine_killed_under_load_then_restarted(deployment: Deployment) -> None:
    frontend_pid = deployment.frontend.pid
    client = deployment.client(timeout=60)
    model = client.models.list().data[0].id
    started = []

    def one(i: int) -> str:
        try:
            stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3000, stream=True,
                                                    seed=i, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    started.append(i)
            return "finished"
        except openai.APIError as exc:
            return f"error: {exc.message}"

    with ThreadPoolExecutor(CAPACITY) as pool:
        outcomes = [pool.submit(one, i) for i in range(CAPACITY)]
        assert wait_for(lambda: len(set(started)) == CAPACITY, 60)
        os.kill(deployment.engine.pid, signal.SIGKILL)
        deployment.engine.wait(10)
        results = [outcome.result(timeout=30) for outcome in outcomes]  # none hangs
    assert all(r.startswith("error: ") and "unreachable" in r for r in results), results
    # Meanwhile: 503 in the dialect's shape, and /health says so.
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    assert caught.value.status_code == 503
    assert not deployment.healthy()
    deployment.engine = deployment.start_engine()
    assert wait_for(deployment.healthy, 300, 0.2)
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    assert answer.choices[0].message.content and deployment.frontend.pid == frontend_pid
    assert deployment.frontend.poll() is None
