"""`flare-bench`: load generator and report against any OpenAI-compatible server.

    flare-bench serve --base-url URL [workload flags] [--json OUT] [--plot OUT.png]
    flare-bench compare --base-url A --base-url B [...] [--label A --label B ...] [workload flags]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

from bench.compare import compare_table, run_all
from bench.datasets import DATASETS, Workload, build_prompts
from bench.report import describe, run_json, serve_table, write_json
from bench.runner import Target, Traffic
from bench.tokens import Tokens


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--model", help="model name to request (default: the first of the server's /v1/models)")
    parser.add_argument("--dataset", choices=DATASETS, default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no cap)")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (the mean for sharegpt-synthetic)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens (the mean for sharegpt-synthetic)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="random and shared-prefix: lengths uniform in len x [1 - r, 1 + r]")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to generate all max_tokens")
    parser.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                        help='fields added to every request, e.g. \'{"response_format": {"type": "json_object"}}\'')
    parser.add_argument("--extra-body-every", type=int, default=1, metavar="N",
                        help="add the --extra-body fields to every Nth request only (the first, the N+1th, ...)")
    parser.add_argument("--tokenizer", type=Path,
                        help="tokenizer.json (or a directory with one) for exact prompt lengths and for counting "
                             "output when the server reports no usage (default: common words, one token each)")
    parser.add_argument("--json", type=Path, help="write every figure and the per-request records here")
    parser.add_argument("--plot", type=Path, help="draw latency CDFs and throughput over time (needs matplotlib)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flare-bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="benchmark one server")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--label", help="name of the server in the report (default: host:port)")
    add_workload_flags(serve)
    compare = commands.add_parser("compare", help="the same workload against several servers, one after another")
    compare.add_argument("--base-url", action="append", required=True, help="repeat once per server")
    compare.add_argument("--label", action="append", help="repeat once per --base-url, in the same order")
    add_workload_flags(compare)
    args = parser.parse_args(argv)
    urls = args.base_url if args.command == "compare" else [args.base_url]
    labels = args.label if args.command == "compare" else [args.label] if args.label else None
    if args.command == "compare" and len(urls) < 2:
        parser.error("compare needs two or more --base-url")
    if labels is not None and len(labels) != len(urls):
        parser.error("give one --label per --base-url")
    for flag in ("num_prompts", "input_len", "output_len", "prefix_len", "num_groups", "max_concurrency",
                 "extra_body_every"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.range_ratio < 1 or args.request_rate <= 0:
        parser.error("--range-ratio must be in [0, 1) and --request-rate above 0")
    if args.tokenizer is not None and not args.tokenizer.exists():
        parser.error(f"--tokenizer: no such file or directory: {args.tokenizer}")
    # Checked before the run, which may take long, rather than after it.
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'flare[bench]'")
    args.targets = [Target(url, args.endpoint, args.model, labels[i] if labels else urlsplit(url).netloc or url)
                    for i, url in enumerate(urls)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    workload = Workload(args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                        args.prefix_len, args.num_groups)
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        print("flare-bench: error: --extra-body must be a JSON object", file=sys.stderr)
        return 2
    traffic = Traffic(args.request_rate, args.max_concurrency, args.ignore_eos, args.seed, args.extra_body,
                      args.extra_body_every)
    tokens = Tokens.load(args.tokenizer)
    prompts = build_prompts(workload, tokens)
    try:
        runs = run_all(args.targets, prompts, traffic, tokens)
    except RuntimeError as exc:
        print(f"flare-bench: error: {exc}", file=sys.stderr)
        return 1
    for each in runs:
        print(describe(each, workload, traffic))
        if args.command == "serve":
            print(serve_table(each))
    if args.command == "compare":
        print(compare_table(runs))
    if args.json:
        payloads = [run_json(each, workload, traffic) for each in runs]
        write_json(args.json, payloads[0] if args.command == "serve" else {"runs": payloads})
    if args.plot:
        from bench.plot import plot  # matplotlib is optional: only --plot loads it

        plot(runs, args.plot)
    return 0
