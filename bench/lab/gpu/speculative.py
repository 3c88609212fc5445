"""Speculative decoding on a GPU (docs/speculative.md, GPU), printed as markdown tables:

1. verify-step time against width W = 1, 2, 4, 8 at batch 1, 16, 64 (a Llama 3.1 8B synth core, bf16): W = 1 is the
   plain decode step (graph and eager), W > 1 a verify step of B requests with W target positions each;
2. the mechanism's ceiling: at batch 1, a proposer that replays the target's own greedy continuation (acceptance
   100%) at a fixed depth D = 0..7, output tokens per second against D, through the real scheduler;
3. draft-model mode at batch 1 and 16, through the real scheduler and the GraphExecutor: output tokens per second
   and acceptance with no speculation, with the draft's rounds eager (one forward and one host sync per position)
   and in captured graphs (engine/speculative/draft_steps.py), and the host time of a draft round. The draft is an
   early exit of the synth target (its first DRAFT_LAYERS layers, embeddings, final norm and head: the Llama 3.1
   8B preset with fewer layers, sharing the target's vocabulary and tokenizer); random weights give no real
   acceptance rate, so the table measures the mechanism's costs, not a trained draft's gains.

    python -m bench.lab.gpu.speculative [--cores cores] [--out gpu_speculative.md] [--sections width,ceiling,draft]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.lab.gpu.evidence import LINES, core, say
from bench.lab.gpu.steps import decode_plan, generate, time_steps
from common.protocol import SamplingParams
from engine.executor.eager import EagerExecutor
from engine.executor.graph import GraphExecutor
from engine.model.loader import load_model
from engine.scheduler.plan import Plan, Row
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler
from engine.speculative.draft import DraftProposer
from engine.speculative.draft_steps import DraftGraphs

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


DRAFT_LAYERS = 4


class TimedProposer:
    """A proposer's rounds, timed on the host (the scheduler's thread waits for them)."""

    def __init__(self, proposer: DraftProposer) -> None:
        self.proposer, self.name, self.seconds, self.rounds = proposer, proposer.name, 0.0, 0

    def available(self, request: Request, depth: int) -> int:
        return self.proposer.available(request, depth)

    def propose(self, batch: list[tuple[Request, int]], live: set) -> list[tuple[int, ...]]:
        started = time.perf_counter()
        proposals = self.proposer.propose(batch, live)
        self.seconds += time.perf_counter() - started
        self.rounds += 1
        return proposals


def draft_mode(target: Path, cores: Path, tokens: int = 128, prompt_len: int = 256) -> None:
    say(f"## Draft model: target {target.name}, draft its first {DRAFT_LAYERS} layers (early exit); "
        f"{prompt_len}-token prompts, {tokens} greedy tokens each\n")
    cuda = torch.device("cuda")
    _, model = load_model(target, cuda)
    _, draft = load_model(core(cores, "llama-3.1-8b-4l"), cuda)  # the preset with 4 layers: shapes and vocabulary
    draft.model.embed_tokens, draft.model.norm, draft.lm_head = model.model.embed_tokens, model.model.norm, \
        model.lm_head
    draft.model.layers = torch.nn.ModuleList(model.model.layers[:DRAFT_LAYERS])
    torch.cuda.empty_cache()
    batches, max_active = (1, 16), 64  # verify steps of 16 x 8 rows fit the decode graphs
    context = prompt_len + tokens + 64
    pages = max(batches) * 2 * -(-context // PAGE)
    executor = GraphExecutor(model, pages, PAGE, max_active, cuda, context, 512)
    drafters = {mode: DraftProposer(draft, pages, PAGE, cuda, context) for mode in ("eager", "graphs")}
    started = time.monotonic()
    drafters["graphs"].use_steps(DraftGraphs, max_active, 512)
    say(f"Draft graphs: {drafters['graphs'].steps.graph_count} captured in {time.monotonic() - started:.1f} s.\n")
    say("| batch | draft | output tok/s | same tokens as plain | rounds | accepted / drafted | ms per draft round |")
    say("|---|---|---|---|---|---|---|")
    for batch in batches:
        prompts = [[(i * 7919 + 31 * b) % 100000 + 10 for i in range(prompt_len)] for b in range(batch)]
        plain = None
        for mode in ("off", "eager", "graphs"):
            proposer = TimedProposer(drafters[mode]) if mode in drafters else None
            scheduler = RequestScheduler(max_active, max_active, pages, PAGE, 512, proposer=proposer)
            generate(executor, scheduler, prompts, 16)  # warm: kernels, the prefix cache, learned step costs
            before = dict(scheduler.counters)
            if proposer:
                proposer.seconds = proposer.rounds = 0
            started = time.perf_counter()
            out, _ = generate(executor, scheduler, prompts, tokens)
            seconds = time.perf_counter() - started
            plain = out if plain is None else plain
            count = {name: scheduler.counters[name] - before.get(name, 0) for name in
                     ("draft_rounds", "spec_accepted_tokens_draft", "spec_drafted_tokens_draft")}
            say(f"| {batch} | {mode} | {batch * tokens / seconds:.1f} | {out == plain} | {count['draft_rounds']} | "
                f"{count['spec_accepted_tokens_draft']} / {count['spec_drafted_tokens_draft']} | "
                + (f"{1000 * proposer.seconds / proposer.rounds:.2f} |" if proposer and proposer.rounds else "- |"))
    executor.close()
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=Path, default=Path("cores"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sections", default="width,ceiling,draft")
    args = parser.parse_args()
    say(f"# Speculative decoding on {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    target = core(args.cores, "llama-3.1-8b")
    sections = args.sections.split(",")
    if "width" in sections:
        width_sweep(target)
    if "ceiling" in sections:
        ceiling(target)
    if "draft" in sections:
        draft_mode(target, args.cores)
    if args.out:
        args.out.write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
