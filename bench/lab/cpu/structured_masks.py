"""Structured output on the CPU: grammar compile times (cold and cached) and the per-token mask cost, through the
engine's own GrammarCompiler and plan_masks (engine/sampling/grammar.py), for a 30-field JSON schema.

`python -m bench.lab.cpu.structured_masks [--core DIR] [--batch 1,16,64]`: the reply is a valid instance of the schema,
tokenized; at each of its tokens the masks of `batch` requests in that state are computed (as one engine step
does), then each matcher consumes the token. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenizers import Tokenizer

from common.manifest import load_manifest
from common.protocol import SamplingParams
from engine.sampling.grammar import GrammarCompiler, GrammarSpec, mask_words, plan_masks
from engine.scheduler.plan import Plan, Row
from frontend.chat.structured import json_schema_text

KINDS = [{"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 1000},
         {"type": "boolean"}, {"enum": ["red", "green", "blue"]},
         {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
         {"type": "number", "minimum": -1e6, "maximum": 1e6}]
VALUES = ["hello world", 42, True, "green", ["a", "bc"], 3.25]


def schema30(salt: str = "") -> dict:
    properties = {f"field_{i}{salt}": KINDS[i % len(KINDS)] for i in range(30)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def reply30() -> str:
    return json.dumps({f"field_{i}": VALUES[i % len(VALUES)] for i in range(30)})


def sampled_rows(count: int) -> Plan:
    params = SamplingParams()
    return Plan(tuple(Row(i, 1, 0, 1, None, (), True, 0, params, 0, 1) for i in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=Path, default=Path("cores/smollm2-135m"))
    parser.add_argument("--batch", default="1,16,64", help="constrained requests per step")
    args = parser.parse_args()
    manifest = load_manifest(args.core)
    vocab = int(manifest.config["vocab_size"])
    tokenizer_json = (args.core / "tokenizer.json").read_text()
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer_json, vocab, manifest.eos_token_ids)
    print(f"tokenizer for the grammar engine: {(time.perf_counter() - started) * 1e3:.0f} ms once per engine, "
          f"vocabulary {vocab}")
    spec = GrammarSpec("json_schema", json_schema_text(schema30(), "schema"))
    rows = []
    for label, each in (("cold", spec), ("cached", spec),
                        ("cold (another schema)", GrammarSpec("json_schema", json_schema_text(schema30("x"), "s")))):
        started = time.perf_counter()
        compiler.compile(each)
        rows.append((f"compile, {label}", (time.perf_counter() - started) * 1e3, "ms"))
    ids = Tokenizer.from_str(tokenizer_json).encode(reply30(), add_special_tokens=False).ids
    words = mask_words(vocab)
    for batch in [int(b) for b in args.batch.split(",")]:
        matchers = {slot: compiler.compile(spec) for slot in range(batch)}
        plan = sampled_rows(batch)
        per_step = []
        for token in ids:
            started = time.perf_counter()
            plan_masks(plan, matchers, words, compiler.executor)
            per_step.append(time.perf_counter() - started)
            for matcher in matchers.values():
                assert matcher.consume_token(token), matcher.get_error()
        assert all(m.is_accepting() for m in matchers.values())
        median, p90 = statistics.median(per_step), sorted(per_step)[int(0.9 * len(per_step))]
        rows.append((f"masks of {batch} requests per step, median ({len(ids)} steps)", median * 1e6, "us"))
        rows.append((f"masks of {batch} requests per step, p90", p90 * 1e6, "us"))
        rows.append((f"masks of {batch} requests per step, max", max(per_step) * 1e6, "us"))
        rows.append((f"per request per token, median, batch {batch}", median / batch * 1e6, "us"))
    compiler.close()
    width = max(len(r[0]) for r in rows)
    print(f"| {'what':<{width}} | value |\n| {'-' * width} | ----- |")
    for what, value, unit in rows:
        print(f"| {what:<{width}} | {value:.1f} {unit} |")


if __name__ == "__main__":
    main()
