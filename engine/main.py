"""`flare-engine --rank 0 --core DIR --listen ADDR`: one engine process per GPU rank."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import torch
import zmq

from common.errors import CoreError
from common.manifest import Manifest
from common import protocol
from common.protocol import ModelCard
from engine.core import Engine
from engine.executor.eager import EagerExecutor, pages_for_budget
from engine.model.loader import DTYPES, load_model
from engine.scheduler.scheduler import RequestScheduler
from engine.telemetry import EngineTelemetry

log = logging.getLogger("flare.engine")


def cache_identity(manifest: Manifest, dtype: torch.dtype) -> bytes:
    """32 bytes naming the weights and the recipe that shape the KV cache: prefix keys of different cores or dtypes
    never meet."""
    recipe = f"{sorted(manifest.files.items())}|{dtype}|{manifest.capacities.page_size}".encode()
    return hashlib.sha256(recipe).digest()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flare-engine", description=__doc__)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--core", type=Path, required=True, help="core directory made by `ignition export`")
    parser.add_argument("--listen", required=True, help="ZMQ address to bind, e.g. ipc:///tmp/flare.sock")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="override the core's dtype")
    parser.add_argument("--max-active", type=int, help="live request slots (default: the core's capacities)")
    parser.add_argument("--kv-cache-bytes", type=int, help="KV cache budget (default: the core's capacities)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{args.rank}] %(levelname)s %(message)s")
    if args.rank != 0:
        sys.exit("flare-engine: error: only rank 0 exists until tensor parallelism lands")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    device = torch.device(args.device)
    try:
        manifest, model = load_model(args.core, device, DTYPES[args.dtype] if args.dtype else None)
    except CoreError as exc:
        sys.exit(f"flare-engine: error: {exc}")
    caps = manifest.capacities
    max_active = args.max_active or caps.max_active
    num_pages = pages_for_budget(model, caps.page_size, args.kv_cache_bytes or caps.kv_cache_bytes,
                                 model.model.embed_tokens.weight.dtype)
    executor = EagerExecutor(model, num_pages, caps.page_size, max_active, device)
    scheduler = RequestScheduler(max_active, caps.queue_capacity, num_pages, caps.page_size, caps.prefill_chunk_size,
                                 cache_identity(manifest, model.model.embed_tokens.weight.dtype))
    card = ModelCard(served_names=manifest.served_names, checkpoint=manifest.checkpoint,
                     architecture=manifest.architecture, context_limit=manifest.context_limit,
                     eos_token_ids=manifest.eos_token_ids, created=manifest.created)
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.bind(args.listen)
    telemetry_socket = context.socket(zmq.XPUB)
    # Every subscribe and unsubscribe reaches the engine, so it can count attached dashboards (see telemetry.py).
    telemetry_socket.setsockopt(zmq.XPUB_VERBOSER, 1)
    telemetry_socket.setsockopt(zmq.LINGER, 0)
    telemetry_address = protocol.telemetry_address(args.listen)
    telemetry_socket.bind(telemetry_address)
    telemetry = EngineTelemetry(telemetry_socket, f"engine-{uuid.uuid4().hex[:8]}")
    engine = Engine(card, executor, scheduler, model.config.vocab_size, socket, telemetry, telemetry_address)
    signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    signal.signal(signal.SIGINT, lambda *_: engine.stop())
    log.info("loaded %s (%s, %s) on %s in %.1fs: %d KV pages of %d tokens, %d slots; listening on %s",
             manifest.served_names[0], manifest.architecture, manifest.dtype, device, time.monotonic() - started,
             num_pages, caps.page_size, max_active, args.listen)
    try:
        engine.run()
    finally:
        executor.close()
        socket.close()
        telemetry_socket.close()
        context.term()
    log.info("stopped")
    os._exit(0)


if __name__ == "__main__":
    main()
