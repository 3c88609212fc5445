"""Embeddings over HTTP (docs/design.md, Embeddings): OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its
older POST /api/embeddings.

Each input is one embedding request in the engine (Submit.pooling): a prefill that returns the pooled final hidden
state. The inputs of one HTTP request run at most `max_active` at a time, so a long list waits in the frontend
rather than filling the engine's queue. The core's pooling says how (last token or mean) and whether the vector is
L2-normalised; OpenAI's `dimensions` (on a core trained for truncated vectors) keeps the first dimensions and
normalises again when the core normalises, as OpenAI's own truncated embeddings are.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from common.errors import ExecutionFailed, InvalidRequest
from common.manifest import Pooling
from common.protocol import SamplingParams, Submit
from frontend.api.fan_out import all_or_nothing
from frontend.api.json_body import json_response
from frontend.api.models import requested_model
from frontend.api.params import get_bool, get_int, get_str
from frontend.limits import MAX_EMBEDDING_INPUTS
from frontend.model import ServedModel
from frontend.replicas import Replicas
from frontend.server import Frontend, frontend_of, read_json


@dataclass(frozen=True)
class Embedded:
    vector: np.ndarray  # float32
    prompt_tokens: int


def pooling_of(model: ServedModel, name: str) -> Pooling:
    """The served pooling; a generation core has none, and says so naming the model."""
    if model.pooling is None:
        raise InvalidRequest(f"The model '{name}' does not serve embeddings: it is a generation model (export an "
                             "embedding checkpoint, or start flare run with --pooling last|mean)", param="model")
    return model.pooling


async def embed_one(client: Replicas, ids: list[int], pooling: str) -> Embedded:
    """One embedding; leaving early (a failure elsewhere, a gone client) aborts it in the engine."""
    submit = Submit(uuid.uuid4().hex, ids, SamplingParams(temperature=0.0, max_tokens=1), arrival=time.time(),
                    pooling=pooling)
    async with contextlib.aclosing(client.updates(submit)) as updates:
        async for update in updates:
            if update.finish_reason is not None:
                if update.finish_reason != "stop" or not update.embedding:
                    raise ExecutionFailed(f"the embedding ended: {update.finish_reason}")
                return Embedded(np.frombuffer(update.embedding, dtype="<f4"), update.prompt_tokens)
    raise ExecutionFailed("the embedding ended without a result")


async def embed_all(frontend: Frontend, prompts: list[list[int]], pooling: Pooling, dimensions: int | None = None,
                    normalize: bool = False) -> list[Embedded]:
    """Every prompt's embedding, in order: the core's vector, cut to `dimensions`, L2-normalised when the core
    normalises or `normalize` asks."""
    limit = asyncio.Semaphore(frontend.client.welcome.max_active if frontend.client.welcome else 1)

    async def bounded(ids: list[int]) -> Embedded:
        async with limit:
            return await embed_one(frontend.client, ids, pooling.mode)

    results = await all_or_nothing([bounded(ids) for ids in prompts])
    return [Embedded(finish_vector(r.vector, dimensions, pooling.normalize or normalize), r.prompt_tokens)
            for r in results]


def get_dimensions(body: dict, model: ServedModel, name: str, pooling: Pooling) -> int | None:
    """`dimensions`: how many of the vector's first dimensions to keep, on a core trained for it."""
    dimensions = get_int(body, "dimensions", None, 1, int(model.manifest.config.get("hidden_size", 1)))
    if dimensions is not None and not pooling.matryoshka:
        raise InvalidRequest(f"The model '{name}' was not trained for fewer dimensions: 'dimensions' is not "
                             "supported", param="dimensions")
    return dimensions


def finish_vector(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:  # in float64, as sentence-transformers' Normalize divides by a norm clamped away from zero
        vector = (vector / max(float(np.linalg.norm(vector.astype(np.float64))), 1e-12)).astype(np.float32)
    return vector


def check_ids(model: ServedModel, prompts: list[list[int]], truncate: bool, param: str) -> list[list[int]]:
    """Every prompt within the context (cut to it when `truncate`, as Ollama does), and not empty."""
    limit = model.manifest.context_limit
    for i, ids in enumerate(prompts):
        if not ids:
            raise InvalidRequest(f"'{param}' item {i} is empty", param=param)
        if len(ids) > limit and not truncate:
            raise InvalidRequest(f"'{param}' item {i} has {len(ids)} tokens, over the model's maximum context length "
                                 f"of {limit} tokens", param=param)
    return [ids[:limit] for ids in prompts]


async def tokenized(frontend: Frontend, value: object, param: str) -> list[list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    def is_ids(item: object) -> bool:
        return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"'{param}' must be a string, a list of strings, a list of token ids or a list of "
                             "token id lists, and not empty", param=param)
    if is_ids(value):
        return [value]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(f"'{param}' has {len(value)} items, over the limit of {MAX_EMBEDDING_INPUTS}",
                             param=param)
    if all(is_ids(item) for item in value):
        return value
    if not all(isinstance(item, str) for item in value):
        raise InvalidRequest(f"'{param}' mixes strings and token ids, or holds something else", param=param)
    model = frontend.model
    return await frontend.on_pool(lambda: [model.encode_text(text) for text in value])


async def openai_embeddings(request: web.Request) -> web.Response:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    pooling = pooling_of(frontend.model, name)
    encoding = get_str(body, "encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise InvalidRequest(f"'encoding_format' must be float or base64, got {encoding!r}", param="encoding_format")
    dimensions = get_dimensions(body, frontend.model, name, pooling)
    prompts = check_ids(frontend.model, await tokenized(frontend, body.get("input"), "input"), False, "input")
    results = await embed_all(frontend, prompts, pooling, dimensions)
    tokens = sum(r.prompt_tokens for r in results)
    return json_response({
        "object": "list", "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "data": [{"object": "embedding", "index": i, "embedding": base64.b64encode(r.vector.astype("<f4")).decode()
                  if encoding == "base64" else r.vector.tolist()} for i, r in enumerate(results)]})


async def ollama_texts(frontend: Frontend, body: dict, param: str) -> list[list[int]]:
    """Ollama's inputs: a string or a list of strings."""
    value = body.get(param)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest(f"'{param}' must be a string or a list of strings", param=param)
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(f"'{param}' has {len(texts)} items, over the limit of {MAX_EMBEDDING_INPUTS}",
                             param=param)
    model = frontend.model
    return await frontend.on_pool(lambda: [model.encode_text(text) for text in texts])


async def ollama_embed(request: web.Request) -> web.Response:
    """/api/embed: a batch, L2-normalised (as Ollama's are), cut to the context unless `truncate` is false."""
    started = time.monotonic_ns()
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    pooling = pooling_of(frontend.model, name)
    dimensions = get_dimensions(body, frontend.model, name, pooling)
    texts = await ollama_texts(frontend, body, "input")
    prompts = check_ids(frontend.model, texts, get_bool(body, "truncate", True), "input")
    results = await embed_all(frontend, prompts, pooling, dimensions, normalize=True) if prompts else []
    return json_response({"model": name, "embeddings": [r.vector.tolist() for r in results],
                          "total_duration": time.monotonic_ns() - started, "load_duration": 0,
                          "prompt_eval_count": sum(r.prompt_tokens for r in results)})


async def ollama_embeddings(request: web.Request) -> web.Response:
    """/api/embeddings, Ollama's older route: one `prompt`, the core's vector as it is."""
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    pooling = pooling_of(frontend.model, name)
    prompt = get_str(body, "prompt", required=True)
    if not prompt:  # Ollama answers an empty prompt with an empty embedding
        return json_response({"embedding": []})
    prompts = check_ids(frontend.model, [await frontend.on_pool(frontend.model.encode_text, prompt)], False,
                        "prompt")
    return json_response({"embedding": (await embed_all(frontend, prompts, pooling))[0].vector.tolist()})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/api/embed", ollama_embed)
    app.router.add_post("/api/embeddings", ollama_embeddings)
