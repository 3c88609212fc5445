"""The terminal dashboard: subscribes to an engine's telemetry socket and shows the overview and scheduler panes.

Subscribing to the dashboard topic is what makes the engine record per-graph and per-request detail, so the
engine pays for it only while a dashboard is open. Ctrl-C raises SIGINT in this process: under `flare run` the
supervisor's handler then drains the server exactly as a terminal's Ctrl-C would, and asks this app to close.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import timedelta

import msgspec
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import ContentSwitcher, Footer, Log, Static

from common import protocol as wire
from common.dashboard.panes import GraphTable, Overview, RequestTable
from common.dashboard.relay import OutputRelay
from common.dashboard.view import TelemetryView
from common.links import FIXED_FRAME_BYTES, LinkKeys, subscriber

PANES = ("overview", "scheduler")
POLL_INTERVAL = 0.2  # how often the app checks for a stop request and new log lines
STALE_AFTER = 2.0  # seconds without a snapshot before the status line says so


class Dashboard(App[None]):
    TITLE = "flare"
    CSS = """
    #status { height: 1; background: $primary-background; }
    ContentSwitcher { height: 1fr; }
    #overview-numbers { height: auto; margin: 1 1 0 1; }
    #logs { height: 1fr; margin: 1 1 0 1; border-top: solid $secondary; }
    #graphs { height: auto; margin: 1 1 0 1; }
    #requests { height: 1fr; margin: 1 1 0 1; }
    """
    BINDINGS = [
        Binding("tab,right,left,shift+tab", "switch_pane", "switch pane", priority=True),
        Binding("up", "scroll_requests(-1)", "scroll", show=False),
        Binding("down", "scroll_requests(1)", "scroll", show=False),
        Binding("pageup", "scroll_requests(-10)", show=False),
        Binding("pagedown", "scroll_requests(10)", show=False),
        Binding("ctrl+c", "interrupt", "stop", priority=True),
    ]

    def __init__(self, telemetry_address: str, stop_requested: Callable[[], bool],
                 logs: OutputRelay | None = None, keys: LinkKeys | None = None) -> None:
        """`stop_requested` is polled: the app closes once it says so. `logs`: the children's output, if ours.
        `keys`: the deployment's link keys, when its engines run CURVE."""
        super().__init__()
        self.telemetry_address = telemetry_address
        self.keys = keys
        self.stop_requested = stop_requested
        self.logs = logs
        self._logs_seen = 0
        self.view = TelemetryView()
        self.received = 0.0  # monotonic time of the latest snapshot

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with ContentSwitcher(initial="overview"):
            with Vertical(id="overview"):
                yield Overview(self.view, id="overview-numbers")
                if self.logs is not None:
                    yield Log(max_lines=1000, id="logs")
            with Vertical(id="scheduler"):
                yield GraphTable(self.view, id="graphs")
                yield RequestTable(self.view, id="requests")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(POLL_INTERVAL, self._poll)
        self._follow()
        self._show_status()

    @work(exclusive=True)
    async def _follow(self) -> None:
        socket = subscriber(self.keys, FIXED_FRAME_BYTES, wire.TELEMETRY_DASHBOARD_TOPIC)
        socket.connect(self.telemetry_address)
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    self.view.update(wire.decode_telemetry(frames[-1]))
                except msgspec.MsgspecError:  # another version's engine: keep the last good sample on screen
                    continue
                self.received = time.monotonic()
                for pane in self.query("Overview, GraphTable, RequestTable"):
                    pane.refresh()
                self._show_status()
        finally:
            socket.close()

    def _poll(self) -> None:
        if self.stop_requested():
            self.exit()
            return
        if self.logs is not None and (log := self._widget("#logs", Log)) is not None:
            self._logs_seen, lines = self.logs.read_after(self._logs_seen)
            log.write_lines(line.rstrip("\n") for line in lines)
        self._show_status()

    def _widget(self, selector: str | type[Widget], kind: type[Widget] | None = None) -> Widget | None:
        """The widget, or None once the app is closing: its timer and the follower may tick after the widgets are
        gone, and a traceback then would be all the user sees of a clean exit."""
        try:
            return self.query_one(selector, kind)
        except NoMatches:
            return None

    def _show_status(self) -> None:
        switcher, status = self._widget(ContentSwitcher), self._widget("#status", Static)
        if switcher is None or status is None:
            return
        pane = switcher.current or PANES[0]
        tabs = "  ".join(f"[reverse] {p} [/]" if p == pane else f" {p} " for p in PANES)
        snapshot = self.view.latest
        if snapshot is None:
            state = f"waiting for {self.telemetry_address}"
        else:
            age = time.monotonic() - self.received
            state = (f"{snapshot.engine_id} · up {timedelta(seconds=int(snapshot.uptime_s))} · sample {age:.1f} s old"
                     f"{' (stale)' if age > STALE_AFTER else ''} · dropped updates {snapshot.dropped_updates:,}")
        status.update(f"{tabs}  {state}")

    def action_switch_pane(self) -> None:
        switcher = self.query_one(ContentSwitcher)
        switcher.current = PANES[(PANES.index(switcher.current or PANES[0]) + 1) % len(PANES)]
        self._show_status()

    def action_scroll_requests(self, delta: int) -> None:
        self.query_one(RequestTable).scroll_rows(delta)

    def action_interrupt(self) -> None:
        # The terminal delivers Ctrl-C as a key while the app holds it; turn it back into the signal it stands for.
        signal.raise_signal(signal.SIGINT)


def attach(engine_address: str, keys: LinkKeys | None = None) -> int:
    """`flare dashboard --engine ADDR`: watch a running engine until Ctrl-C (or SIGTERM)."""
    stop = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    Dashboard(wire.telemetry_address(engine_address), lambda: stop, keys=keys).run()
    return 0


def supervise(engine_address: str, stop_requested: Callable[[], bool], relay: OutputRelay,
              keys: LinkKeys | None = None) -> None:
    """`flare run` on a terminal: hold it with the dashboard until the supervisor stops (its own signal handlers
    still decide when), with the children's output shown inside and printed again afterwards."""
    relay.hold()
    try:
        Dashboard(wire.telemetry_address(engine_address), stop_requested, relay, keys).run()
    finally:
        relay.release()
