"""Speculative decoding on this machine: one stream, output tokens per second with speculation against without, in
the same server run (requests alternate between the per-request opt-out `"speculative": false` and speculation on).

Workloads: copy-heavy (a passage quoted in the prompt, asked back with a small edit) and plain chat. Every prompt is
sent once first so both modes find its prefix cached; the figure is output tokens over the time from the first to
the last streamed token (decode), and end to end.

    python -m bench.lab.cpu.speculative --core cores/smollm2-135m [--speculative ngram] [--draft DRAFT_CORE] \
        [--rounds 2] [--max-tokens 160] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import openai

from tests.support.servers import Server

PASSAGES = [
    "The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed the "
    "narrow stairs, trimmed the wick, and polished the great lens until it shone. Ships passing in the dark "
    "counted on its beam to warn them of the rocks below. When the storms came, the keeper stayed awake until "
    "dawn, watching the sea and listening to the wind howl against the glass.",
    "To make bread, mix four cups of flour with one teaspoon of salt and one packet of yeast. Add one and a half "
    "cups of warm water and stir until a soft dough forms. Knead the dough for ten minutes, then let it rise in a "
    "warm place for one hour. Shape it into a loaf, bake it at two hundred degrees for thirty minutes, and let it "
    "cool before slicing.",
    "The river begins high in the mountains, where snow melts into small streams each spring. The streams join "
    "in a green valley and flow past farms, orchards, and old stone bridges. Fishermen wait on its banks at "
    "sunrise, and children swim in its shallow bends in summer. Near the coast the river widens, slows, and "
    "finally meets the sea beside a busy harbour full of boats.",
    "Dear team, thank you for your hard work this quarter. Our sales grew by twelve percent, and customer "
    "satisfaction reached its highest level in three years. Next month we will open a new office in Lisbon and "
    "hire twenty engineers. Please join us on Friday at five for a small celebration in the main hall.",
]
EDITS = [("lighthouse", "tower"), ("flour", "wheat"), ("river", "stream"), ("Lisbon", "Porto")]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of the seasons on Earth?",
    "Give me some tips for sleeping better.",
    "Explain how a bicycle stays upright when moving.",
]


def copy_prompt(passage: str, edit: tuple[str, str]) -> str:
    return (f"Here is a passage:\n\n{passage}\n\nRepeat the passage above exactly, word for word, but replace "
            f"\"{edit[0]}\" with \"{edit[1]}\". Output only the passage.")


def timed(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, speculative: bool) -> tuple[int, float,
                                                                                                         float]:
    """(output tokens, decode seconds after the first token, end-to-end seconds)."""
    started = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body={"speculative": speculative})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, (last - first) if first else 0.0, time.perf_counter() - started


def metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines
            if line.startswith("flare_engine_") and not line.startswith("#") and "{" not in line}


def run(args: argparse.Namespace) -> dict:
    extra = ["--speculative", args.speculative] + (["--draft", str(args.draft)] if args.draft else [])
    server = Server(args.core, *extra)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=600)
        model = client.models.list().data[0].id
        workloads = {"copy-heavy": [copy_prompt(p, e) for p, e in zip(PASSAGES, EDITS)], "plain chat": CHAT}
        for prompts in workloads.values():  # cache every prompt's prefix, so both modes skip the same prefill
            for prompt in prompts:
                timed(client, model, prompt, 1, False)
        results = {}
        for name, prompts in workloads.items():
            records = {True: [], False: []}
            for round_ in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    order = (False, True) if (i + round_) % 2 == 0 else (True, False)  # alternate who goes first
                    for speculative in order:
                        before = metrics(server.base_url) if speculative else None
                        tokens, decode, total = timed(client, model, prompt, args.max_tokens, speculative)
                        record = {"prompt": i, "tokens": tokens, "decode_s": decode, "e2e_s": total}
                        if before is not None:
                            after = metrics(server.base_url)
                            record["rounds"] = after["flare_engine_draft_rounds_total"] - \
                                before["flare_engine_draft_rounds_total"]
                            record["accepted"] = after["flare_engine_draft_accepted_tokens_total"] - \
                                before["flare_engine_draft_accepted_tokens_total"]
                        records[speculative].append(record)
            results[name] = summarize(records)
        return {"core": str(args.core), "speculative": args.speculative, "draft": str(args.draft or ""),
                "max_tokens": args.max_tokens, "rounds": args.rounds, "results": results}
    finally:
        server.stop()


def summarize(records: dict[bool, list[dict]]) -> dict:
    def rate(rows: list[dict], key: str) -> float:
        return sum(r["tokens"] - (1 if key == "decode_s" else 0) for r in rows) / sum(r[key] for r in rows)

    on, off = records[True], records[False]
    rounds = sum(r["rounds"] for r in on)
    return {"tokens_on": sum(r["tokens"] for r in on), "tokens_off": sum(r["tokens"] for r in off),
            "decode_tok_s_on": rate(on, "decode_s"), "decode_tok_s_off": rate(off, "decode_s"),
            "e2e_tok_s_on": rate(on, "e2e_s"), "e2e_tok_s_off": rate(off, "e2e_s"),
            "speedup_decode": rate(on, "decode_s") / rate(off, "decode_s"),
            "speedup_e2e": rate(on, "e2e_s") / rate(off, "e2e_s"),
            "verify_rounds": rounds, "mean_acceptance": sum(r["accepted"] for r in on) / max(rounds, 1),
            "per_request_speedup_median": statistics.median(
                (a["tokens"] / a["e2e_s"]) / (b["tokens"] / b["e2e_s"]) for a, b in zip(
                    sorted(on, key=lambda r: r["prompt"]), sorted(off, key=lambda r: r["prompt"])))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, default=Path("cores/smollm2-135m"))
    parser.add_argument("--speculative", default="ngram", choices=("ngram", "draft"))
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = run(args)
    print(f"{'workload':<12} {'tok/s off':>10} {'tok/s on':>10} {'speedup':>8} {'decode x':>9} {'rounds':>7} "
          f"{'accepted/round':>15}")
    for name, r in report["results"].items():
        print(f"{name:<12} {r['e2e_tok_s_off']:>10.1f} {r['e2e_tok_s_on']:>10.1f} {r['speedup_e2e']:>7.2f}x "
              f"{r['speedup_decode']:>8.2f}x {r['verify_rounds']:>7.0f} {r['mean_acceptance']:>15.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
