"""Structured output through the real engine loop on the GPU: where a constrained step's time goes, against free text
on the same executor (docs/gpu.md, 8b-c64-json).

    python3 -m bench.lab.gpu.constrained [--cores /dev/shm/cores] [--requests 128] [--concurrency 64]
        [--prompt 512] [--max-tokens 128]

An in-process engine (engine/core.py) over the graph executor of the Llama-3.1-8B synth core, fed by a client process
that speaks the wire protocol and keeps `--concurrency` requests in flight (bench/lab/host/constrained_loop.py's), as
the 8b-c64 and 8b-c64-json serving rows do without their HTTP frontends. Variants: free text; every request under the
8b-c64-json schema with late masks (the engine's way); the same with the masks computed with the step. Prints per
variant the output tokens a second; the GPU's busy share from the first step's start to the last one's end, and the
share of it spent waiting for late masks (a step's model graph done, its sampling not yet given its masks); decode
steps at the full concurrency: their GPU ms and mask wait; and the loop's host time a step in its parts (completions
published, masks computed, plans made, steps submitted, messages taken in).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import zmq

from bench.lab.gpu.serving import exit_on_sigterm, synth
from bench.lab.host.constrained_loop import json_constraint, served
from bench.lab.host.loop_engine import engine_on
from engine.executor.factory import gpu_step_tokens
from engine.executor.graph import GraphExecutor
from engine.main import cache_identity
from engine.model.loader import load_model
from engine.sampling.grammar import GrammarCompiler
from engine.scheduler.scheduler import RequestScheduler

MAX_ACTIVE = 256  # as the serving rows run (--max-active 256)
# The loop's parts, timed: (owner attribute, method, label); owner "" is the engine itself.
PARTS = (("", "publish_step", "publish"), ("", "_masks", "masks"), ("", "_ingest", "ingest"),
         ("scheduler", "plan", "plan"), ("executor", "submit", "submit"), ("executor", "give_masks", "give masks"),
         ("executor", "poll", "poll"))


class Timers:
    """Seconds spent in wrapped methods of one object each, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


class MaskWaits:
    """Events on the model stream after each step's model graph and before its sampling: the GPU's wait for late
    masks, per decode step."""

    def __init__(self, executor: GraphExecutor) -> None:
        self.waits: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # (rows, model done, sampling starts)
        self._model_done: dict[int, torch.cuda.Event] = {}
        stream = executor._model_stream
        launch_model, launch_sampling = executor._launch_model, executor._launch_sampling

        def model(fence, plan, layout, extras) -> None:
            launch_model(fence, plan, layout, extras)
            self._model_done[fence] = recorded(stream)

        def sampling(fence, plan, layout, extras) -> None:
            done = self._model_done.pop(fence, None)
            if done is not None and plan.kind == "decode":
                self.waits.append((len(plan.rows), done, recorded(stream)))
            launch_sampling(fence, plan, layout, extras)

        executor._launch_model, executor._launch_sampling = model, sampling

    def milliseconds(self) -> list[tuple[int, float]]:
        torch.cuda.synchronize()
        return [(rows, done.elapsed_time(starts)) for rows, done, starts in self.waits]


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def run(core: Path, model, manifest, executor: GraphExecutor, step_tokens: int, constrained: bool, late: bool,
        args: argparse.Namespace) -> dict:
    caps = manifest.capacities
    executor.late_masks = late
    executor.spans.clear()
    waits = MaskWaits(executor)
    scheduler = RequestScheduler(MAX_ACTIVE, caps.queue_capacity, executor.num_pages, caps.page_size, step_tokens,
                                 cache_identity(manifest, model.model.embed_tokens.weight.dtype), late_masks=late)
    grammars = GrammarCompiler((core / "tokenizer.json").read_text(), model.config.vocab_size,
                               manifest.eos_token_ids)
    context, address = zmq.Context(), f"ipc://{tempfile.mkdtemp()}/engine.sock"
    engine = engine_on(core, address, context, executor, scheduler, grammars)
    timers = Timers()
    for owner, name, label in PARTS:
        timers.wrap(getattr(engine, owner) if owner else engine, name, label)
    tokens, seconds = served(engine, address, args.requests, args.concurrency, args.max_tokens,
                             json_constraint() if constrained else None, args.prompt)
    grammars.close()
    context.destroy(linger=0)
    # (the executor's own methods again, for the next variant)
    for attribute in ("submit", "give_masks", "poll", "_launch_model", "_launch_sampling"):
        vars(executor).pop(attribute, None)
    spans = list(executor.spans)
    wall = spans[-1][1] - spans[0][0]
    waited = waits.milliseconds()
    full = [(end - start) for start, end, rows, kind in spans if kind == "decode" and rows == args.concurrency]
    full_waits = [ms for rows, ms in waited if rows == args.concurrency]
    steps = Counter(kind for _, _, _, kind in spans)
    return {"tok/s": tokens / seconds, "steps": steps, "busy": sum(end - start for start, end, _, _ in spans) / wall,
            "waiting": sum(ms for _, ms in waited) / wall, "full": statistics.median(full) if full else 0.0,
            "full wait": statistics.mean(full_waits) if full_waits else 0.0, "full steps": len(full),
            "host": {label: 1000 * s / max(len(spans), 1) for label, s in timers.seconds.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.lab.gpu.constrained", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=Path, default=Path("/dev/shm/flare-cores"))
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    core = synth("llama-3.1-8b", args.cores / "llama-3.1-8b", None)
    device = torch.device("cuda")
    manifest, model = load_model(core, device, verify=False)
    caps = manifest.capacities
    step_tokens = gpu_step_tokens(device, caps.prefill_chunk_size)
    pages = args.concurrency * -(-(args.prompt + args.max_tokens) // caps.page_size) * 2 + 16
    executor = GraphExecutor(model, pages, caps.page_size, MAX_ACTIVE, device, manifest.context_limit, step_tokens)
    print(f"## {args.requests} requests of {args.prompt} prompt tokens, {args.max_tokens} out, {args.concurrency} in "
          f"flight, through the engine loop on the GPU (Llama-3.1-8B synth, bf16)\n", flush=True)
    print("| variant | output tok/s | steps (decode, with prompts) | GPU busy | of it waiting for masks | "
          f"decode at {args.concurrency} rows: GPU ms (median), mask wait ms (mean), steps |")
    print("| --- | ---: | --- | ---: | ---: | --- |")
    hosts = {}
    for name, constrained, late in (("free text", False, True), ("constrained, late masks", True, True),
                                    ("constrained, masks with the step", True, False)):
        r = run(core, model, manifest, executor, step_tokens, constrained, late, args)
        hosts[name] = r["host"]
        steps = r["steps"]
        print(f"| {name} | {r['tok/s']:,.0f} | {steps['decode']}, {steps['extend']} | "
              f"{100 * r['busy']:.1f}% | {100 * r['waiting']:.1f}% | {r['full']:.2f}, {r['full wait']:.2f}, "
              f"{r['full steps']} |", flush=True)
    labels = [label for _, _, label in PARTS]
    print("\nThe loop's host time, ms a step:\n")
    print("| variant | " + " | ".join(labels) + " |")
    print("| --- |" + " ---: |" * len(labels))
    for name, host in hosts.items():
        print(f"| {name} | " + " | ".join(f"{host.get(label, 0.0):.3f}" for label in labels) + " |")
    executor.close()


if __name__ == "__main__":
    main()
