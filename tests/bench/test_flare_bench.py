"""flare-bench run as a user runs it (the console script) against a real Flare server: the counts must add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import Server
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 8, 32, 16, 4


def flare_bench(*args: str) -> str:
    bench = Path(sys.executable).with_name("flare-bench")
    done = subprocess.run([str(bench), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def table_value(stdout: str, label: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in stdout.splitlines() if line.startswith(f"{label}:"))


def test_serve_counts_add_up(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    stdout = flare_bench("serve", "--base-url", server.base_url, "--num-prompts", str(PROMPTS),
                         "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                         "--max-concurrency", str(CONCURRENCY), "--ignore-eos", "--json", str(out))
    result = json.loads(out.read_text())
    metrics, records = result["metrics"], result["requests"]
    assert metrics["successful"] == PROMPTS and metrics["failed"] == 0 and len(records) == PROMPTS
    assert metrics["total_output_tokens"] == sum(r["output_tokens"] for r in records)
    assert metrics["total_input_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert 1 <= metrics["peak_concurrency"] <= CONCURRENCY
    for record in records:
        assert record["error"] is None and record["token_source"] == "usage"
        assert record["output_tokens"] == OUTPUT_LEN  # --ignore-eos: every request runs to max_tokens
        assert record["prompt_tokens"] >= INPUT_LEN  # the chat template adds its own tokens
        assert 0 < record["ttft"] <= record["e2e"]
        assert len(record["itl"]) <= record["output_tokens"] - 1  # a chunk carries one token or more
        assert record["ttft"] + sum(record["itl"]) <= record["e2e"]
    assert metrics["mean_ttft_ms"] <= metrics["mean_e2el_ms"]
    assert int(table_value(stdout, "Successful requests")) == PROMPTS
    assert int(table_value(stdout, "Total generated tokens")) == metrics["total_output_tokens"]


def test_compare_one_server_twice(server: Server, tmp_path: Path) -> None:
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    prompts = PROMPTS // 2
    stdout = flare_bench("compare", "--base-url", server.base_url, "--base-url", f"{server.base_url}/v1",
                         "--label", "first", "--label", "second", "--endpoint", "completions",
                         "--dataset", "shared-prefix", "--prefix-len", str(INPUT_LEN), "--num-groups", "2",
                         "--num-prompts", str(prompts), "--input-len", str(INPUT_LEN // 4),
                         "--output-len", str(OUTPUT_LEN // 2), "--max-concurrency", str(CONCURRENCY),
                         "--json", str(out), "--plot", str(png))
    runs = json.loads(out.read_text())["runs"]
    assert [run["label"] for run in runs] == ["first", "second"]
    for run in runs:
        assert run["metrics"]["successful"] == prompts
        assert run["metrics"]["total_output_tokens"] == sum(r["output_tokens"] for r in run["requests"])
    # Both runs sent the same prompts, so the server counted the same input.
    assert runs[0]["metrics"]["total_input_tokens"] == runs[1]["metrics"]["total_input_tokens"]
    header = stdout.splitlines()[len(runs)]
    assert [c.strip() for c in header.strip("|").split("|")] == ["metric", "first", "second", "second / first"]
    successful = next(line for line in stdout.splitlines() if line.startswith("| Successful requests"))
    assert successful.split("|")[-2].strip() == "1.00x"
    assert png.read_bytes().startswith(b"\x89PNG")


def test_extra_body_every_nth_request_goes_to_the_first_and_every_nth_after() -> None:
    from bench.runner import Traffic

    traffic = Traffic(float("inf"), None, True, 0, {"logprobs": 5}, extra_every=10)
    assert [i for i in range(25) if traffic.extra_for(i)] == [0, 10, 20]
    assert traffic.extra_for(-1) == {"logprobs": 5}  # the probe request


def test_extra_body_reaches_every_request(server: Server, tmp_path: Path) -> None:
    """--extra-body: here a regex no reply can complete within max_tokens, so every request runs to the end."""
    out = tmp_path / "extra.json"
    flare_bench("serve", "--base-url", server.base_url, "--endpoint", "completions", "--num-prompts", "4",
                "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--json", str(out),
                "--extra-body", json.dumps({"structured_outputs": {"regex": "[a-z]{200}"}}))
    records = json.loads(out.read_text())["requests"]
    assert [r["output_tokens"] for r in records] == [OUTPUT_LEN] * 4 and all(r["error"] is None for r in records)
    bench = Path(sys.executable).with_name("flare-bench")
    refused = subprocess.run([str(bench), "serve", "--base-url", server.base_url, "--num-prompts", "1",
                              "--extra-body", json.dumps({"structured_outputs": {"regex": "[a-z"}})],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "HTTP 400" in refused.stderr  # the probe request already says why


def test_latency_chain_times_every_hop(core_dir: Path) -> None:
    """bench/lab/host/latency_chain.py against the real frontend and engine loop: a row for each hop, in the path's order."""
    done = subprocess.run([sys.executable, "-m", "bench.lab.host.latency_chain", "--core", str(core_dir), "--requests", "3",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    hops = [line.split("|")[1].strip() for line in done.stdout.splitlines()[2:]]
    assert hops == ["client: request sent -> frontend: handler starts",
                    "frontend: handler starts -> frontend: prompt tokenized",
                    "frontend: prompt tokenized -> frontend: Submit sent",
                    "frontend: Submit sent -> engine: Submit decoded",
                    "engine: Submit decoded -> engine: step planned",
                    "engine: step planned -> engine: step submitted",
                    "engine: step submitted -> engine: completion polled",
                    "engine: completion polled -> engine: Outputs sent",
                    "engine: Outputs sent -> frontend: Outputs received",
                    "frontend: Outputs received -> frontend: stream opens",
                    "frontend: stream opens -> frontend: first event written",
                    "frontend: first event written -> client: first byte",
                    "total"]
