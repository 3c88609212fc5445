"""The OpenAI dialect: /v1/models, /v1/chat/completions and /v1/completions, streaming and not."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from common.errors import FlareError, InvalidRequest, NotFound
from common.protocol import SamplingParams
from frontend.generation import Delta, Finish, GenerationRequest, merge
from frontend.params import get_bool, get_int, get_int_list, get_number, get_stop, get_str
from frontend.server import Frontend, frontend_of, openai_error, read_json

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_CHOICES = 16


# --- models -------------------------------------------------------------------------------------------------------
def model_card(frontend: Frontend) -> dict:
    manifest = frontend.model.manifest
    return {"id": frontend.model.name, "object": "model", "created": manifest.created, "owned_by": "flare",
            "root": manifest.checkpoint, "max_model_len": manifest.context_limit,
            "aliases": manifest.served_names[1:], "capabilities": ["completion", "chat"]}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(frontend_of(request))]})


async def get_model(request: web.Request) -> web.Response:
    frontend = frontend_of(request)
    name = request.match_info["model"]
    if not frontend.model.knows(name):
        raise NotFound(f"The model '{name}' does not exist", param="model")
    return web.json_response(model_card(frontend))


# --- shared request reading ---------------------------------------------------------------------------------------
def check_model(frontend: Frontend, body: dict) -> str:
    name = get_str(body, "model", required=True)
    if not frontend.model.knows(name):
        raise NotFound(f"The model '{name}' does not exist", param="model")
    return name


def sampling_params(frontend: Frontend, body: dict, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    defaults = frontend.model.manifest.generation
    context = frontend.model.manifest.context_limit
    top_k = get_int(body, "top_k", defaults.top_k, -1, 1 << 31)
    params = SamplingParams(
        temperature=get_number(body, "temperature", defaults.temperature, 0.0, 100.0),
        top_p=get_number(body, "top_p", defaults.top_p, 1e-9, 1.0),
        top_k=max(top_k, 0),
        min_p=get_number(body, "min_p", defaults.min_p, 0.0, 1.0),
        seed=get_int(body, "seed", None),
        max_tokens=max_tokens if max_tokens is not None else max(context - prompt_len, 1),
        min_tokens=get_int(body, "min_tokens", 0, 0, context),
        ignore_eos=get_bool(body, "ignore_eos", False),
        stop_token_ids=get_int_list(body, "stop_token_ids"))
    if prompt_len + params.max_tokens > context:
        raise InvalidRequest(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.", param="max_tokens")
    return params


def requested_max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        value = get_int(body, name, None, 1, 1 << 31)
        if value is not None:
            return value
    return None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n draws with seed + i, so a seeded n > 1 request stays reproducible."""
    if params.seed is None or index == 0:
        return params
    return SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                             "seed": params.seed + index})


def usage(finishes: list[Finish | None], n: int) -> dict:
    """Choices are prompt-major, n per prompt: each prompt counts once, every choice's output counts."""
    firsts = [f for f in finishes[::n] if f]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finishes if f)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)}}


@dataclass
class Collected:
    texts: list[str]
    token_ids: list[list[int]]
    finishes: list[Finish]


async def collect(events: AsyncIterator[tuple[int, Delta | Finish]], prefixes: list[str]) -> Collected:
    """Run a non-streaming request to its end: each choice's text (after its prefix), tokens and finish."""
    result = Collected(list(prefixes), [[] for _ in prefixes], [])
    finishes: list[Finish | None] = [None] * len(prefixes)
    async for index, event in events:
        if isinstance(event, Delta):
            result.texts[index] += event.text
            result.token_ids[index] += event.token_ids
        else:
            finishes[index] = event
    result.finishes = [f for f in finishes if f is not None]
    return result


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    return get_bool(options, "include_usage", False)


def reject_unsupported(body: dict) -> None:
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") is not None:
        raise InvalidRequest("logprobs are not supported yet", param="logprobs")


# --- chat ---------------------------------------------------------------------------------------------------------
def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                                 param="messages")
        content = message_text(message.get("content"), i)
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise InvalidRequest(f"messages[{i}].content is required", param="messages")
        result.append({**message, "role": "system" if role == "developer" else role, "content": content or ""})
    return result


def message_text(content: object, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"messages[{i}].content: part type {kind!r} is not supported by this model",
                                     param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of parts", param="messages")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = check_model(frontend, body)
    messages = chat_messages(body)
    reject_unsupported(body)
    stream = get_bool(body, "stream", False)
    include_usage = stream_options(body, stream)
    n = get_int(body, "n", 1, 1, MAX_CHOICES)
    tools = body.get("tools") or None
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    ids, message_ends = await frontend.on_pool(frontend.model.encode_chat, messages, tools, add_generation_prompt,
                                               extra)
    params = sampling_params(frontend, body, len(ids),
                             requested_max_tokens(body, "max_completion_tokens", "max_tokens"))
    stop = get_stop(body, "stop")
    arrival = time.time()
    requests = [GenerationRequest(ids, choice_params(params, i), stop, message_ends, arrival) for i in range(n)]
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(arrival), "model": name}
    async with contextlib.aclosing(merge(frontend.client, frontend.model, requests)) as events:
        if stream:
            return await stream_chat(request, events, meta, n, include_usage)
        done = await collect(events, [""] * n)
    choices = [{"index": i, "message": {"role": "assistant", "content": done.texts[i], "refusal": None},
                "logprobs": None, "finish_reason": done.finishes[i].reason,
                "stop_reason": done.finishes[i].matched_stop} for i in range(n)]
    payload = {**meta, "object": "chat.completion", "choices": choices, "usage": usage(done.finishes, n)}
    if get_bool(body, "return_token_ids", False):  # vLLM's extension, used by the parity tests
        payload["prompt_token_ids"] = ids
        for choice, token_ids in zip(choices, done.token_ids):
            choice["token_ids"] = token_ids
    return web.json_response(payload)


async def stream_chat(request: web.Request, events: AsyncIterator[tuple[int, Delta | Finish]], meta: dict,
                      n: int, include_usage: bool) -> web.StreamResponse:
    response = await open_stream(request)

    def chunk(choices: list[dict]) -> bytes:
        payload = {**meta, "object": "chat.completion.chunk", "choices": choices}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    for i in range(n):
        await response.write(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
    finishes: list[Finish | None] = [None] * n
    try:
        async for index, event in events:
            if isinstance(event, Delta):
                if event.text:
                    await response.write(chunk([{"index": index, "delta": {"content": event.text},
                                                 "logprobs": None, "finish_reason": None}]))
            else:
                finishes[index] = event
                await response.write(chunk([{"index": index, "delta": {}, "logprobs": None,
                                             "finish_reason": event.reason, "stop_reason": event.matched_stop}]))
        if include_usage:
            await response.write(sse({**meta, "object": "chat.completion.chunk", "choices": [],
                                      "usage": usage(finishes, n)}))
    except FlareError as exc:
        await response.write(sse({"error": {"message": exc.display(), "type": exc.kind, "param": exc.param,
                                            "code": str(exc.status)}}))
    await response.write(sse("[DONE]"))
    await response.write_eof()
    return response


# --- completions --------------------------------------------------------------------------------------------------
def completion_prompts(frontend: Frontend, body: dict) -> list[list[int] | str]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        vocab = frontend.model.tokenizer.get_vocab_size()
        def valid_ids(p: object) -> bool:
            return isinstance(p, list) and bool(p) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p)
        if valid_ids(prompt):
            return [list(prompt)]
        if all(valid_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest("'prompt' must be a non-empty string, list of strings, or list of token ids "
                         f"(each below the vocabulary size {frontend.model.tokenizer.get_vocab_size()})",
                         param="prompt")


async def completions(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = check_model(frontend, body)
    reject_unsupported(body)
    prompts = completion_prompts(frontend, body)
    stream = get_bool(body, "stream", False)
    include_usage = stream_options(body, stream)
    echo = get_bool(body, "echo", False)
    n = get_int(body, "n", 1, 1, MAX_CHOICES)
    if len(prompts) * n > MAX_CHOICES * 4:
        raise InvalidRequest(f"at most {MAX_CHOICES * 4} choices per request", param="prompt")
    encoded = [p if isinstance(p, list) else await frontend.on_pool(frontend.model.encode_text, p) for p in prompts]
    max_tokens = requested_max_tokens(body, "max_tokens")
    stop = get_stop(body, "stop")
    arrival = time.time()
    requests = []
    for ids in encoded:
        params = sampling_params(frontend, body, len(ids), max_tokens if max_tokens is not None else 16)
        requests.extend(GenerationRequest(ids, choice_params(params, i), stop, [], arrival) for i in range(n))
    prefixes = [(frontend.model.decode(r.prompt_ids) if echo else "") for r in requests]
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(arrival), "model": name}
    async with contextlib.aclosing(merge(frontend.client, frontend.model, requests)) as events:
        if stream:
            return await stream_completions(request, events, meta, prefixes, n, include_usage)
        done = await collect(events, prefixes)
    choices = [{"index": i, "text": done.texts[i], "logprobs": None, "finish_reason": done.finishes[i].reason,
                "stop_reason": done.finishes[i].matched_stop} for i in range(len(requests))]
    if get_bool(body, "return_token_ids", False):
        for choice, request_, token_ids in zip(choices, requests, done.token_ids):
            choice["prompt_token_ids"] = request_.prompt_ids
            choice["token_ids"] = token_ids
    return web.json_response({**meta, "choices": choices, "usage": usage(done.finishes, n)})


async def stream_completions(request: web.Request, events: AsyncIterator[tuple[int, Delta | Finish]], meta: dict,
                             prefixes: list[str], n: int, include_usage: bool) -> web.StreamResponse:
    response = await open_stream(request)

    def chunk(index: int, text: str, finish: Finish | None) -> bytes:
        payload = {**meta, "choices": [{"index": index, "text": text, "logprobs": None,
                                        "finish_reason": finish.reason if finish else None,
                                        "stop_reason": finish.matched_stop if finish else None}]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    for index, prefix in enumerate(prefixes):
        if prefix:
            await response.write(chunk(index, prefix, None))
    finishes: list[Finish | None] = [None] * len(prefixes)
    try:
        async for index, event in events:
            if isinstance(event, Delta):
                if event.text:
                    await response.write(chunk(index, event.text, None))
            else:
                finishes[index] = event
                await response.write(chunk(index, "", event))
        if include_usage:
            await response.write(sse({**meta, "choices": [], "usage": usage(finishes, n)}))
    except FlareError as exc:
        await response.write(sse({"error": {"message": exc.display(), "type": exc.kind, "param": exc.param,
                                            "code": str(exc.status)}}))
    await response.write(sse("[DONE]"))
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)


__all__ = ["add_routes", "openai_error"]
