"""A hybrid model (Gated DeltaNet beside gated attention) on a GPU, against the attention-only model of its width,
printed as tables: decode step times, prefill throughput, and a second turn restored from a snapshot.

    python -m bench.lab.gpu.hybrid [--out FILE] [--only decode prefill restore] [--layers 8] [--pair qwen3.5]

Models have the shapes of `ignition synth` presets with random bf16 weights made on the GPU (bench.lab.gpu.families),
both cut to --layers decoder layers; --pair picks the hybrid and the attention-only model of its width:
- qwen3.5: Qwen3.5-9B (three linear-attention layers in four) against Qwen3-8B (the same hidden and MLP sizes);
- qwen3-next: Qwen3-Next-80B-A3B (hidden 2048, 512 experts, 10 routed a token and a shared one) against
  Qwen3-30B-A3B (hidden 2048, 128 experts, 8 routed a token).
- decode: graph (and eager) step time at batch 1, 64 and 256 over a 512-token context, and the bytes a step reads:
  weights, KV cache, and the hybrid's recurrent-state rows (read and written once per step).
- prefill: one prompt of 4,096 and of 32,768 tokens, graph steps of 8,192 tokens: time to its first token, tok/s.
- restore: a first turn (4,000-token prompt, message ends), then the second (prompt, reply, 200 more): its time to
  first token restoring the first turn's exact checkpoint (a state-row copy in the graph's frame) against a cold
  prompt of the same length, and the bytes of the copied row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.lab.gpu.evidence import CONTEXT, make, run_sections, say, step_times
from bench.lab.gpu.families import preset_model
from bench.lab.gpu.steps import wait, weight_bytes
from common.protocol import SamplingParams
from engine.executor.graph import GraphExecutor
from engine.model.recurrent_state import RecurrentState
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler

PAIRS = {"qwen3.5": ("qwen3.5-9b", "qwen3-8b"), "qwen3-next": ("qwen3-next-80b-a3b", "qwen3-30b-a3b")}
BATCHES = [1, 64, 256]
PREFILLS = [4096, 32768]
STEP_TOKENS = 8192
CONTEXT_LIMIT = 32768 + 1024
FIRST_TURN, MORE = 4000, 200


def decode(pair: tuple[str, str], layers: int) -> None:
    say(f"## Decode step time, {pair[0]} vs {pair[1]} ({layers} layers each, bf16, context {CONTEXT} tokens per "
        "sequence)")
    say("| model | batch | eager ms/step | graph ms/step (wall) | graph ms/step (GPU) | tokens/s (graph) | "
        "MB read a step | of which state rows |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset in pair:
        manifest, model = preset_model(preset, layers)
        c = model.config
        times = step_times(model, manifest, BATCHES, steps=30)
        kv = len(c.kv_layers) * 2 * c.num_kv_heads * c.head_dim * 2  # bytes a token's keys and values take
        row = RecurrentState.row_bytes(c, torch.bfloat16)
        for batch in BATCHES:
            eager, _ = times["eager"][batch]
            wall, gpu = times["graph"][batch]
            state = 2 * batch * row  # each row read and written
            total = weight_bytes(model) + batch * CONTEXT * kv + state
            say(f"| {preset} | {batch} | {eager:.2f} | {wall:.2f} | {gpu:.2f} | {batch / wall * 1000:.0f} | "
                f"{total / 1e6:.0f} | {state / 1e6:.0f} |")
        del model
        torch.cuda.empty_cache()
    say()


def first_token_seconds(executor, scheduler: RequestScheduler, prompt: list[int], ends: list[int] = (),
                        max_tokens: int = 1) -> tuple[float, Request]:
    """Wall seconds from the request's admission to its first token (then it runs to max_tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request(f"r{time.monotonic_ns()}", b"bench", len(prompt), list(prompt), params, 0, frozenset(),
                      max_tokens, time.monotonic(), message_ends=list(ends))
    started = time.perf_counter()
    scheduler.add(request)
    first = None
    while scheduler.has_work():
        while executor.can_submit() and (plan := scheduler.plan()) is not None:
            scheduler.commit(plan, executor.next_fence())
            executor.submit(plan)
        for plan, completion in wait(executor):
            assert completion.error is None, completion.error
            scheduler.complete(completion, plan)
        if first is None and len(request.tokens) > len(prompt):
            first = time.perf_counter() - started
    while not executor.can_submit():
        wait(executor)
    return first, request


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab - 8, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(pair: tuple[str, str], layers: int) -> None:
    say(f"## Prefill of one prompt, graphs, steps of {STEP_TOKENS} tokens ({layers} layers each, bf16)")
    say("| model | prompt tokens | time to first token ms | prompt tok/s |")
    say("| --- | --- | --- | --- |")
    for preset in pair:
        manifest, model = preset_model(preset, layers, context_limit=CONTEXT_LIMIT)
        page_size = manifest.capacities.page_size
        pages = -(-CONTEXT_LIMIT // page_size) + 8
        executor = make("graph", model, pages, page_size, 1, CONTEXT_LIMIT, STEP_TOKENS)
        for length in PREFILLS:
            runs = []
            for seed in range(3):  # the first run compiles nothing (captured at start) but warms the allocator
                scheduler = RequestScheduler(1, 64, pages, page_size, STEP_TOKENS)
                seconds, _ = first_token_seconds(executor, scheduler, prompt_of(length, seed, model.config.vocab_size))
                runs.append(seconds)
            best = min(runs[1:])
            say(f"| {preset} | {length} | {best * 1000:.1f} | {length / best:,.0f} |")
        executor.close()
        del model, executor
        torch.cuda.empty_cache()
    say()


def restore(pair: tuple[str, str], layers: int) -> None:
    hybrid = pair[0]
    manifest, model = preset_model(hybrid, layers, context_limit=CONTEXT_LIMIT)
    c, page_size = model.config, manifest.capacities.page_size
    row = RecurrentState.row_bytes(c, torch.bfloat16)
    snapshots, pages = 8, 4 * -(-(FIRST_TURN + 2 * MORE) // page_size) + 16
    executor = GraphExecutor(model, pages, page_size, 2, torch.device("cuda"), CONTEXT_LIMIT, STEP_TOKENS, snapshots)
    scheduler = RequestScheduler(2, 64, pages, page_size, STEP_TOKENS, snapshots=snapshots, snapshot_bytes=row)
    first = prompt_of(FIRST_TURN, 1, c.vocab_size)
    _, turn = first_token_seconds(executor, scheduler, first, [FIRST_TURN - 50, FIRST_TURN], max_tokens=16)
    second = turn.tokens + prompt_of(MORE, 2, c.vocab_size)
    restored, request = first_token_seconds(executor, scheduler, second)
    cold, cold_request = first_token_seconds(executor, scheduler, prompt_of(len(second), 3, c.vocab_size))
    executor.close()
    say(f"## Second turn of {len(second)} tokens, {hybrid} ({layers} layers, bf16, graphs): restored from the first "
        f"turn's snapshot vs cold")
    say("| turn | cached tokens | time to first token ms |")
    say("| --- | --- | --- |")
    say(f"| restored | {request.cached_tokens} | {restored * 1000:.1f} |")
    say(f"| cold | {cold_request.cached_tokens} | {cold * 1000:.1f} |")
    say(f"\nA state row (every linear-attention layer's conv inputs and delta-rule state): {row / 1e6:.1f} MB, "
        "copied once into the slot's row by the restore.")
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*", default=["decode", "prefill", "restore"],
                        choices=("decode", "prefill", "restore"))
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of each model (default 8)")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen3.5")
    args = parser.parse_args()
    pair = PAIRS[args.pair]
    say(f"# GPU evidence, hybrid models: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    sections = {"decode": lambda: decode(pair, args.layers), "prefill": lambda: prefill(pair, args.layers),
                "restore": lambda: restore(pair, args.layers)}
    run_sections(sections, args.only, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
