"""The terminal dashboard: its view of snapshots, headless against a real engine with textual's pilot, and
`flare run` on a pseudo-terminal (the dashboard takes the screen; Ctrl-C drains the server)."""

from __future__ import annotations

import asyncio
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from rich.console import Console

from common.dashboard.app import Dashboard
from common.dashboard.panes import GraphTable, Overview, RequestTable
from common.dashboard.view import TelemetryView
from common.protocol import GraphStat, RequestRow, Telemetry, telemetry_address
from tests.support.ports import free_port


def snapshot(uptime: float, prompt: int, output: int, requests: list[RequestRow] = (), **counters: int) -> Telemetry:
    return Telemetry("engine-a", uptime, {"prompt_tokens": prompt, "output_tokens": output, **counters}, {}, [0], 0.0,
                     graphs=[GraphStat("decode", 4, 10, 3.0, 5.0, 3.5), GraphStat("prefill", 512, 2, 15.0, 20.0, 1.0)],
                     requests=list(requests))


def row(slot: int, prompt_done: int, outputs: int, generation: int = 1) -> RequestRow:
    return RequestRow(slot, generation, "decode", 1.0, prompt_done, 100, outputs, 2.0, outputs)


def test_a_tick_after_the_app_has_closed_does_nothing() -> None:
    """The poll timer and the telemetry follower can fire while the app closes, after its widgets are gone."""
    async def close_then_tick() -> None:
        app = Dashboard(f"ipc:///tmp/flare-dashboard-{os.getpid()}-telemetry", stop_requested=lambda: False)
        async with app.run_test(size=(120, 16)) as pilot:
            await pilot.pause(0.1)
        app._poll()
        app._show_status()

    asyncio.run(close_then_tick())


def test_view_rates_shares_and_history() -> None:
    view = TelemetryView()
    view.update(snapshot(1.0, 0, 0, [row(0, 50, 0)]))
    assert view.throughput() == (0.0, 0.0)
    view.update(snapshot(1.5, 100, 0, [row(0, 100, 1)]))
    view.update(snapshot(2.0, 100, 0, [row(0, 100, 1)]))
    view.update(snapshot(3.5, 400, 250, [row(0, 100, 3)]))
    prefill, generation = view.throughput()  # over the last two engine seconds: from uptime 1.5 to 3.5
    assert prefill == pytest.approx(150.0) and generation == pytest.approx(125.0)
    assert [(g.label, round(g.share, 2)) for g in view.graphs()] == [("decode b4", 0.5), ("prefill t512", 0.5)]
    assert view.draft_acceptance() is None
    (tracked,), queued = view.requests()
    assert tracked.history.endswith("PD·D") and tracked.live and queued == []
    view.update(snapshot(4.0, 400, 250, [RequestRow(-1, 0, "waiting", 5.0, 0, 10, 0, -1.0, 0)], draft_rounds=4,
                         draft_accepted_tokens=6))
    (tracked,), queued = view.requests()
    assert not tracked.live and tracked.history.endswith("PD·D ") and len(queued) == 1
    assert view.draft_acceptance() == 1.5
    for i in range(20):  # retired rows last as long as their history shows anything
        view.update(snapshot(4.5 + i / 2, 400, 250))
    assert view.requests() == ([], [])


def shown(widget: Overview | GraphTable | RequestTable) -> str:
    console = Console(width=widget.size.width, file=io.StringIO(), record=True)
    console.print(widget.render())
    return console.export_text()


def number_after(label: str, text: str) -> float:
    return float(re.search(rf"{re.escape(label)}\s+([\d,.]+)", text).group(1).replace(",", ""))


async def wait_until(pilot, condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the dashboard did not get there in time"
        await pilot.pause(0.1)


def chat(base_url: str, i: int) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=24, temperature=0,
                                   messages=[{"role": "user", "content": f"Count to {i}"}],
                                   extra_body={"ignore_eos": True})


@pytest.mark.slow
def test_panes_follow_a_running_engine(server) -> None:
    address = server.engine_address
    sent = 10

    async def drive() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(sent))  # all requests at once
        app = Dashboard(telemetry_address(address), stop_requested=lambda: False)
        async with app.run_test(size=(120, 16)) as pilot:
            await wait_until(pilot, lambda: app.view.latest is not None)
            overview = app.query_one(Overview)
            before = number_after("Completed / failed", shown(overview))
            assert "Prefill" in shown(overview) and "Generation" in shown(overview)
            traffic = asyncio.gather(*(asyncio.to_thread(chat, server.base_url, i) for i in range(sent)))
            # While it runs, generation throughput shows, and the scheduler pane lists graphs and requests.
            await wait_until(pilot, lambda: number_after("Generation", shown(overview)) > 0)
            await wait_until(pilot, lambda: len(app.view.requests()[0]) >= sent)
            await pilot.press("tab")
            assert app.query_one("ContentSwitcher").current == "scheduler"
            requests, graphs = app.query_one(RequestTable), app.query_one(GraphTable)
            await wait_until(pilot, lambda: "decode b" in shown(graphs))
            assert "dropped updates 0" in shown(graphs) and "Req/call" in shown(graphs)
            assert re.search(r"^\d+\.\d+ +(prefill|decode|retired) ", shown(requests), re.M)
            assert requests.visible + 2 <= sent
            await pilot.press("down", "down")
            assert requests.first == 2 and "rows 3-" in shown(requests)
            await pilot.press("up")
            assert requests.first == 1
            await pilot.press("right")
            assert app.query_one("ContentSwitcher").current == "overview"
            await pilot.press("left")
            assert app.query_one("ContentSwitcher").current == "scheduler"
            await traffic
            await pilot.press("shift+tab")
            await wait_until(pilot, lambda: number_after("Completed / failed", shown(overview)) >= before + sent)

    asyncio.run(drive())


@pytest.mark.slow
def test_flare_run_on_a_terminal_shows_the_dashboard_and_ctrl_c_drains(core_dir: Path) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    flare = Path(sys.executable).with_name("flare")
    process = subprocess.Popen([str(flare), "run", str(core_dir), "--port", str(free_port())], stdin=slave,
                               stdout=slave, stderr=slave, env={**os.environ, "TERM": "xterm-256color"})
    os.close(slave)
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the last holder of the terminal has gone
                return
            if not data:
                return
            screen.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # Cells come each with its own escape sequences; without them the status line reads as text.
        while b"dropped updates" not in re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", bytes(screen)):
            assert process.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")
            time.sleep(0.2)
        os.write(master, b"\x03")
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(5)
        os.close(master)
    assert b"flare: stopping" in screen
