"""Host time of structured output per step: advancing B constrained requests' matchers by the tokens a step drew,
then computing their next masks (engine/sampling/grammar.py). With late masks this is the host's work between a
step's completion and the next step's sampling, hidden while it is shorter than that step's forward (docs/gpu.md,
Two steps in flight).

    python -m bench.lab.host.grammar_turn --core DIR [--rows 16 64 256] [--steps 100] [--threads N] [--templates K]

Every request is constrained by the 8b-c64-json serving row's schema (bench/lab/gpu/serving.py), with a matcher compiled
for it as the engine does (or, `--templates K`, a copy of one of K compiled matchers in turn: copies of one matcher
share its lexer state behind one lock, so their masks are computed one after another; K = 1 is how the engine made them
before); each token is drawn at random among those its mask allows, as sampling over random weights does, and a request
whose grammar ends starts again. Prints, per row count, the medians over the steps: ms advancing (one consume_token per
row, as Engine._advance_grammars), ms computing the masks (llguidance's parallel fill, as Engine._masks, on `--threads`
threads, by default llguidance's), and their sum.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import llguidance
import numpy as np

from bench.lab.gpu.serving import JSON64
from common.manifest import load_manifest
from common.protocol import SamplingParams
from engine.sampling.grammar import GrammarCompiler, GrammarSpec, mask_words, plan_masks
from engine.scheduler.plan import Plan, Row
from frontend.chat.structured import json_schema_text


def allowed_token(rng: np.random.Generator, mask: np.ndarray, vocab: int) -> int:
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
    return int(rng.choice(allowed))


def measure(compiler: GrammarCompiler, spec: GrammarSpec, rows: int, steps: int, executor: llguidance.LLExecutor,
            templates: int) -> tuple[float, float]:
    """Median milliseconds a step spends advancing `rows` matchers and computing their masks."""
    vocab = compiler.vocab_size
    compiled = [compiler.compile(spec) for _ in range(templates)]
    handed = itertools.count()

    def new() -> llguidance.LLMatcher:
        return compiled[next(handed) % templates].deep_copy() if templates else compiler.compile(spec)

    matchers = {slot: new() for slot in range(rows)}
    plan = Plan(tuple(Row(slot, 0, 0, 1, None, (), True, 0, SamplingParams(), 0, 1) for slot in range(rows)))
    words, rng = mask_words(vocab), np.random.default_rng(0)
    masks = np.frombuffer(plan_masks(plan, matchers, words, executor), np.int32).reshape(rows, words)
    advancing, masking = [], []
    for _ in range(steps):
        tokens = [allowed_token(rng, masks[slot], vocab) for slot in range(rows)]
        started = time.perf_counter()
        for slot, token in enumerate(tokens):
            matchers[slot].consume_token(token)
        advanced = time.perf_counter()
        for slot, matcher in matchers.items():
            if matcher.is_stopped() or matcher.is_error():
                matchers[slot] = new()
        begun = time.perf_counter()
        masks = np.frombuffer(plan_masks(plan, matchers, words, executor), np.int32).reshape(rows, words)
        masking.append(time.perf_counter() - begun)
        advancing.append(advanced - started)
    return 1000 * statistics.median(advancing), 1000 * statistics.median(masking)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.grammar_turn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, help="the mask executor's threads (default: llguidance's)")
    parser.add_argument("--templates", type=int, default=0,
                        help="copies of this many compiled matchers (default: one compiled per request)")
    args = parser.parse_args(argv)
    manifest = load_manifest(args.core)
    vocab = manifest.config["vocab_size"]
    compiler = GrammarCompiler((args.core / "tokenizer.json").read_text(), vocab, manifest.eos_token_ids)
    schema = json.loads(JSON64)["response_format"]["json_schema"]["schema"]
    spec = GrammarSpec("json_schema", json_schema_text(schema, "response_format"))
    executor = llguidance.LLExecutor(args.threads) if args.threads else compiler.executor
    matchers = f"copies of {args.templates} matchers" if args.templates else "a matcher per request"
    print(f"vocabulary {vocab:,}; {matchers}, {args.threads or 'default'} mask threads; medians over {args.steps} "
          "steps\n")
    print("| rows | advance ms | masks ms | sum ms |\n| ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        advance, masks = measure(compiler, spec, rows, args.steps, executor, args.templates)
        print(f"| {rows} | {advance:.2f} | {masks:.2f} | {advance + masks:.2f} |", flush=True)
    compiler.close()


if __name__ == "__main__":
    main()
