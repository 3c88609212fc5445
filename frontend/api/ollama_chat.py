"""The Ollama dialect's generation routes: POST /api/chat and /api/generate, streamed as newline-delimited JSON unless
`"stream": false` asks for one object, through the shared generation (frontend/generation.py) and the shared reply
parsing (reasoning, tool calls). frontend/api/ollama_requests.py reads the request's fields."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

from aiohttp import web

from common.errors import InvalidRequest
from common.protocol import Constraint
from frontend.api.errors import as_flare_error
from frontend.api.json_body import json_bytes, json_response
from frontend.api.ollama_requests import (chat_messages, image_parts, model_name, options, output_format, sampling,
                                          stops, template_args, thinking, user_content)
from frontend.api.openai_chat import request_tools
from frontend.api.params import get_bool, get_str
from frontend.chat.fill_in_middle import fim_prompt, fim_tokens
from frontend.chat.replies import ReplyFormat, parse_replies
from frontend.chat.structured import after_reasoning
from frontend.chat.tools import ToolCall
from frontend.generation import Delta, Finish, GenerationRequest, Outcome, merge
from frontend.images.inputs import encode_chat
from frontend.model import EncodedChat
from frontend.server import Frontend, frontend_of, read_json
from frontend.streaming import open_stream, primed

NDJSON = "application/x-ndjson"
# A Go duration ("5m", "1h30m", "-1") or a number of seconds.
DURATION = re.compile(r"-?(\d+(\.\d*)?(ns|us|µs|ms|s|m|h)?)+")


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ndjson(payload: dict) -> bytes:
    return json_bytes(payload) + b"\n"


def unloads(body: dict) -> bool:
    """`keep_alive` is accepted (the core stays loaded while Flare runs); 0 asks to unload, which Ollama answers with
    done_reason "unload"."""
    value = body.get("keep_alive")
    if value is None:
        return False
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or
                                       isinstance(value, str) and DURATION.fullmatch(value)):
        raise InvalidRequest("'keep_alive' must be a number of seconds or a duration such as \"5m\"",
                             param="keep_alive")
    return value == 0 or isinstance(value, str) and not re.search(r"[1-9]", value)


@dataclass
class Reply:
    """How the dialect's objects look for one request: chat's `message` or generate's `response`, whether reasoning
    shows, and the clock its durations come from (nanoseconds, as Ollama reports them)."""

    model: str
    chat: bool
    show_thinking: bool = True
    start: int = field(default_factory=time.perf_counter_ns)
    first: int | None = None  # when the first token came: prompt evaluation ends there

    def piece(self, text: str, reasoning: str = "", calls: list[ToolCall] | None = None) -> dict:
        reasoning = reasoning if self.show_thinking else ""
        if self.chat:
            body = {"message": {"role": "assistant", "content": text}}
            target = body["message"]
        else:
            body = target = {"response": text}
        if reasoning:
            target["thinking"] = reasoning
        if calls:
            target["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return {"model": self.model, "created_at": now(), **body}

    def saw(self, event: Delta | ToolCall | Finish) -> None:
        if self.first is None and isinstance(event, Delta) and event.token_ids:
            self.first = time.perf_counter_ns()

    def final(self, finish: Finish) -> dict:
        end = time.perf_counter_ns()
        first = self.first or end
        return {"done": True, "done_reason": "length" if finish.reason == "length" else "stop",
                "total_duration": end - self.start, "load_duration": 0, "prompt_eval_count": finish.prompt_tokens,
                "prompt_eval_duration": first - self.start, "eval_count": finish.completion_tokens,
                "eval_duration": max(end - first, 1)}

    def loaded(self, unload: bool) -> web.Response:
        """What Ollama answers a request with nothing to generate: the model is (still) loaded."""
        return json_response({**self.piece(""), "done": True, "done_reason": "unload" if unload else "load"})


async def respond(request: web.Request, frontend: Frontend, body: dict, encoded: EncodedChat, reply: Reply,
                  tools: list[dict] | None, constraint: Constraint | None) -> web.StreamResponse:
    """Generate after the prompt, with the request's options, streamed or as one object."""
    if frontend.model.reasons:
        constraint = after_reasoning(constraint, encoded.opens_reasoning)
    options_ = options(body)
    generation = GenerationRequest(encoded.ids, sampling(frontend.model, options_, len(encoded.ids)), stops(options_),
                                   encoded.message_ends, time.time(), constraint, encoded.images)
    async with contextlib.aclosing(merge(frontend.client, frontend.model, [generation])) as events:
        events = parse_replies(events, ReplyFormat.of(frontend.model, encoded, tools))
        if get_bool(body, "stream", True):
            return await stream_reply(request, await primed(events), reply)
        outcome = Outcome()
        async for _, event in events:
            reply.saw(event)
            outcome.add(event)
    return json_response({**reply.piece(outcome.text, outcome.reasoning, outcome.tool_calls),
                          **reply.final(outcome.finish)})


async def stream_reply(request: web.Request, events: AsyncIterator[tuple[int, Delta | ToolCall | Finish]],
                       reply: Reply) -> web.StreamResponse:
    """One object per piece of the reply with `"done": false`, then the final one; a failure after the headers went
    out is an `{"error"}` line (the ollama client raises on it)."""
    stream = await open_stream(request, NDJSON)
    try:
        async for _, event in events:
            reply.saw(event)
            if isinstance(event, Delta):
                if event.text or event.reasoning and reply.show_thinking:
                    stream.add(ndjson({**reply.piece(event.text, event.reasoning), "done": False}))
            elif isinstance(event, ToolCall):
                stream.add(ndjson({**reply.piece("", calls=[event]), "done": False}))
            else:
                stream.add(ndjson({**reply.piece(""), **reply.final(event)}))
            if not isinstance(event, Finish):  # after the finish, the stream ends without waiting: one write
                await stream.flush()
    except ConnectionResetError:
        raise
    except Exception as exc:
        stream.add(ndjson({"error": as_flare_error(exc).display()}))
    return await stream.close()


async def chat(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    reply = Reply(model_name(frontend.model, body), chat=True)
    unload = unloads(body)
    messages = chat_messages(body)
    think = thinking(body, frontend.model)
    reply.show_thinking = think is not False
    if not messages:
        return reply.loaded(unload)
    tools, parse, _ = await frontend.on_pool(request_tools, {"tools": body.get("tools")}, False, frontend.model)
    constraint = await frontend.on_pool(output_format, body)
    # A final assistant message is the start of the reply, continued (as Ollama does).
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    encoded = await encode_chat(frontend, messages, tools, True, template_args(frontend.model, think), prefill)
    return await respond(request, frontend, body, encoded, reply, tools if parse else None, constraint)


async def generate(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    model = frontend.model
    body = await read_json(request)
    reply = Reply(model_name(model, body), chat=False)
    unload = unloads(body)
    prompt, system, suffix = (get_str(body, key, "") for key in ("prompt", "system", "suffix"))
    raw = get_bool(body, "raw", False)
    think = thinking(body, model)
    reply.show_thinking = think is not False
    images = image_parts(body.get("images"), "images")
    if get_str(body, "template"):
        raise InvalidRequest("'template' (a Go template) is not supported: the core's own chat template applies",
                             param="template")
    if body.get("context"):
        raise InvalidRequest("'context' (deprecated by Ollama) is not supported: send the conversation to /api/chat",
                             param="context")
    if not (prompt or system or suffix or images):
        return reply.loaded(unload)
    constraint = await frontend.on_pool(output_format, body)
    if raw or suffix:
        if images:
            raise InvalidRequest("'images' need the chat template: they cannot go with 'raw' or 'suffix'",
                                 param="images")
        if suffix:
            tokens = fim_tokens(model.tokenizer)
            if tokens is None:
                raise InvalidRequest(f"'{model.name}' does not support insert ('suffix' needs fill-in-the-middle "
                                     "tokens)", param="suffix")
            prompt = fim_prompt(tokens, prompt, suffix)
        encoded = EncodedChat(await frontend.on_pool(model.encode_text, prompt), [], False)
    else:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user_content(prompt, images)})
        encoded = await encode_chat(frontend, messages, None, True, template_args(model, think))
    return await respond(request, frontend, body, encoded, reply, None, constraint)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
