"""The dashboard's panes: widgets that render the TelemetryView as Rich tables; the app refreshes them per snapshot."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from common.dashboard.view import GONE_MARK, HISTORY_CELLS, TelemetryView, TrackedRequest
from common.protocol import RequestRow

WIDE_GRAPHS = 80  # columns from which the graph table adds max duration and requests per call
WIDE_REQUESTS = 100  # columns from which request rows add prompt, output, out ms and bursts
REQUEST_HEADER_LINES = 2  # the caption line and the table header


def _table(*columns: str) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


class Overview(Widget):
    """Throughput and the engine's totals."""

    def __init__(self, view: TelemetryView, **kwargs: str) -> None:
        super().__init__(**kwargs)
        self.view = view

    def render(self) -> RenderableType:
        snapshot = self.view.latest
        if snapshot is None:
            return Text("waiting for the engine's first snapshot")
        counters, gauges = snapshot.counters, snapshot.gauges
        prefill, generation = self.view.throughput()
        table = _table("", "", "", "")
        table.columns[2].justify = "left"
        table.add_row("Prefill", f"{prefill:,.1f} tok/s", "Active / queued",
                      f"{gauges.get('live_requests', 0):.0f} / {gauges.get('pending_requests', 0):.0f}")
        table.add_row("Generation", f"{generation:,.1f} tok/s", "Completed / failed",
                      f"{counters.get('completions', 0):,} / {counters.get('failures', 0):,}")
        table.add_row("Reused tokens", f"{counters.get('reused_tokens', 0):,}", "Cached / free pages",
                      f"{gauges.get('cached_pages', 0):,.0f} / {gauges.get('free_pages', 0):,.0f}")
        table.add_row("Last minute", f"{gauges.get('tokens_last_minute', 0):,.0f} tok", "Cancelled / rejected",
                      f"{counters.get('cancellations', 0):,} / {counters.get('rejections', 0):,}")
        acceptance = self.view.draft_acceptance()
        if acceptance is not None:
            table.add_row("Draft acceptance", f"{acceptance:.2f} tok/round", "", "")
        return table


class GraphTable(Widget):
    """Completions per captured graph over the engine's two-second window."""

    def __init__(self, view: TelemetryView, **kwargs: str) -> None:
        super().__init__(**kwargs)
        self.view = view

    def render(self) -> RenderableType:
        rows = self.view.graphs()
        dropped = self.view.latest.dropped_updates if self.view.latest else 0
        caption = Text(f"Graphs, last 2 s · dropped updates {dropped:,}", style="bold")
        if not rows:
            return Group(caption, Text("no graph completions in the window"))
        wide = self.size.width >= WIDE_GRAPHS
        table = _table("Graph", "Calls", "Mean ms", "Share", *(("Max ms", "Req/call") if wide else ()))
        for row in rows:
            cells = [row.label, f"{row.calls:,}", f"{row.mean_ms:.2f}", f"{row.share:.0%}"]
            if wide:
                cells += [f"{row.max_ms:.2f}", f"{row.requests_per_call:.1f}"]
            table.add_row(*cells)
        return Group(caption, table)


class RequestTable(Widget):
    """Request rows, scrolled by a row offset (up/down) so that twice-a-second redraws keep the position."""

    def __init__(self, view: TelemetryView, **kwargs: str) -> None:
        super().__init__(**kwargs)
        self.view = view
        self.first = 0

    @property
    def visible(self) -> int:
        return max(self.size.height - REQUEST_HEADER_LINES, 1)

    def scroll_rows(self, delta: int) -> None:
        tracked, queued = self.view.requests()
        self.first = min(max(self.first + delta, 0), max(len(tracked) + len(queued) - self.visible, 0))
        self.refresh()

    def render(self) -> RenderableType:
        tracked, queued = self.view.requests()
        rows = [_tracked_cells(t) for t in tracked] + [_queued_cells(r) for r in queued]
        self.first = min(self.first, max(len(rows) - self.visible, 0))
        shown = rows[self.first:self.first + self.visible]
        wide = self.size.width >= WIDE_REQUESTS
        live = sum(t.live for t in tracked)
        span = f"rows {self.first + 1}-{self.first + len(shown)} of {len(rows)}" if rows else "no rows"
        caption = Text(f"Requests: {live} live, {len(queued)} queued · {span} (up/down)", style="bold")
        table = _table("Request", "Phase", "Gap ms", f"History {HISTORY_CELLS // 2} s",
                       *(("Prompt", "Output", "Out ms", "Bursts") if wide else ()))
        table.columns[1].justify = table.columns[3].justify = "left"
        for cells in shown:
            table.add_row(*(cells if wide else cells[:4]))
        return Group(caption, table)


def _tracked_cells(tracked: TrackedRequest) -> list[str]:
    row = tracked.row
    if not tracked.live:
        return [f"{tracked.slot}.{tracked.generation}", "retired", "—", tracked.history,
                f"{row.prompt_done}/{row.prompt_len}", f"{row.outputs:,}", "—", f"{row.bursts:,}"]
    return [f"{tracked.slot}.{tracked.generation}", row.phase, f"{row.gap_ms:,.0f}", tracked.history,
            f"{row.prompt_done}/{row.prompt_len}", f"{row.outputs:,}", _ms(row.since_publish_ms), f"{row.bursts:,}"]


def _queued_cells(row: RequestRow) -> list[str]:
    return ["—", row.phase, f"{row.gap_ms:,.0f}", GONE_MARK * HISTORY_CELLS, f"{row.prompt_done}/{row.prompt_len}",
            f"{row.outputs:,}", _ms(row.since_publish_ms), f"{row.bursts:,}"]


def _ms(value: float) -> str:
    return "—" if value < 0 else f"{value:,.0f}"  # negative: nothing published yet
