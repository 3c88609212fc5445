"""`flare-bench compare`: the same prompts against several servers, one after the other, in one table."""

from __future__ import annotations

from bench.datasets import Prompt
from bench.metrics import summarize
from bench.report import SECTIONS, cell
from bench.runner import Run, Target, Traffic, run
from bench.tokens import Tokens


def run_all(targets: list[Target], prompts: list[Prompt], traffic: Traffic, tokens: Tokens) -> list[Run]:
    # One at a time: servers sharing a machine would otherwise compete for it and distort each other.
    return [run(target, prompts, traffic, tokens) for target in targets]


def ratio(value: float | int | None, base: float | int | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def compare_table(runs: list[Run]) -> str:
    """One column per server, then each server's ratio to the first."""
    summaries = [summarize(run.records, run.duration) for run in runs]
    labels = [run.target.label for run in runs]
    header = ["metric", *labels, *[f"{label} / {labels[0]}" for label in labels[1:]]]
    body = [[label, *[cell(s[key], fmt) for s in summaries],
             *[ratio(s[key], summaries[0][key]) for s in summaries[1:]]]
            for _, rows in SECTIONS for key, label, fmt in rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *[line(row) for row in body]])
