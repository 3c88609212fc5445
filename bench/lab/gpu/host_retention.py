"""Host retention on a GPU (docs/design.md, Host retention), printed as markdown tables: a Llama-3.1-8B synth core with
its device KV cache limited to 8 GiB, 200 conversations of 4,000-token histories, each revisited once in random order
after all were seen. Median time to the first token of the second turns with a host tier (restored from pinned host
memory; and of those alone whose whole history was covered), without one (recomputed), and of a second turn whose
pages are still on the device (a device hit); the host tier's restore bandwidth (a page's bytes over the engine's
median page copy time, /metrics) against the copy engine's measured host-to-device peak.

    python -m bench.lab.gpu.host_retention [--cores /dev/shm/flare-cores] [--host-gib 100] [--conversations 200]
        [--history 4000] [--disk-gib 0 --disk-dir DIR] [--out FILE] [--device cpu --core CORE --kv-gib 0.07]

The tiers must hold the conversations for the second turns to hit: 200 histories of 4,000 tokens are 98 GiB of the
8B's KV (128 KiB a token), so a host tier of 100 GiB alone wants a machine with more than 128 GiB of memory; on one
with 128 GiB (the core on /dev/shm takes 16 of them) a host tier of 60 GiB and a disk tier of 45 GiB below it hold
them (`--host-gib 60 --disk-gib 45`). With less, the table reports the share of second turns whose history was
covered. Every 50 turns a line gives the progress, the host's available memory and the disk tier's bytes; the run
ends itself if the available memory falls below 4 GiB.

With `--device cpu --core CORE` it runs a scale model on the CPU (the same turns and tiers over a small core and
small tiers, `--kv-gib` for the KV cache), which shows which conversations the tiers keep and how much of each second
turn they cover; the CPU's KV cache is host memory, so its times say little about a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import torch

from bench.lab.gpu.evidence import LINES, say
from bench.lab.gpu.serving import FlareServer, exit_on_sigterm, synth
from bench.lab.host.served import model_name
from common.manifest import load_manifest
from engine.executor.factory import available_memory

NEW_TOKENS = 32  # the second turn's new user tokens
ORDINARY_IDS = 128000  # prompts draw ids below this and the vocabulary's size (the Llama-3 special tokens lie above)
MEMORY_FLOOR = 4 << 30  # the run is ended when the host's available memory falls below this


class HostWatch(threading.Thread):
    """Samples the host's available memory and the disk tier's bytes every second. The run fills tens of GiB of
    both; below MEMORY_FLOOR it is ended (SIGTERM: its servers stop) rather than left to drive the machine into the
    OOM killer."""

    def __init__(self, disk_dir: Path | None) -> None:
        super().__init__(daemon=True)
        self.disk_dir = disk_dir
        self.low_memory = self.available = available_memory()
        self.disk = self.high_disk = 0

    def run(self) -> None:
        while True:
            self.available = available_memory()
            self.low_memory = min(self.low_memory, self.available)
            if self.disk_dir is not None and self.disk_dir.is_dir():
                self.disk = sum(f.stat().st_size for f in self.disk_dir.iterdir() if f.is_file())
                self.high_disk = max(self.high_disk, self.disk)
            if self.available < MEMORY_FLOOR:
                say(f"host memory available fell to {self.available / (1 << 30):.1f} GiB: ending the run")
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(1)

    def now(self) -> str:
        return f"memory available {self.available / (1 << 30):.1f} GiB, disk tier {self.disk / (1 << 30):.1f} GiB"


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("flare_engine_") and "{" not in line}


def first_token(url: str, tokens: list[int], max_tokens: int) -> tuple[float, int, str]:
    """Seconds to the first streamed token, the cached tokens reported, and the text (greedy)."""
    body = json.dumps({"model": model_name(url), "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    started, ttft, cached, out = time.perf_counter(), None, 0, ""
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                out += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, cached, out


def conversations(count: int, history: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(history)] for _ in range(count)]


def run(core: Path, flags: tuple[str, ...], histories: list[list[int]], vocab: int, log: Path, watch: HostWatch,
        device: str) -> dict:
    """Every first turn, then every second turn in random order, one at a time; `flags`: the KV cache's size and the
    host (and disk) tiers'. Progress goes to stdout every 50 turns."""
    server = FlareServer(core, flags, 18431, log, device)
    started = time.monotonic()

    def progress(turn: int, i: int) -> None:
        if (i + 1) % 50 == 0:
            print(f"{log.stem}: turn {turn}, {i + 1} of {len(histories)} after {time.monotonic() - started:.0f} s; "
                  f"{watch.now()}", flush=True)

    try:
        url = server.url
        for i, history in enumerate(histories):
            first_token(url, history, 1)
            progress(1, i)
        rng = random.Random(1)
        # The second turn: the history, then new tokens (a reply and a user message alike to the cache).
        seconds = [history + [rng.randrange(vocab) for _ in range(NEW_TOKENS)] for history in histories]
        order = list(range(len(histories)))
        rng.shuffle(order)
        ttfts, cached, covered, tokens = [], [], [], {}
        for n, i in enumerate(order):
            ttft, hit, out = first_token(url, seconds[i], 4)
            ttfts.append(ttft)
            cached.append(hit >= len(histories[i]) // 64 * 64)
            covered.append(min(hit / len(histories[i]), 1.0))
            tokens[i] = out
            progress(2, n)
        device_hit = statistics.median(first_token(url, seconds[order[-1]], 4)[0] for _ in range(5))
        whole = [ttft for ttft, hit in zip(ttfts, cached) if hit]
        return {"ttft": statistics.median(ttfts), "hits": sum(cached) / len(cached), "device_hit": device_hit,
                "whole_ttft": statistics.median(whole) if whole else 0.0, "whole": len(whole),
                "covered": sum(covered) / len(covered), "tokens": tokens, "metrics": metrics(url)}
    finally:
        server.stop()


def copy_engine_peak() -> float:
    """Host-to-device bytes per second from pinned memory, 1 GiB a copy."""
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    device = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        device.copy_(host, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        device.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return 10 * host.numel() / (start.elapsed_time(end) / 1000)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=Path, default=Path("/dev/shm/flare-cores"))
    parser.add_argument("--host-gib", type=float, default=100)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--history", type=int, default=4000)
    parser.add_argument("--disk-gib", type=float, default=0)
    parser.add_argument("--disk-dir", type=Path, default=Path("/tmp/flare-disk-cache"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--core", type=Path, help="a core to serve instead of the synth Llama-3.1-8B")
    parser.add_argument("--kv-gib", type=float, default=8.0)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    core = args.core or synth("llama-3.1-8b", args.cores / "llama-3.1-8b", None)
    vocab = min(int(load_manifest(core).config["vocab_size"]), ORDINARY_IDS)
    histories = conversations(args.conversations, args.history, vocab)
    logs = args.out.parent if args.out else Path(".")
    kv = ("--kv-cache-bytes", str(int(args.kv_gib * (1 << 30))))
    tiers = (*kv, "--host-cache-bytes", str(int(args.host_gib * (1 << 30))))
    if args.disk_gib:
        # A fresh directory: files of an earlier run of the same core would be found and read at the first turns.
        shutil.rmtree(args.disk_dir, ignore_errors=True)
        args.disk_dir.mkdir(parents=True)
        tiers += ("--disk-cache", str(args.disk_dir), "--disk-cache-bytes", str(int(args.disk_gib * (1 << 30))))
    watch = HostWatch(args.disk_dir if args.disk_gib else None)
    watch.start()
    retained = run(core, tiers, histories, vocab, logs / "host_retention_on.log", watch, args.device)
    recomputed = run(core, (*kv, "--host-cache-bytes", "0"), histories, vocab, logs / "host_retention_off.log", watch,
                     args.device)
    disk = f", disk tier {args.disk_gib:g} GiB" if args.disk_gib else ""
    say(f"## Host retention: {args.conversations} conversations of {args.history}-token histories, {core.name} on "
        f"{args.device}, device KV {args.kv_gib:g} GiB, host tier {args.host_gib:g} GiB{disk}\n")
    say("| second turns | median TTFT (ms) | whole history covered | history covered (mean) |")
    say("|---|---|---|---|")
    for name, result in (("host tier (restored)", retained), ("no host tier (recomputed)", recomputed)):
        say(f"| {name} | {1000 * result['ttft']:.1f} | {100 * result['hits']:.0f}% | {100 * result['covered']:.0f}% |")
    if retained["whole"]:
        say(f"| host tier, the {retained['whole']} whose history was covered | {1000 * retained['whole_ttft']:.1f} "
            f"| 100% | 100% |")
    say(f"| device hit | {1000 * retained['device_hit']:.1f} | 100% | 100% |")
    same = sum(retained["tokens"][i] == recomputed["tokens"][i] for i in retained["tokens"])
    say(f"\nSecond-turn replies equal with and without the host tier: {same} of {len(histories)}.\n")
    m = retained["metrics"]
    restores = m.get("flare_engine_host_restores_total", 0)
    page_bytes = m.get("flare_engine_host_bytes_in_total", 0) / restores if restores else 0.0
    copy = m.get("flare_engine_host_page_copy_seconds", 0.0)
    restore = page_bytes / copy if copy else 0.0
    peak = copy_engine_peak() if args.device == "cuda" else 0.0
    say("| restore GB/s (page / median copy) | copy engine H2D peak GB/s | host restores | spills | placed oldest "
        "| declined | disk reads | disk writes | disk declined | not written |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    say(f"| {restore / 1e9:.1f} | {peak / 1e9:.1f} | {restores:.0f}"
        f" | {m.get('flare_engine_host_spills_total', 0):.0f} | {m.get('flare_engine_host_placed_oldest_total', 0):.0f}"
        f" | {m.get('flare_engine_host_declined_total', 0):.0f}"
        f" | {m.get('flare_engine_disk_reads_total', 0):.0f} | {m.get('flare_engine_disk_writes_total', 0):.0f}"
        f" | {m.get('flare_engine_disk_declined_total', 0):.0f}"
        f" | {m.get('flare_engine_disk_unwritten_total', 0):.0f} |")
    say(f"\nHost memory available: {watch.low_memory / (1 << 30):.1f} GiB at the lowest; the disk tier's files: "
        f"{watch.high_disk / (1 << 30):.1f} GiB at the most.")
    if args.out:
        args.out.write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
