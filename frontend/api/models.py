"""GET /v1/models and /v1/models/{model}: one card for the served core, in OpenAI's shape, or in Anthropic's when the
request carries Anthropic headers (both SDKs call the same paths)."""

from __future__ import annotations

from datetime import datetime, timezone

from aiohttp import web

from common.errors import NotFound
from frontend.api.errors import dialect_of
from frontend.api.json_body import json_response
from frontend.api.params import get_str
from frontend.chat.fill_in_middle import fim_tokens
from frontend.model import ServedModel
from frontend.server import frontend_of


def resolve(model: ServedModel, name: str) -> str:
    """Any served name (or the checkpoint) resolves; a 404 names the field otherwise."""
    if not model.knows(name):
        raise NotFound(f"The model '{name}' does not exist; this server serves {model.name!r}", param="model")
    return name


def requested_model(model: ServedModel, body: dict) -> str:
    return resolve(model, get_str(body, "model", required=True))


def capabilities(model: ServedModel) -> list[str]:
    return ["completion", "tools"] + (["chat"] if model.template is not None else []) + \
        (["thinking"] if model.reasons else []) + (["vision"] if model.manifest.vision is not None else []) + \
        (["insert"] if fim_tokens(model.tokenizer) else []) + \
        (["embedding"] if model.pooling is not None else [])


def openai_card(model: ServedModel) -> dict:
    manifest = model.manifest
    return {"id": model.name, "object": "model", "created": manifest.created, "owned_by": "flare",
            "root": manifest.checkpoint, "parent": None, "max_model_len": manifest.context_limit,
            "aliases": manifest.served_names[1:], "capabilities": capabilities(model)}


def anthropic_card(model: ServedModel) -> dict:
    manifest = model.manifest
    return {"id": model.name, "type": "model", "display_name": model.name,
            "created_at": datetime.fromtimestamp(manifest.created, timezone.utc).isoformat().replace("+00:00", "Z"),
            "lifecycle": "active", "max_input_tokens": manifest.context_limit,
            "max_tokens": manifest.context_limit}


async def list_models(request: web.Request) -> web.Response:
    model = frontend_of(request).model
    if dialect_of(request) == "anthropic":
        return json_response({"data": [anthropic_card(model)], "has_more": False, "first_id": model.name,
                              "last_id": model.name})
    return json_response({"object": "list", "data": [openai_card(model)]})


async def get_model(request: web.Request) -> web.Response:
    model = frontend_of(request).model
    resolve(model, request.match_info["model"])
    return json_response(anthropic_card(model) if dialect_of(request) == "anthropic" else openai_card(model))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
