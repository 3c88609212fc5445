"""Soak: drive a real `flare run` with mixed traffic for a while, then check that nothing leaked or went missing.

    python -m tests.e2e.soak --core DIR [--minutes 10] [--replicas 2] [--frontends 2] [--attack]

Traffic, from several client threads at once: chat and completions (streamed and not), streams the client cuts after
a few chunks, requests cancelled by a short client timeout, long prompts (half the context), and every minute an
overload burst of many concurrent requests (429s and 503s expected there and only there).
Checks at the end (each printed; exit status 1 if any fails):
- RSS of every engine and frontend process at the end is less than 5% above its highest sample during the warm-up
  (samples every few seconds; with --attack the warm-up lasts until every attack kind has run once). Between
  samples a frontend's RSS moves by several percent with whatever it parsed last (a body of 500,000 stop strings
  and a burst of small requests leave its heaps differently full): a leak grows past that band, noise stays in it;
- every slot and page is back: no live, pending or retiring requests or pages, and free + cached pages as at start;
- no 5xx outside the bursts;
- the engines' counters add up to what the clients saw: admissions = completions + cancellations + failures, and
  completions >= the requests clients saw finish (a cut stream may still finish in the engine before its abort lands).
With --attack, an attacker runs beside the honest clients (tests/e2e/attacker.py) and the checks add: no 5xx to the
attacker, and honest requests finished during every attack kind's windows; a table compares the honest clients'
latency after the warm-up, and the slowest /health probe (one every half second), during each kind with the quiet
windows between them, and the slowest honest requests are listed with the attacks beside them.
Not part of CI (it takes minutes); needs psutil (installed with the ignition extra's accelerate).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import psutil

from common.supervisor import replica_address
from tests.e2e.attacker import BODY_LIMIT, BODY_TIMEOUT, Attacker, report
from tests.support.servers import Server

WARMUP_SECONDS = 60.0
WARMUP_SAMPLE_SECONDS = 5.0
BURST_EVERY = 60.0
BURST_SIZE = 96
API_KEY = "soak-key"


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.in_burst = threading.Event()
        self.timings: list[tuple[float, float, str]] = []  # start, end, outcome of every honest request
        self.bursts: list[tuple[float, float]] = []
        self.probes: list[tuple[float, float]] = []  # sent, seconds of every /health probe

    def add(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1


def scrape(base_url: str, replicas: int) -> dict[str, float]:
    """The /metrics totals, once every replica's telemetry has reached the frontend (a replica not heard from yet
    would be missing from the sums)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    while replicas > 1 and text.count("flare_engine_free_pages{") < replicas:
        time.sleep(0.5)
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    totals: Counter[str] = Counter()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            totals[re.sub(r"\{.*\}", "", name)] += float(value)  # summed over replicas
    return dict(totals)


def one_request(client: openai.OpenAI, model: str, kind: str, tally: Tally, long_prompt: str) -> None:
    """One client request of the given kind; its outcome and timing go to the tally."""
    start = time.monotonic()
    outcome = attempt(client, model, kind, tally, long_prompt)
    tally.add(outcome)
    with tally.lock:
        tally.timings.append((start, time.monotonic(), outcome))


def attempt(client: openai.OpenAI, model: str, kind: str, tally: Tally, long_prompt: str) -> str:
    try:
        if kind == "chat":
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a fact."}],
                                           max_tokens=random.randint(4, 32))
        elif kind == "completion-stream":
            for _ in client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, stream=True):
                pass
        elif kind == "cut-stream":
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count up."}],
                                                    max_tokens=200, stream=True)
            for i, _ in enumerate(stream):
                if i == 3:
                    stream.close()
                    return "cut by the client"
        elif kind == "cancelled":
            client.with_options(timeout=0.3).completions.create(model=model, prompt="Write an essay.",
                                                                max_tokens=300)
        elif kind == "long":
            client.completions.create(model=model, prompt=long_prompt, max_tokens=4)
        return f"{kind}: finished"
    except openai.APITimeoutError:
        return f"{kind}: timed out"
    except openai.APIStatusError as exc:
        return f"{exc.status_code}{' in burst' if tally.in_burst.is_set() else ''}"
    except openai.APIConnectionError:
        return "connection error"


def client_loop(base_url: str, model: str, until: float, tally: Tally, long_prompt: str, seed: int) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    rng = random.Random(seed)
    kinds = ["chat"] * 4 + ["completion-stream"] * 3 + ["cut-stream", "cancelled", "long"]
    while time.monotonic() < until:
        one_request(client, model, rng.choice(kinds), tally, long_prompt)


def health_loop(base_url: str, until: float, tally: Tally) -> None:
    """/health twice a second: how long a probe of the frontend's event loop waits while the server works."""
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < until:
            sent = time.monotonic()
            client.get(f"{base_url}/health")
            tally.probes.append((sent, time.monotonic() - sent))
            time.sleep(max(0.0, 0.5 - (time.monotonic() - sent)))


def burst_loop(base_url: str, model: str, until: float, tally: Tally) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    while time.monotonic() + BURST_EVERY < until:
        time.sleep(BURST_EVERY)
        tally.in_burst.set()
        start = time.monotonic()
        threads = [threading.Thread(target=one_request, args=(client, model, "chat", tally, ""))
                   for _ in range(BURST_SIZE)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(2.0)  # responses of the burst still draining count as the burst's
        tally.in_burst.clear()
        tally.bursts.append((start, time.monotonic()))


def process_name(process: psutil.Process) -> str:
    """`-m module` for Flare's processes; a worker started by `-c` code (multiprocessing's) is named by its parent."""
    def module(args: list[str]) -> str:
        return args[args.index("-m") + 1] if "-m" in args[:-1] else " ".join(args[1:3])

    args = process.cmdline()
    return module(args) if "-m" in args[:-1] else f"a worker of {module(process.parent().cmdline())}"


def rss(server: Server) -> dict[str, int]:
    """RSS by process, each named by its command line's module and pid (workers replaced meanwhile are left out)."""
    sizes = {}
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            sizes[f"{process_name(child)} ({child.pid})"] = child.memory_info().rss
        except psutil.Error:  # exited, or exited and not yet reaped
            pass
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--attack", action="store_true", help="run the attacker beside the clients")
    args = parser.parse_args(argv)
    attack_flags = ["--body-limit", str(BODY_LIMIT), "--body-timeout", str(BODY_TIMEOUT)] if args.attack else []
    server = Server(args.core, "--replicas", str(args.replicas), "--frontends", str(args.frontends), *attack_flags,
                    env={**os.environ, "FLARE_API_KEY": API_KEY})
    attacker = None
    try:
        model = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
                          ).json()["data"][0]["id"]
        start = scrape(server.base_url, args.replicas)
        total_pages = start["flare_engine_free_pages"] + start["flare_engine_cached_pages"]
        long_prompt = "lorem ipsum " * 700
        tally = Tally()
        until = time.monotonic() + args.minutes * 60
        threads = [threading.Thread(target=client_loop, args=(server.base_url, model, until, tally, long_prompt, i))
                   for i in range(args.clients)]
        threads.append(threading.Thread(target=burst_loop, args=(server.base_url, model, until, tally)))
        threads.append(threading.Thread(target=health_loop, args=(server.base_url, until, tally)))
        if args.attack:
            addresses = [replica_address(server.engine_address, r, args.replicas) for r in range(args.replicas)]
            attacker = Attacker(server.base_url, addresses, args.core, API_KEY, model, tally.in_burst)
            threads.append(threading.Thread(target=attacker.run, args=(until,)))
        for thread in threads:
            thread.start()
        warm = rss(server)
        warm_until = time.monotonic() + min(WARMUP_SECONDS, args.minutes * 30)
        while time.monotonic() < warm_until or (attacker is not None and not attacker.cycled.is_set()
                                                 and time.monotonic() < until):
            time.sleep(WARMUP_SAMPLE_SECONDS)
            warm = {name: max(size, warm.get(name, 0)) for name, size in rss(server).items()}
        warm_end = time.monotonic()
        trace = [rss(server)]  # a sample a minute: whether growth levels off, not only how much there was
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=60.0)
                trace.append(rss(server))
        time.sleep(3.0)  # aborts and retiring pages settle; the next telemetry snapshot lands
        end, final = scrape(server.base_url, args.replicas), rss(server)
    finally:
        server.stop()
    growth = {name: final[name] / warm[name] - 1 for name in warm if name in final}
    largest = max(growth, key=growth.get)
    server_errors = {k: v for k, v in tally.counts.items() if k.startswith("5") and "burst" not in k}
    settled = sum(end[f"flare_engine_{name}"] for name in ("live_requests", "pending_requests", "retiring_pages"))
    admitted = end["flare_engine_admissions_total"] - start["flare_engine_admissions_total"]
    ended = sum(end[f"flare_engine_{k}_total"] - start[f"flare_engine_{k}_total"]
                for k in ("completions", "cancellations", "failures"))
    completed = end["flare_engine_completions_total"] - start["flare_engine_completions_total"]
    finished = sum(v for k, v in tally.counts.items() if k.endswith(": finished"))
    checks = {
        f"RSS at the end < 5% over the warm-up's highest (max {growth[largest]:.1%}, {largest} "
        f"{warm[largest] >> 20} -> {final[largest] >> 20} MiB, over {len(growth)} processes)":
            max(growth.values()) < 0.05,
        f"slots and pages back (live+pending+retiring {settled:.0f}; pages "
        f"{end['flare_engine_free_pages'] + end['flare_engine_cached_pages']:.0f} of {total_pages:.0f})":
            settled == 0 and end["flare_engine_free_pages"] + end["flare_engine_cached_pages"] == total_pages,
        f"no 5xx outside bursts ({server_errors or 'none'})": not server_errors,
        f"admissions {admitted:.0f} = completions + cancellations + failures {ended:.0f}": admitted == ended,
        f"completions {completed:.0f} >= requests finished at clients {finished}": completed >= finished,
    }
    if attacker is not None:
        table, attack_checks = report(attacker, tally.timings, tally.bursts, warm_end, tally.probes)
        checks |= attack_checks
        print(table)
    print(f"client outcomes: {dict(sorted(tally.counts.items()))}")
    for name in sorted(warm, key=lambda n: -growth.get(n, 0)):
        print(f"RSS MiB of {name}: highest in the warm-up {warm[name] >> 20}; a sample a minute from its end: "
              f"{' '.join(str(sample[name] >> 20) for sample in trace if name in sample)}")
    for text, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {text}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
