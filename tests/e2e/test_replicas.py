"""Engine replicas behind frontends that route by cached prefix and load (frontend/replicas.py), with real processes:
`flare run --replicas 2 --frontends 2`, and engines started by hand with one of them killed and restarted."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.servers import Server
from tests.support.ports import free_port

GROUPS = 4
FOLLOWERS = 3  # requests per group after the first
WORDS = ("river", "stone", "lantern", "orchard", "harbor", "meadow", "falcon", "copper", "violet", "thunder")


def system_prompt(group: int) -> str:
    """About 300 tokens that differ from the first word on, so groups share no block."""
    words = [WORDS[(group * 7 + i * (group + 3)) % len(WORDS)] for i in range(260)]
    return f"Group {group} instructions: " + " ".join(words) + ".\n"


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def per_replica(metrics: dict[str, float], name: str) -> list[float]:
    found = {int(m.group(1)): v for k, v in metrics.items() if (m := re.fullmatch(rf'{name}{{replica="(\d)"}}', k))}
    return [found.get(i, 0.0) for i in range(2)]


@pytest.fixture(scope="module")
def replicated(fp32_core_dir: Path):
    """The fp32 core, so that greedy tokens compare across batches (conftest.fp32_server)."""
    server = Server(fp32_core_dir, "--replicas", "2", "--frontends", "2")
    yield server
    server.stop()


def complete(base_url: str, prompt: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    reply = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=8, temperature=0)
    return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens


def test_shared_prefixes_stay_on_one_replica_and_load_spreads(replicated: Server, fp32_server: Server) -> None:
    prompts = {g: [system_prompt(g) + f"Question {q}: name a colour." for q in range(FOLLOWERS + 1)]
               for g in range(GROUPS)}
    for group in range(GROUPS):  # one request per group first; its blocks get announced to both frontends
        complete(replicated.base_url, prompts[group][0])
        time.sleep(1.0)
    followers = [(g, p) for g in range(GROUPS) for p in prompts[g][1:]]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda item: complete(replicated.base_url, item[1]), followers))
    # Every follower found its group's system prompt cached: it went where the group's first request went.
    assert all(cached >= 256 for _, cached in results), results
    deadline = time.monotonic() + 10  # the engines' telemetry lags by up to half a second
    while sum(admitted := per_replica(scrape(replicated.base_url), "flare_engine_admissions_total")) \
            < GROUPS * (FOLLOWERS + 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(admitted) == GROUPS * (FOLLOWERS + 1)
    # The stated imbalance: with four groups, neither replica carries more than three of them.
    assert max(admitted) <= 3 * (FOLLOWERS + 1), admitted
    # Greedy outputs are the single-engine server's.
    for (group, prompt), (text, _) in list(zip(followers, results))[::3]:
        assert text == complete(fp32_server.base_url, prompt)[0]


def connected(health: dict) -> bool:
    return len(health["replicas"]) == 2 and all(r["connected"] for r in health["replicas"])


class HandStarted:
    """Two flare-engine processes and one flare-frontend routing round-robin between them, as on several hosts."""

    def __init__(self, core: Path, logs: Path) -> None:
        self.core, self.logs = core, logs
        self.bin = Path(sys.executable).parent
        self.addresses = [f"ipc:///tmp/flare-replica-{uuid.uuid4().hex[:12]}.sock" for _ in range(2)]
        self.engines = [self.start_engine(i) for i in range(2)]
        self.base_url = f"http://127.0.0.1:{(port := free_port())}"
        self.frontend = subprocess.Popen(
            [str(self.bin / "flare-frontend"), "--core", str(core), "--port", str(port), "--routing", "round-robin",
             *[arg for address in self.addresses for arg in ("--engine", address)]],
            stdout=(logs / "frontend.log").open("a"), stderr=subprocess.STDOUT)
        assert self.wait(connected, 300)

    def start_engine(self, index: int) -> subprocess.Popen:
        return subprocess.Popen([str(self.bin / "flare-engine"), "--core", str(self.core), "--listen",
                                 self.addresses[index]], stdout=(self.logs / f"engine{index}.log").open("a"),
                                stderr=subprocess.STDOUT)

    def health(self) -> dict:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {"replicas": []}

    def wait(self, condition, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition(self.health()):
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        for process in [self.frontend, *self.engines]:
            process.terminate()
        for process in [self.frontend, *self.engines]:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def stream(base_url: str, prompt: str, max_tokens: int) -> str:
    """'ok' when the stream completes; the error's message when it fails."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        for _ in client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
            pass
    except openai.APIError as exc:
        return str(exc)
    return "ok"


def test_a_killed_replica_is_routed_around_and_rejoins(core_dir: Path, tmp_path: Path) -> None:
    deployment = HandStarted(core_dir, tmp_path)
    try:
        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(stream, deployment.base_url, f"Story {i}: once upon a time", 120)
                       for i in range(4)]
            assert deployment.wait(lambda h: [r["load"] for r in h["replicas"]] == [2, 2], 120), deployment.health()
            deployment.engines[1].kill()
            outcomes = [f.result() for f in running]
        # The two on the killed replica fail with a clear error; the two on the other complete.
        assert sorted(o == "ok" for o in outcomes) == [False, False, True, True], outcomes
        assert all("unreachable" in o for o in outcomes if o != "ok"), outcomes
        # Everything after goes to the survivor.
        assert all(stream(deployment.base_url, f"After {i}", 4) == "ok" for i in range(4))
        routed = [r["routed"] for r in deployment.health()["replicas"]]
        deployment.engines[1] = deployment.start_engine(1)
        assert deployment.wait(connected, 300), deployment.health()
        assert all(stream(deployment.base_url, f"Back {i}", 4) == "ok" for i in range(4))
        again = [r["routed"] for r in deployment.health()["replicas"]]
        assert again[1] > routed[1], (routed, again)  # the restarted replica takes requests again
    finally:
        deployment.stop()
