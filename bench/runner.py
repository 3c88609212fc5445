"""Drive a workload against one server: Poisson arrivals or a concurrency cap, a progress bar, the records."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from bench.client import RequestRecord, fetch_model, send
from bench.datasets import Prompt
from bench.tokens import Tokens


@dataclass(frozen=True)
class Target:
    base_url: str
    endpoint: str
    model: str | None
    label: str


@dataclass(frozen=True)
class Traffic:
    request_rate: float          # requests per second, Poisson; inf sends everything at once
    max_concurrency: int | None  # in-flight cap, None for none
    ignore_eos: bool
    seed: int
    extra_body: dict | None = None  # fields merged into request bodies (--extra-body)
    extra_every: int = 1  # ... of every Nth request (--extra-body-every)

    def extra_for(self, index: int) -> dict | None:
        """The extra fields of request `index` (the probe's is -1: it gets them)."""
        return self.extra_body if index < 0 or index % self.extra_every == 0 else None


@dataclass
class Run:
    target: Target
    model: str
    started_at: float  # Unix time of the first timed request
    duration: float
    records: list[RequestRecord]


def arrival_gaps(rate: float, n: int, seed: int) -> list[float]:
    """Seconds to wait before each request: the first goes at once, the rest follow a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


def probe_prompt(first: Prompt, tokens: Tokens, traffic: Traffic) -> Prompt:
    """The first prompt's lengths with text of its own, so the timed run finds nothing the probe left in a cache."""
    rng = random.Random(-1 - traffic.seed)
    return Prompt(None, tokens.text(rng, first.input_len), first.input_len, first.output_len)


async def run_async(target: Target, prompts: list[Prompt], traffic: Traffic, tokens: Tokens) -> Run:
    # No connection cap: the workload's own concurrency is the only limit. A fresh connection per request: a server
    # may close a kept-alive one just as the next request is written to it (llama.cpp's server does), failing it.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = target.model or await fetch_model(session, target.base_url)
        # One request first, outside the timing: it proves the endpoint works and pays any lazy start-up cost.
        probe = await send(session, target.base_url, target.endpoint, model, probe_prompt(prompts[0], tokens, traffic),
                           -1, traffic.ignore_eos, tokens, time.perf_counter(), traffic.extra_for(-1))
        if not probe.ok:
            raise RuntimeError(f"{target.label}: the first request failed: {probe.error}")
        limit = asyncio.Semaphore(traffic.max_concurrency or len(prompts))
        bar = tqdm(total=len(prompts), desc=target.label, unit="req", disable=None)

        async def one(index: int, t0: float) -> RequestRecord:
            async with limit:
                record = await send(session, target.base_url, target.endpoint, model, prompts[index], index,
                                    traffic.ignore_eos, tokens, t0, traffic.extra_for(index))
            bar.update()
            return record

        started_at, t0 = time.time(), time.perf_counter()
        tasks = []
        for index, gap in enumerate(arrival_gaps(traffic.request_rate, len(prompts), traffic.seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(index, t0)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
    return Run(target, model, started_at, duration, records)


def run(target: Target, prompts: list[Prompt], traffic: Traffic, tokens: Tokens) -> Run:
    return asyncio.run(run_async(target, prompts, traffic, tokens))
