"""vLLM's POST /tokenize and /detokenize: a prompt, or a chat rendered by the template as /v1/chat/completions renders
it (tools, images and chat_template_kwargs included), as token ids; ids back to text. Both are bounded as the
generation routes are: a prompt longer than the context is a 400, ids must be in the vocabulary."""

from __future__ import annotations

from aiohttp import web

from common.errors import InvalidRequest
from frontend.api.json_body import json_response
from frontend.api.models import requested_model
from frontend.api.openai_chat import chat_messages, request_tools, template_kwargs
from frontend.api.params import get_bool, get_int_list, get_str
from frontend.images.inputs import encode_chat
from frontend.model import ServedModel
from frontend.server import Frontend, frontend_of, read_json


def within_context(model: ServedModel, count: int, param: str) -> None:
    limit = model.manifest.context_limit
    if count > limit:
        raise InvalidRequest(f"This model's maximum context length is {limit} tokens; the {param} has {count}",
                             param=param)


async def chat_ids(frontend: Frontend, body: dict) -> list[int]:
    if get_bool(body, "add_special_tokens", False):
        raise InvalidRequest("'add_special_tokens' applies to a 'prompt': the chat template writes a chat's own",
                             param="add_special_tokens")
    messages = chat_messages(body)
    tools, _, _ = await frontend.on_pool(request_tools, {"tools": body.get("tools")}, False, frontend.model)
    continue_final = get_bool(body, "continue_final_message", False)
    encoded = await encode_chat(frontend, messages, tools, get_bool(body, "add_generation_prompt", True),
                                template_kwargs(body), continue_final)
    return encoded.ids


async def tokenize(request: web.Request) -> web.Response:
    frontend = frontend_of(request)
    model = frontend.model
    body = await read_json(request)
    if body.get("model") is not None:
        requested_model(model, body)
    if body.get("messages") is not None:
        ids, param = await chat_ids(frontend, body), "messages"
    else:
        text, special = get_str(body, "prompt", required=True), get_bool(body, "add_special_tokens", True)
        ids, param = await frontend.on_pool(model.encode_text, text, special), "prompt"
    within_context(model, len(ids), param)
    strings = [model.tokenizer.id_to_token(i) for i in ids] if get_bool(body, "return_token_strs", False) else None
    return json_response({"count": len(ids), "max_model_len": model.manifest.context_limit, "tokens": ids,
                          "token_strs": strings})


async def detokenize(request: web.Request) -> web.Response:
    model = frontend_of(request).model
    body = await read_json(request)
    if body.get("model") is not None:
        requested_model(model, body)
    if not isinstance(body.get("tokens"), list):
        raise InvalidRequest("'tokens' is required: a list of token ids", param="tokens")
    ids = get_int_list(body, "tokens", model.tokenizer.get_vocab_size())
    within_context(model, len(ids), "tokens")
    return json_response({"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
