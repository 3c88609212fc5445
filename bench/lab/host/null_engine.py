"""A stand-in engine that answers every request at once, so a benchmark measures the frontend alone.

    python -m bench.lab.host.null_engine --core DIR --listen ADDR [--reply TEXT]

It speaks the real wire (common/protocol.py): Welcome to each Hello, heartbeats, and for each Submit one Outputs
message carrying the whole reply (the reply's tokens, cut at max_tokens) and its finish. No model, no scheduling.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from common import protocol as wire
from common.manifest import load_manifest

HEARTBEAT_SECONDS = 0.5


def serve(core: Path, listen: str, reply: str) -> None:
    manifest = load_manifest(core, verify=False)
    tokens = Tokenizer.from_file(str(core / "tokenizer.json")).encode(reply, add_special_tokens=False).ids
    card = wire.ModelCard(manifest.served_names, manifest.checkpoint, manifest.architecture, manifest.context_limit,
                          manifest.eos_token_ids, manifest.created)
    welcome = wire.encode(wire.Welcome("null-engine", card, 1024, 4096, HEARTBEAT_SECONDS))
    heartbeat = wire.encode(wire.Heartbeat("null-engine"))
    socket = zmq.Context().socket(zmq.ROUTER)
    socket.bind(listen)
    frontends: set[bytes] = set()
    last_beat = 0.0
    while True:
        if socket.poll(int(HEARTBEAT_SECONDS * 1000)):
            identity, payload = socket.recv_multipart()
            frontends.add(identity)
            message = wire.decode_frontend_message(payload)
            if isinstance(message, wire.Hello):
                socket.send_multipart([identity, welcome])
            elif isinstance(message, wire.Submit):
                out = tokens[:message.sampling.max_tokens]
                finish = "length" if len(out) < len(tokens) else "stop"
                socket.send_multipart([identity, wire.encode(wire.Outputs(
                    [message.request_id], [out], [finish], [None], [len(message.prompt)], [0]))])
        if time.monotonic() - last_beat > HEARTBEAT_SECONDS:
            last_beat = time.monotonic()
            for identity in frontends:
                socket.send_multipart([identity, heartbeat])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.host.null_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", type=Path, required=True, help="a core, for its tokenizer and model card")
    parser.add_argument("--listen", required=True, help="ZMQ address to bind")
    parser.add_argument("--reply", default="Hello! I am a stand-in engine, here to answer.")
    args = parser.parse_args(argv)
    serve(args.core, args.listen, args.reply)


if __name__ == "__main__":
    main()
