"""`flare-frontend --engine ADDR [--engine ADDR ...] --core DIR --host H --port P`: one stateless HTTP frontend
process, routing each request to one of the engine replicas (frontend/replicas.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from common.api_keys import ApiKeyError, add_api_key_flags, api_key
from common.errors import CoreError
from common.links import LinkKeyError, LinkKeys, add_link_flags, frame_limit, load_keys
from common.manifest import POOLING_MODES
from frontend import chat_page
from frontend.api import (anthropic_messages, decisions, embeddings, models, ollama_chat, ollama_models,
                          openai_chat, openai_completions, openai_responses, tokenize)
from frontend.chat.grammar_check import VALIDATOR
from frontend.decisions.prompts import Decider
from frontend.heap import use_system_allocator
from frontend.images.decode import ImageLimits
from frontend.limits import BODY_TIMEOUT, HEADER_TIMEOUT
from frontend.metrics import EngineSnapshots, frontend_gauges, serve_metrics
from frontend.model import ServedModel
from frontend.origins import OriginPolicy
from frontend.replicas import ROUTINGS, Replicas
from frontend.server import FRONTEND_KEY, Frontend, guard, health

log = logging.getLogger("flare.frontend")

DRAIN_SECONDS = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flare-frontend", description=__doc__)
    parser.add_argument("--engine", required=True, action="append",
                        help="an engine replica's ZMQ address (repeat once per replica)")
    parser.add_argument("--routing", choices=ROUTINGS, default="prefix",
                        help="how requests pick a replica (default: by cached prefix, traded against load)")
    parser.add_argument("--core", type=Path, required=True, help="core directory (tokenizer, template, manifest)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2, help="threads for template rendering, tokenization and images")
    parser.add_argument("--capacity", type=int, help="requests admitted at once (default: engine queue + slots)")
    parser.add_argument("--body-limit", type=int, default=32 << 20, help="largest request body, in bytes")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT,
                        help="seconds to read a request's body (slower is a 408)")
    add_api_key_flags(parser, "require this bearer token (or x-api-key)")
    add_link_flags(parser)
    parser.add_argument("--allowed-origins", default="",
                        help="comma-separated web page origins (scheme://host[:port], or *) that may call this server "
                             "from a browser; pages on loopback and the built-in chat page always may")
    limits = ImageLimits()
    parser.add_argument("--allowed-media-domains", nargs="*", default=[],
                        help="domains (and their subdomains) remote image URLs may name; none: data: URLs only")
    parser.add_argument("--max-images", type=int, default=limits.max_images, help="images per request")
    parser.add_argument("--max-image-bytes", type=int, default=limits.max_bytes, help="encoded bytes per image")
    parser.add_argument("--max-image-pixels", type=int, default=limits.max_pixels,
                        help="decoded pixels per image (read from the header, before decoding)")
    parser.add_argument("--media-timeout", type=float, default=limits.fetch_timeout,
                        help="seconds to fetch one remote image")
    parser.add_argument("--pooling", choices=POOLING_MODES,
                        help="serve embeddings of this core's final hidden states, pooled by the last token or the "
                             "mean and L2-normalised, whatever its manifest says")
    return parser.parse_args(argv)


def create_app(frontend: Frontend, body_limit: int) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=body_limit)
    app[FRONTEND_KEY] = frontend
    app.on_response_prepare.append(frontend.origins.add_cors_headers)
    app[decisions.DECIDER_KEY] = Decider(frontend.model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", serve_metrics)
    chat_page.add_routes(app)
    for dialect in (models, openai_chat, openai_completions, openai_responses, anthropic_messages, ollama_models,
                    ollama_chat, tokenize, decisions, embeddings):
        dialect.add_routes(app)
    return app


async def serve(args: argparse.Namespace, key: str | None, link_keys: LinkKeys | None) -> None:
    model = ServedModel(args.core, args.pooling)
    client = Replicas(args.engine, args.routing, link_keys,
                      frame_limit(model.manifest.context_limit, model.manifest.vision))
    welcome = await client.start()
    capacity = args.capacity or (welcome.queue_capacity + welcome.max_active) * len(args.engine)
    image_limits = ImageLimits(args.max_images, args.max_image_bytes, args.max_image_pixels,
                               tuple(d.lower().rstrip(".") for d in args.allowed_media_domains), args.media_timeout)
    origins = OriginPolicy.for_listener(args.host, args.allowed_origins)
    frontend = Frontend(model, client, args.workers, capacity, key, image_limits, origins, args.body_timeout)
    await asyncio.get_running_loop().run_in_executor(None, VALIDATOR.start)
    EngineSnapshots(lambda: [replica.telemetry for replica in client.replicas])
    frontend_gauges(lambda: (frontend.capacity, frontend.in_use), lambda: (args.workers, frontend.pool_busy))
    # keepalive_timeout also bounds the time to a first request's headers (aiohttp closes a connection that has
    # sent no whole request by then).
    runner = web.AppRunner(create_app(frontend, args.body_limit), handler_cancellation=True, access_log=None,
                            shutdown_timeout=1.0, keepalive_timeout=HEADER_TIMEOUT)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=True)
    await site.start()
    log.info("%s serving %s on http://%s:%d (%d replicas, %s routing; first: engine %s)", client.frontend_id,
             model.name, args.host, args.port, len(args.engine), args.routing, welcome.engine_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    frontend.draining = True
    log.info("draining: %d open requests get up to %.0fs", frontend.in_use, DRAIN_SECONDS)
    deadline = loop.time() + DRAIN_SECONDS
    while frontend.in_use and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
    await client.close()
    frontend.pool.shutdown(wait=False, cancel_futures=True)
    VALIDATOR.close()


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # started as a program: on the allocator whose freed pages go back (frontend/heap.py)
        use_system_allocator("frontend.main")
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    try:
        key, link_keys = api_key(args), load_keys(args.engine_keys)
    except (ApiKeyError, LinkKeyError) as exc:
        sys.exit(f"flare-frontend: error: {exc}")
    try:
        asyncio.run(serve(args, key, link_keys))
    except CoreError as exc:
        sys.exit(f"flare-frontend: error: {exc}")
    except TimeoutError:
        sys.exit(f"flare-frontend: error: no answer from any engine at {', '.join(args.engine)}")


if __name__ == "__main__":
    main()
