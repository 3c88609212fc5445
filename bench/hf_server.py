"""A minimal OpenAI-compatible streaming server over Hugging Face transformers' continuous batching.

The GPU peer of `flare-bench compare`. It serves a Flare core through `ContinuousBatchingManager`, reading the
core's weights, tokenizer and chat template with Flare's own frontend code, so both servers see token-identical
prompts. It is not part of Flare's server or test suite, and imports transformers (the `ignition` extra):

    python -m bench.hf_server cores/smollm2-135m --port 8100 [--device cuda]

Greedy decoding, streaming only: /v1/chat/completions and /v1/completions honour max_tokens, ignore_eos and
stream_options.include_usage; /v1/models and /health answer as usual.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import torch
from aiohttp import web
from safetensors.torch import load_file
from tokenizers.decoders import DecodeStream
from transformers import AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager

from frontend.model import ServedModel

DEFAULT_MAX_TOKENS = 256
MANAGER = web.AppKey("manager", ContinuousBatchingManager)
SERVED = web.AppKey("served", ServedModel)


def load_model(core: Path, served: ServedModel, device: str) -> torch.nn.Module:
    config = dict(served.manifest.config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, served.manifest.dtype))
    state = {name: tensor for file in sorted(core.glob("*.safetensors")) for name, tensor in load_file(file).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied output head is stored once, as the embedding.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"{core}: weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model.eval()


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def chunk(meta: dict, chat: bool, text: str | None, finish: str | None) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": text} if text is not None else {}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return {**meta, "choices": [choice]}


async def generate(request: web.Request) -> web.StreamResponse:
    manager, served = request.app[MANAGER], request.app[SERVED]
    body = await request.json()
    if not body.get("stream"):
        raise web.HTTPBadRequest(text="this server only streams: set stream to true")
    chat = request.path.endswith("/chat/completions")
    ids = served.encode_chat(body["messages"], None, True, {})[0] if chat else served.encode_text(body["prompt"])
    max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS)
    request_id = uuid.uuid4().hex
    outputs: asyncio.Queue = asyncio.Queue()
    manager.register_result_handler(request_id, outputs.put_nowait)  # before add_request: a result may come at once
    manager.add_request(ids, request_id=request_id, max_new_tokens=max_tokens, streaming=True,
                        eos_token_id=-1 if body.get("ignore_eos") else None)
    meta = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": served.name}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    decoder, generated = DecodeStream(skip_special_tokens=True), 0
    try:
        while True:
            output = await outputs.get()
            if output.error is not None:
                await response.write(sse({"error": {"message": output.error, "type": "server_error"}}))
                break
            pieces = [decoder.step(served.tokenizer, token) for token in output.generated_tokens[generated:]]
            generated = len(output.generated_tokens)
            if text := "".join(piece for piece in pieces if piece):
                await response.write(sse(chunk(meta, chat, text, None)))
            if output.is_finished():
                await response.write(sse(chunk(meta, chat, None, "length" if generated >= max_tokens else "stop")))
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": len(ids), "completion_tokens": generated,
                             "total_tokens": len(ids) + generated}
                    await response.write(sse({**meta, "choices": [], "usage": usage}))
                break
        await response.write(sse("[DONE]"))
    except (ConnectionResetError, asyncio.CancelledError):
        manager.cancel_request(request_id)  # the client left: free its slot
        raise
    return response


async def models(request: web.Request) -> web.Response:
    name = request.app[SERVED].name
    return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]})


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_server", description=__doc__.splitlines()[0])
    parser.add_argument("core", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: transformers sizes it from memory)")
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per step (default: transformers' choice)")
    args = parser.parse_args()
    served = ServedModel(args.core)
    model = load_model(args.core, served, args.device)
    generation = GenerationConfig(do_sample=False, max_new_tokens=DEFAULT_MAX_TOKENS,
                                  eos_token_id=served.manifest.eos_token_ids)
    batching = ContinuousBatchingConfig(num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.warmup()  # captures CUDA graphs before the first request, as generate_batch does
    manager.start()
    app = web.Application()
    app[MANAGER], app[SERVED] = manager, served
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    try:
        web.run_app(app, host=args.host, port=args.port)
    finally:
        manager.stop(block=True, timeout=5)


if __name__ == "__main__":
    main()
