"""A device fault through real processes (docs/design.md, Errors): an engine whose model asserts on purpose, inside
its captured graphs, when a prompt holds one token. The request in flight fails with the fault, the engine exits
with status 4 instead of failing every later step, and the frontend answers 503 from then on.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from common.ranks import DEVICE_FAULT
from tests.support.ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

POISON = 300  # a token of the tiny preset's vocabulary (512) that no honest prompt below holds
# flare-engine with one change: the embedding step asserts on the device when its input holds POISON.
ENGINE = f"""
import sys
import torch
from engine.model import decoder

embed = decoder.CausalLM.embed

def embed_or_assert(self, input_ids):
    torch._assert_async((input_ids != {POISON}).all())
    return embed(self, input_ids)

decoder.CausalLM.embed = embed_or_assert
from engine.main import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def tiny_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    core = tmp_path_factory.mktemp("cores") / "tiny"
    subprocess.run([sys.executable, "-m", "ignition.main", "synth", "--preset", "tiny", "--dtype", "bfloat16",
                    "--force", str(core)], check=True)
    return core


def wait_healthy(url: str, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes), "a process exited while starting"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise AssertionError("the server did not become healthy")


def test_a_device_fault_fails_the_requests_in_flight_and_stops_the_engine(tiny_core: Path, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, "--core", str(tiny_core), "--listen", address,
                               "--device", "cuda"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    frontend = subprocess.Popen([sys.executable, "-m", "frontend.main", "--engine", address, "--core", str(tiny_core),
                                 "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, [engine, frontend])
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0.0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200

        streamed: list[str] = []
        started = threading.Event()

        def stream_long() -> None:  # in flight when the fault happens
            long = {**body, "max_tokens": 2000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as response:
                for line in response.iter_lines():
                    streamed.append(line)
                    started.set()

        streaming = threading.Thread(target=stream_long)
        streaming.start()
        assert started.wait(60)
        poisoned = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [1, POISON, 3]}, timeout=60)
        streaming.join(60)
        status = engine.wait(60)
        log = engine.stdout.read()[-3000:]
        assert status == DEVICE_FAULT and "the device failed" in log, log
        assert poisoned.status_code == 500, (poisoned.text, log)
        assert "device failed" in poisoned.json()["error"]["message"]
        errors = [line for line in streamed if line.startswith("data: {\"error\"")]
        assert len(errors) == 1 and "device failed" in errors[0], streamed[-3:]  # an error event, then [DONE]
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 503
    finally:
        for process in (frontend, engine):
            if process.poll() is None:
                process.kill()
            process.wait()
