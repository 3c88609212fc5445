"""Speculative decoding on a GPU (docs/speculative.md, Evidence), for the lead to run on an H200:

1. verify-step time against width W = 1, 2, 4, 8 at batch 1, 16, 64 (a Llama 3.1 8B synth core, bf16): W = 1 is the
   plain decode step (graph and eager), W > 1 a verify step of B requests with W target positions each;
2. the mechanism's ceiling: at batch 1, a proposer that replays the target's own greedy continuation (acceptance
   100%) at a fixed depth D = 0..7, output tokens per second against D, through the real scheduler.

    python -m bench.gpu_speculative [--cores cores] [--out gpu_speculative.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.gpu_evidence import core, say, LINES
from bench.gpu_steps import decode_plan, generate, time_steps
from common.protocol import SamplingParams
from engine.executor.eager import EagerExecutor
from engine.executor.graph import GraphExecutor
from engine.model.loader import load_model
from engine.scheduler.plan import Plan, Row
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler

CONTEXT, PAGE, MAX_ACTIVE = 1024, 64, 256  # decode graphs up to 256 rows: verify steps of B x W <= 256
WIDTHS, BATCHES = (1, 2, 4, 8), (1, 16, 64)


def verify_plan(batch: int, width: int, context: int) -> Plan:
    """`batch` requests each verifying width - 1 drafts after position context - 1 (fixed draft tokens)."""
    pages = -(-(context + width) // PAGE)
    greedy = SamplingParams(temperature=0.0)
    return Plan(tuple(Row(slot, 1, context - 1, width, tuple(range(100, 100 + width)),
                          tuple(range(slot * pages, (slot + 1) * pages)), True, 0, greedy, 0, context - 1,
                          draft=tuple(range(101, 100 + width))) for slot in range(batch)))


def width_sweep(target: Path) -> None:
    say("## Verify-step time against width (ms per step, two steps in flight)\n")
    _, model = load_model(target, torch.device("cuda"))
    pages = max(BATCHES) * -(-(CONTEXT + 8) // PAGE)
    graphs = GraphExecutor(model, pages, PAGE, MAX_ACTIVE, torch.device("cuda"), CONTEXT + 64, 512)
    eager = EagerExecutor(model, 1, PAGE, MAX_ACTIVE, torch.device("cuda"))
    eager.kv_cache = graphs.kv_cache
    say("| batch | decode graph | decode eager | " + " | ".join(f"verify w{w}" for w in WIDTHS[1:]) + " |")
    say("|---|---|---|" + "---|" * (len(WIDTHS) - 1))
    for batch in BATCHES:
        cells = [time_steps(graphs, decode_plan(batch, CONTEXT, PAGE), 20),
                 time_steps(eager, decode_plan(batch, CONTEXT, PAGE), 10)]
        # Verify rows run in the decode graphs while B x W fits the largest, else through the eager step.
        cells += [time_steps(graphs, verify_plan(batch, w, CONTEXT), 10) for w in WIDTHS[1:]]
        say(f"| {batch} | " + " | ".join(f"{1000 * c:.2f}" for c in cells) + " |")
    eager.close()
    graphs.close()
    del model
    torch.cuda.empty_cache()
    say()


class ReplayProposer:
    """Offers exactly `depth` tokens of the target's own greedy continuation (always accepted)."""

    name = "replay"

    def __init__(self, continuation: list[int], depth: int) -> None:
        self.continuation = continuation
        self.depth = depth

    def available(self, request: Request, depth: int) -> int:
        return min(depth, self.depth)

    def propose(self, batch: list[tuple[Request, int]], live: set) -> list[tuple[int, ...]]:
        return [tuple(self.continuation[r.outputs:r.outputs + d]) for r, d in batch]


def ceiling(target: Path, tokens: int = 256) -> None:
    say("## Ceiling: batch 1, replaying the target's greedy continuation (100% acceptance)\n")
    _, model = load_model(target, torch.device("cuda"))
    pages = 4 * -(-(CONTEXT + tokens + 8) // PAGE)
    # Eight slots: decode graphs of up to 8 rows hold a verify row of depth 7.
    executor = GraphExecutor(model, pages, PAGE, 8, torch.device("cuda"), CONTEXT + tokens + 64, 512)
    prompt = [[(i * 7919) % 1000 + 10 for i in range(256)]]
    plain, _ = generate(executor, RequestScheduler(4, 8, pages, PAGE, 512), prompt, tokens)
    say("| depth | output tok/s | steps | same tokens |")
    say("|---|---|---|---|")
    for depth in range(8):
        scheduler = RequestScheduler(4, 8, pages, PAGE, 512, proposer=ReplayProposer(plain[0], depth) if depth
                                     else None)
        started = time.perf_counter()
        out, plans = generate(executor, scheduler, prompt, tokens)
        seconds = time.perf_counter() - started
        say(f"| {depth} | {tokens / seconds:.1f} | {len(plans)} | {out == plain} |")
    executor.close()
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=Path, default=Path("cores"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    say(f"# Speculative decoding on {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    target = core(args.cores, "llama-3.1-8b")
    width_sweep(target)
    ceiling(target)
    if args.out:
        args.out.write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
