"""Embeddings per second through `/v1/embeddings` (docs/design.md, Embeddings): sequences of exactly `--length`
tokens (token ids, so every core sees the same lengths), sent as requests of `--batch` inputs each with
`--concurrency` requests in flight; one table row per (batch, concurrency) pair.

    python -m bench.lab.host.embeddings --core cores/smollm2-135m --pooling last     # starts `flare run`
    python -m bench.lab.host.embeddings --url http://127.0.0.1:8000                  # a server already running

Every sequence differs from the others from its first token, so no prefix is reused. Prints sequences, seconds,
sequences/s, prompt tokens/s and the mean latency of a request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

import aiohttp

from bench.lab.host.served import add_server_flags, print_rows, served

FIRST_ID, IDS = 100, 2000  # ids every real vocabulary holds


def sequence(index: int, length: int) -> list[int]:
    rng = random.Random(index)
    return [FIRST_ID + index % IDS] + [FIRST_ID + rng.randrange(IDS) for _ in range(length - 1)]


async def measure(url: str, model: str, sequences: int, length: int, batch: int, concurrency: int,
                  offset: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(session: aiohttp.ClientSession, first: int, count: int) -> int:
        body = {"model": model, "input": [sequence(first + i, length) for i in range(count)],
                "encoding_format": "base64"}
        async with session.post(f"{url}/v1/embeddings", json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"/v1/embeddings answered {response.status}: {payload}")
        return payload["usage"]["prompt_tokens"]

    async def run(session: aiohttp.ClientSession, first: int, count: int) -> int:
        async with limit:
            started = time.perf_counter()
            tokens = await one(session, first, count)
            latencies.append(time.perf_counter() - started)
            return tokens

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one(session, offset - batch, batch)  # warm-up, not counted
        started = time.perf_counter()
        tokens = await asyncio.gather(*(run(session, offset + first, min(batch, sequences - first))
                                        for first in range(0, sequences, batch)))
        elapsed = time.perf_counter() - started
    return {"inputs/request": batch, "requests in flight": concurrency, "sequences": sequences,
            "seconds": elapsed, "sequences/s": sequences / elapsed, "prompt tokens/s": sum(tokens) / elapsed,
            "latency/request s": sum(latencies) / len(latencies)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(parser, 8124)
    parser.add_argument("--pooling", choices=("last", "mean"), help="with --core: serve it with flare run --pooling "
                                                                     "(a generation core)")
    parser.add_argument("--sequences", type=int, default=256, help="sequences per row")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--rows", default="1x64,32x4", metavar="BxC,...",
                        help="rows of B inputs per request with C requests in flight")
    args = parser.parse_args(argv)
    rows = [tuple(int(n) for n in row.split("x")) for row in args.rows.split(",")]
    extra = args.flare_arg + (["--pooling", args.pooling] if args.pooling else [])
    with served(args, extra) as (url, model):
        results = [asyncio.run(measure(url, model, args.sequences, args.length, batch, concurrency,
                                       (i + 1) * 100_000)) for i, (batch, concurrency) in enumerate(rows)]
    print(f"model {model}, {args.length} tokens per sequence, {os.cpu_count()} CPUs here")
    print_rows(results)


if __name__ == "__main__":
    main()
