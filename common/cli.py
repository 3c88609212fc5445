"""`flare`: the command line. `flare run CORE [--tp R] [--replicas K]` starts the supervisor (common/supervisor.py);
`flare chat` (common/chat_terminal.py) chats in the terminal, starting `flare run` itself when given a core;
`flare dashboard --engine ADDR` attaches the terminal dashboard (common/dashboard/) to a running engine; `flare keys
DIR` makes the CURVE keys of the engine links (common/links.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.api_keys import add_api_key_flags
from common.chat_terminal import add_parser, chat
from common.engine_flags import add_engine_flags
from common.links import LinkKeyError, add_link_flags, load_keys, write_keys
from common.manifest import POOLING_MODES
from common.supervisor import run


def add_run_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    run_parser = commands.add_parser("run", help="start the engine and frontends for a core")
    run_parser.add_argument("core", type=Path)
    run_parser.add_argument("--frontends", type=int, default=1)
    run_parser.add_argument("--host", default="127.0.0.1")
    run_parser.add_argument("--port", type=int, default=8000)
    run_parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one engine process each")
    run_parser.add_argument("--replicas", type=int, default=1,
                            help="engine groups of --tp ranks each, on their own GPUs; frontends route between them")
    run_parser.add_argument("--routing", choices=("prefix", "round-robin"), default="prefix",
                            help="how frontends pick a replica (default: by cached prefix, traded against load)")
    add_api_key_flags(run_parser, "require this bearer token (or x-api-key) on every route but /health and /metrics")
    run_parser.add_argument("--capacity", type=int, help="requests each frontend admits at once "
                                                       "(default: the engine's queue plus its slots)")
    run_parser.add_argument("--body-limit", type=int, help="largest request body in bytes (frontend default 32 MiB)")
    run_parser.add_argument("--body-timeout", type=float, help="seconds to read a request's body; slower is a 408 "
                                                               "(frontend default 30)")
    run_parser.add_argument("--allowed-origins", help="comma-separated web page origins (scheme://host[:port], or *) "
                                                      "that may call the server from a browser (default: pages on "
                                                      "loopback and the built-in chat page only)")
    run_parser.add_argument("--workers", type=int, help="template/tokenizer threads per frontend (default 2)")
    run_parser.add_argument("--engine-address", help="ZMQ address for the engine (default: an ipc socket in a private "
                                                     "directory); with replicas, the first's, the others' derived "
                                                     "from it")
    add_link_flags(run_parser, binds=True)
    run_parser.add_argument("--allowed-media-domains", nargs="*", help="domains remote image URLs may name "
                                                                        "(default: none, data: URLs only)")
    run_parser.add_argument("--max-images", type=int, help="images per request (frontend default 16)")
    run_parser.add_argument("--max-image-bytes", type=int, help="encoded bytes per image (frontend default 16 MiB)")
    run_parser.add_argument("--max-image-pixels", type=int, help="decoded pixels per image (frontend default 32M)")
    run_parser.add_argument("--media-timeout", type=float, help="seconds to fetch a remote image (default 10)")
    run_parser.add_argument("--pooling", choices=POOLING_MODES,
                            help="serve /v1/embeddings from any decoder core: its final hidden states pooled by the "
                                 "last token or the mean, L2-normalised (an embedding core needs none: its manifest "
                                 "says how)")
    add_engine_flags(run_parser, "engine flags (each engine rank receives them)")
    return run_parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flare", description="Flare: serve a core over HTTP.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_parser(commands)
    dashboard_parser = commands.add_parser("dashboard", help="watch a running engine in the terminal")
    dashboard_parser.add_argument("--engine", required=True,
                                  help="the engine's request address, as given to flare-engine --listen")
    add_link_flags(dashboard_parser)
    keys_parser = commands.add_parser("keys", help="make the CURVE keys that guard the engine links")
    keys_parser.add_argument("directory", type=Path, help="where to write them (made 0700; secret files 0600)")
    add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "chat":
        sys.exit(chat(args))
    if args.command == "dashboard":
        from common.dashboard.app import attach  # textual loads only for this command

        try:
            keys = load_keys(args.engine_keys)
        except LinkKeyError as exc:
            sys.exit(f"flare: error: {exc}")
        sys.exit(attach(args.engine, keys))
    if args.command == "keys":
        try:
            write_keys(args.directory)
        except (LinkKeyError, OSError) as exc:
            sys.exit(f"flare: error: {exc}")
        print(f"flare: wrote engine link keys to {args.directory}; give every process of the deployment "
              f"--engine-keys {args.directory} (a copy on each host)", file=sys.stderr)
        sys.exit(0)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
