"""End-to-end serving on a GPU: the table of docs/gpu.md's targets, re-measured through `flare run` + `flare-bench`.

    python3 -m bench.lab.gpu.serving OUT_DIR [--rows NAME,...] [--cores DIR] [--layers N] [--before TREE] [--repeat N]

Each row starts the server its workload needs (synth cores of random bf16 weights, written once under --cores),
runs `flare-bench serve` against it (completions endpoint, --ignore-eos) and prints the figure beside its target.
Rows that share a server run back to back on it; beside its figure a row prints the mean TTFT as the client saw
it, as the server measured it (frontend arrival to first token) and the engine's mean queue time (arrival to first
step), and per step kind the steps it ran (launches, mean GPU ms, mean tokens), all but the first from /metrics. A
row's JSON report lands in OUT_DIR. Needs a CUDA GPU (two for the `tp2-*` and `replicas2-*` rows) and Flare's
dependencies installed beside torch (`pip install -e '.[cuda13]'`, or the extra of torch's CUDA major). `--device
cpu` runs a row on the CPU, to check the script itself.

Before and after in one run: `--before TREE` names another Flare checkout (`git worktree add /tmp/before REF`, or
`git archive REF | tar -x -C /tmp/before`); each server group is served from it, then from this checkout, on the same
core, and a table gives every figure of both and their ratio. `--repeat N` runs each row N times on its server, so
the table shows the spread of runs that changed nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.protocol import STEP_KINDS

HERE = Path(__file__).resolve().parents[3]  # this checkout
BENCH = "import sys; from bench.main import main; sys.exit(main())"  # flare-bench, uninstalled
# A row's core: its `ignition synth` preset, layers (None: all of them) and `--quant` (None: bf16). Qwen3-30B-A3B
# keeps 24 of its 48 layers, the size its vLLM comparison in docs/gpu.md ran at.
PRESETS = {"llama-8b": ("llama-3.1-8b", None, None), "qwen3-8b": ("qwen3-8b", None, None),
           "smollm2": ("smollm2-135m", None, None), "qwen3-30b-a3b": ("qwen3-30b-a3b", 24, None),
           "llama-8b-fp8": ("llama-3.1-8b", None, "fp8"), "qwen3-30b-a3b-fp8": ("qwen3-30b-a3b", 24, "fp8"),
           "llama-70b-fp8": ("llama-3.1-70b", None, "fp8")}


@dataclass(frozen=True)
class Row:
    name: str
    core: str  # a PRESETS key
    server: tuple[str, ...]  # flags for `flare run`
    bench: tuple[str, ...]  # flags for `flare-bench serve`
    figures: tuple[str, ...]  # keys of the bench summary to print
    target: str


def bench(*flags: str) -> tuple[str, ...]:
    return ("--endpoint", "completions", "--ignore-eos", "--seed", "0", *flags)


MAX256 = ("--max-active", "256")
MAX64 = ("--max-active", "64")
BATCH1 = bench("--input-len", "512", "--output-len", "256", "--num-prompts", "8", "--max-concurrency", "1")
MIXED256 = bench("--input-len", "562", "--range-ratio", "0.82", "--output-len", "256", "--num-prompts", "256")
X768 = bench("--input-len", "1024", "--output-len", "256", "--num-prompts", "768", "--max-concurrency", "256")
SHAREGPT8 = bench("--dataset", "sharegpt-synthetic", "--input-len", "256", "--output-len", "128",
                  "--num-prompts", "256", "--request-rate", "8")
LONG32K = bench("--input-len", "32000", "--output-len", "128", "--num-prompts", "8", "--max-concurrency", "8")
C64 = bench("--input-len", "512", "--output-len", "128", "--num-prompts", "128", "--max-concurrency", "64")
SHARED16 = bench("--dataset", "shared-prefix", "--prefix-len", "2000", "--num-groups", "16", "--input-len", "128",
                 "--output-len", "128", "--num-prompts", "1024", "--max-concurrency", "64")
# Structured output: every request constrained by a schema that cannot complete within 128 tokens (at least 40
# objects of three fields), so all of them run to max_tokens through structural tokens, as the unconstrained row does.
ITEM = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                                         "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"],
        "additionalProperties": False}
JSON64 = json.dumps({"response_format": {"type": "json_schema", "json_schema": {"name": "items", "schema": {
    "type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 40}},
    "required": ["items"], "additionalProperties": False}}}})
ROWS = [
    Row("8b-batch1", "llama-8b", MAX256, BATCH1, ("mean_tpot_ms",), "mean TPOT <= 4.0 ms"),
    Row("8b-mixed256", "llama-8b", MAX256, MIXED256, ("output_throughput",), ">= 8,000 output tok/s"),
    Row("8b-1024x768", "llama-8b", MAX256, X768, ("total_token_throughput",), ">= 35,000 total tok/s"),
    Row("8b-sharegpt", "llama-8b", MAX256, SHAREGPT8, ("median_ttft_ms", "median_tpot_ms"),
        "median TTFT <= 20 ms, median TPOT <= 5 ms"),
    Row("8b-1024x768-chunk512", "llama-8b", ("--max-batched-tokens", "512", *MAX256), X768,
        ("total_token_throughput",), "(512-token steps, the default before 2026-12-01)"),
    Row("8b-c64", "llama-8b", MAX256, C64, ("output_throughput",), "(tp 1 yardstick for the tp2 and qwen3 rows)"),
    # Copy proposals on traffic that random weights make unpredictable: what `--speculative auto` may cost a GPU.
    Row("8b-sharegpt-ngram", "llama-8b", ("--speculative", "ngram", *MAX256), SHAREGPT8,
        ("median_ttft_ms", "median_tpot_ms"), "(--speculative ngram: no slower than 8b-sharegpt)"),
    Row("8b-c64-ngram", "llama-8b", ("--speculative", "ngram", *MAX256), C64,
        ("output_throughput",), "(--speculative ngram: no slower than 8b-c64)"),
    # Sampling extras inside the graphs (engine/sampling/graph_extras.py): every 10th request of 8b-c64 asks. Each
    # row draws prompts of its own (--seed): on the server 8b-c64 ran on, its prompts would come from the prefix cache.
    *[Row(f"8b-c64-{name}", "llama-8b", MAX256, (*C64, "--seed", seed, "--extra-body", json.dumps(body),
                                                 "--extra-body-every", "10"),
          ("output_throughput", "failed"), f">= 90% of 8b-c64 (every 10th request asks {asks})")
      for name, body, asks, seed in (("logprobs", {"logprobs": 5}, "logprobs=5", "1"),
                                     ("penalties", {"repetition_penalty": 1.1}, "repetition_penalty=1.1", "2"))],
    Row("8b-c64-json", "llama-8b", MAX256,
        bench("--input-len", "512", "--output-len", "128", "--num-prompts", "128", "--max-concurrency", "64",
              "--seed", "3", "--extra-body", JSON64),
        ("output_throughput", "failed"), ">= 85% of 8b-c64 (every request constrained by a JSON schema)"),
    Row("8b-short64", "llama-8b", MAX64,
        bench("--input-len", "64", "--output-len", "8", "--num-prompts", "8", "--max-concurrency", "1"),
        ("median_ttft_ms",), "(the 64-token prompt alone: the prefix row's yardstick)"),
    Row("8b-prefix16k", "llama-8b", MAX64,
        bench("--dataset", "shared-prefix", "--prefix-len", "16000", "--num-groups", "1", "--input-len", "64",
              "--output-len", "8", "--num-prompts", "8", "--max-concurrency", "1"),
        ("median_ttft_ms",), "median TTFT <= 1.3x the 64-token prompt's"),
    Row("8b-32k", "llama-8b", MAX64, LONG32K, ("mean_ttft_ms", "mean_tpot_ms"),
        "mean TTFT <= 4.5 s, mean TPOT <= 35 ms"),
    # The same with another step budget (the H200's default is 8,192 prompt tokens a step): where first tokens trade
    # against the decoders' steps, which share every step with a prompt's chunk while the eight prompts load.
    *(Row(f"8b-32k-step{tokens}", "llama-8b", ("--max-batched-tokens", str(tokens), *MAX64), LONG32K,
          ("mean_ttft_ms", "mean_tpot_ms"), "against 8b-32k") for tokens in (2048, 4096)),
    # The same workload over an FP8 KV cache: decode reads half the KV bytes.
    Row("8b-32k-fp8kv", "llama-8b", ("--kv-cache-dtype", "fp8", *MAX64), LONG32K, ("mean_ttft_ms", "mean_tpot_ms"),
        "mean TPOT below 8b-32k's"),
    Row("smollm2-batch1", "smollm2", MAX256, BATCH1, ("mean_tpot_ms",), "<= 0.66 ms per output token"),
    Row("smollm2-mixed256", "smollm2", MAX256, MIXED256, ("output_throughput", "failed"), ">= 20,000 output tok/s"),
    Row("qwen3-8b-batch1", "qwen3-8b", MAX256, BATCH1, ("mean_tpot_ms",), "within 10% of 8b-batch1"),
    Row("qwen3-8b-c64", "qwen3-8b", MAX256, C64, ("output_throughput",), "within 10% of 8b-c64"),
    # Mixture of experts: prompt steps of the whole step budget route 65,536 token-expert pairs.
    Row("moe-batch1", "qwen3-30b-a3b", MAX256, BATCH1, ("mean_tpot_ms", "failed"), "0 failed (vLLM 0.26.0: 2.19 ms)"),
    Row("moe-c64", "qwen3-30b-a3b", MAX256, C64, ("output_throughput", "failed"),
        "0 failed (vLLM 0.26.0: 2,968 tok/s)"),
    Row("moe-mixed256", "qwen3-30b-a3b", MAX256, MIXED256, ("output_throughput", "failed"), "0 failed"),
    *[Row(name, "llama-8b", (*server, *MAX256), SHARED16, ("total_token_throughput", "mean_ttft_ms", "hit_rate"),
          target) for name, server, target in (
        ("replicas2-prefix", ("--replicas", "2"), "prefix routing: hit rate near the workload's share of prefix"),
        ("replicas2-rr", ("--replicas", "2", "--routing", "round-robin"), "(round-robin yardstick)"),
        ("replicas1-shared", (), "(one replica: the scaling factor's yardstick)"))],
    Row("tp2-batch1", "llama-8b", ("--tp", "2", *MAX256),
        bench("--input-len", "512", "--output-len", "128", "--num-prompts", "8", "--max-concurrency", "1"),
        ("mean_tpot_ms",), "mean TPOT <= 3.0 ms"),
    Row("tp2-c64", "llama-8b", ("--tp", "2", *MAX256), C64, ("output_throughput",), ">= 1.5x 8b-c64"),
    # FP8 weights (e4m3, a scale per output channel), against the bf16 rows of the same workloads.
    Row("8b-fp8-batch1", "llama-8b-fp8", MAX256, BATCH1, ("mean_tpot_ms",), "mean TPOT <= 2.6 ms"),
    Row("8b-fp8-c64", "llama-8b-fp8", MAX256, C64, ("output_throughput",), ">= 1.4x 8b-c64"),
    Row("8b-fp8-1024x768", "llama-8b-fp8", MAX256, X768, ("total_token_throughput",), ">= 1.4x 8b-1024x768"),
    Row("8b-fp8-32k-fp8kv", "llama-8b-fp8", ("--kv-cache-dtype", "fp8", *MAX64), LONG32K,
        ("mean_ttft_ms", "mean_tpot_ms"), "mean TPOT <= 30 ms"),
    # FP8 experts (the fused MoE kernels dequantize e4m3 tiles in registers), against moe-batch1 and moe-c64.
    Row("moe-fp8-batch1", "qwen3-30b-a3b-fp8", MAX256, BATCH1, ("mean_tpot_ms", "failed"), "below moe-batch1"),
    Row("moe-fp8-c64", "qwen3-30b-a3b-fp8", MAX256, C64, ("output_throughput", "failed"), "above moe-c64"),
    # Llama-3.1-70B's shapes in FP8, all 80 layers on one GPU (a core of about 68 GiB: /dev/shm must hold it): a step
    # reads 68.4 GB of e4m3 products and the bf16 LM head's 2.1 GB, 16.4 ms at a copy bandwidth of 4.29 TB/s.
    Row("70b-fp8-batch1", "llama-70b-fp8", MAX64, BATCH1, ("mean_tpot_ms", "failed"), "mean TPOT <= 18.9 ms"),
    Row("70b-fp8-c64", "llama-70b-fp8", MAX64, C64, ("output_throughput", "failed"), "serves, 0 failed"),
]


def synth(preset: str, target: Path, layers: int | None, quant: str | None = None) -> Path:
    if not (target / "manifest.json").is_file():
        started = time.monotonic()
        command = [sys.executable, "-m", "ignition.main", "synth", "--preset", preset, "--dtype", "bfloat16",
                   "--force", str(target)] + (["--layers", str(layers)] if layers else []) + \
                  (["--quant", quant] if quant else [])
        subprocess.run(command, check=True)
        print(f"# synth {preset} -> {target} in {time.monotonic() - started:.0f}s", flush=True)
    return target


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a job's stop) ends the run through its finally blocks, which stop the servers it
    started: killed outright, it would leave `flare run` serving, holding the GPU and the host memory."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class FlareServer:
    """`flare run` from a Flare checkout (`tree`: its root, whose packages the server imports)."""

    def __init__(self, core: Path, flags: tuple[str, ...], port: int, log: Path, device: str, tree: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
        self.process = subprocess.Popen([sys.executable, "-m", "common.cli", "run", str(core), "--port", str(port),
                                         "--device", device, *flags], stdout=self._log, stderr=subprocess.STDOUT,
                                        cwd=tree, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flare run exited: see {log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError("flare run did not become healthy")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(120)
        self._log.close()


LATENCY_METRICS = {"server_ttft": "flare_time_to_first_token_seconds", "queue": "flare_engine_queue_time_seconds"}
STEP_PARTS = ("launches", "step_microseconds", "step_tokens")


def server_totals(url: str) -> dict[str, float]:
    """Sums over every label set of the server's metrics a row reads: the first-token and engine-queue histograms'
    sums and counts, whose deltas over a row split its TTFT into the client and HTTP's part, the frontend and
    engine's, and the wait for a step; and per step kind the engine's launches, step microseconds and step tokens,
    whose deltas say where the row's GPU time went."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    keys = {f"{name}_{suffix}": f"{key}_{suffix}" for key, name in LATENCY_METRICS.items()
            for suffix in ("sum", "count")}
    keys.update({f"flare_engine_{part}_{kind}_total": f"{part}_{kind}" for part in STEP_PARTS for kind in STEP_KINDS})
    totals = dict.fromkeys(keys.values(), 0.0)
    for line in text.splitlines():
        key = keys.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def step_summary(delta: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per step kind the row ran: launches, total ms and tokens, from the deltas of server_totals."""
    return {kind: {"launches": delta[f"launches_{kind}"], "ms": delta[f"step_microseconds_{kind}"] / 1000,
                   "tokens": delta[f"step_tokens_{kind}"]} for kind in STEP_KINDS if delta[f"launches_{kind}"]}


def server_groups(rows: list[Row]) -> list[list[Row]]:
    """Consecutive rows that share a core and server flags: one server each."""
    groups: list[list[Row]] = []
    for row in rows:
        if groups and (groups[-1][0].core, groups[-1][0].server) == (row.core, row.server):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def run_row(row: Row, server: FlareServer, core: Path, report: Path, run: int = 0) -> dict:
    """One run of a row; a repeated run draws prompts of its own, which the server has not cached."""
    seed = int([row.bench[i + 1] for i, flag in enumerate(row.bench) if flag == "--seed"][-1])  # the last counts
    before = server_totals(server.url)
    subprocess.run([sys.executable, "-c", BENCH, "serve", "--base-url", server.url, "--tokenizer", str(core),
                    "--json", str(report), *row.bench, "--seed", str(seed + 1000 * run)], check=True,
                   stdout=subprocess.DEVNULL, cwd=HERE)
    summary = json.loads(report.read_text())["metrics"]
    summary["hit_rate"] = summary["cached_input_tokens"] / max(summary["total_input_tokens"], 1)
    time.sleep(1.0)  # the engine publishes its counters twice a second: the row's last steps are then in
    after = server_totals(server.url)
    delta = {key: after[key] - before[key] for key in after}
    for key in LATENCY_METRICS:  # means over the row: the server's view beside the client's
        count = delta[f"{key}_count"]
        summary[f"{key}_mean_ms"] = delta[f"{key}_sum"] / count * 1000 if count else None
    summary["steps"] = step_summary(delta)
    return summary


def run_rows(rows: list[Row], cores: Path, out: Path, layers: int | None, device: str,
             trees: dict[str, Path], repeat: int = 1) -> dict[str, list[tuple[Row, dict]]]:
    """Per tree (label: checkout), each row's summaries, `repeat` runs each. The trees take turns server by server,
    so that their runs of a row are minutes apart, not the whole run."""
    results: dict[str, list[tuple[Row, dict]]] = {label: [] for label in trees}
    for group in server_groups(rows):
        preset, preset_layers, quant = PRESETS[group[0].core]
        core = synth(preset, cores / group[0].core, layers or preset_layers, quant)
        for label, tree in trees.items():
            folder = out / label if len(trees) > 1 else out
            folder.mkdir(parents=True, exist_ok=True)
            server = FlareServer(core, group[0].server, 8000, folder / f"server-{group[0].name}.log", device, tree)
            try:
                for row in group:
                    for run in range(repeat):
                        suffix = f"-{run + 1}" if repeat > 1 else ""
                        summary = run_row(row, server, core, folder / f"{row.name}{suffix}.json", run)
                        results[label].append((row, summary))
                        prefix = f"{label} " if len(trees) > 1 else ""
                        print(f"{prefix}{row.name + suffix:18} " + describe(row, summary), flush=True)
            finally:
                server.stop()
    return results


def describe(row: Row, summary: dict) -> str:
    steps = ", ".join(f"{kind} {s['launches']:.0f} x {s['ms'] / s['launches']:.2f} ms "
                      f"({s['tokens'] / s['launches']:.0f} tokens)" for kind, s in summary["steps"].items())
    return ("  ".join(f"{k}={summary.get(k)}" for k in row.figures) +
            f"  (mean TTFT: client {summary.get('mean_ttft_ms')}, server {summary['server_ttft_mean_ms']}, "
            f"engine queue {summary['queue_mean_ms']}; steps: {steps or 'not counted by this tree'})")


def figure(value: object) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def table(results: list[tuple[Row, dict]]) -> str:
    lines = ["| row | measured | target |", "| --- | --- | --- |"]
    for row, summary in results:
        measured = ", ".join(f"{k} {figure(summary.get(k))}" for k in row.figures)
        lines.append(f"| {row.name} | {measured} | {row.target} |")
    return "\n".join(lines)


def comparison(results: dict[str, list[tuple[Row, dict]]]) -> str:
    """Each row's figures from every tree, each run of a repeated row, and each tree's mean against the first's."""
    labels = list(results)
    lines = ["| row | figure | " + " | ".join(labels) + " | " + " | ".join(f"{b} / {labels[0]}" for b in labels[1:])
             + " |", "| --- | --- |" + " --- |" * (2 * len(labels) - 1)]
    rows = list(dict.fromkeys(row for row, _ in results[labels[0]]))
    for row in rows:
        for key in row.figures:
            runs = {label: [summary.get(key) for r, summary in results[label] if r == row] for label in labels}
            cells = [", ".join(figure(v) for v in runs[label]) for label in labels]
            means = {label: statistics.mean(v) for label, v in runs.items()
                     if v and all(isinstance(x, (int, float)) for x in v)}
            ratios = [f"{means[b] / means[labels[0]]:.3f}" if b in means and means.get(labels[0]) else ""
                      for b in labels[1:]]
            lines.append(f"| {row.name} | {key} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.lab.gpu.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", help=f"comma-separated, from: {', '.join(r.name for r in ROWS)} (default: all)")
    parser.add_argument("--cores", type=Path, default=Path("/dev/shm/flare-cores"))
    parser.add_argument("--layers", type=int, help="reduce every synth core to this many layers (quick checks)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the script itself")
    parser.add_argument("--before", type=Path,
                        help="another Flare checkout (a `git worktree` or `git archive` of an earlier commit): every "
                             "server group runs from it, then from this one, and a table compares the two")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row on its server (the run-to-run spread)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    wanted = args.rows.split(",") if args.rows else [r.name for r in ROWS]
    unknown = set(wanted) - {r.name for r in ROWS}
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    if args.before is not None and not (args.before / "common" / "cli.py").is_file():
        parser.error(f"--before {args.before}: not a Flare checkout")
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before.resolve(), "after": HERE} if args.before else {"this": HERE}
    results = run_rows([r for r in ROWS if r.name in wanted], args.cores, args.out, args.layers, args.device, trees,
                       args.repeat)
    text = comparison(results) if args.before or args.repeat > 1 else table(results["this"])
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
