"""The OpenAI chat dialect: /v1/chat/completions, streaming and not, with n choices, tools and logprobs; and what
the other OpenAI routes share with it (usage, stream options, tool lists)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from common.errors import InvalidRequest
from common.protocol import Constraint
from frontend.api.errors import finish_openai_stream
from frontend.api.json_body import json_response
from frontend.api.logprobs import token_logprobs, unpack
from frontend.api.models import requested_model
from frontend.api.params import get_bool, get_cache_salt, get_int, get_stop
from frontend.api.sampling import choice_params, requested_max_tokens, sampling_params, top_logprobs
from frontend.chat.replies import ReplyFormat, parse_replies
from frontend.chat.structured import after_reasoning, extension, one_of, response_format
from frontend.chat.tool_parsers import forced_call
from frontend.chat.tools import ToolCall, assistant_tool_call, check_tools, function_tool, tool_choice
from frontend.generation import Delta, Finish, GenerationRequest, Outcome, collect, merge
from frontend.images.inputs import content_of, encode_chat, image_part, text_part
from frontend.model import ServedModel
from frontend.server import Frontend, frontend_of, read_json
from frontend.streaming import open_stream, primed, sse

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_CHOICES = 16
# Arguments the server itself passes to the template; chat_template_kwargs may not replace them.
TEMPLATE_ARGS = {"messages", "tools", "add_generation_prompt"}


# --- shared by the OpenAI routes ----------------------------------------------------------------------------------
def usage(outcomes: list[Outcome], n: int) -> dict:
    """Choices are prompt-major, n per prompt: each prompt counts once, every choice's output counts."""
    firsts = [o.finish for o in outcomes[::n] if o.finish]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(o.finish.completion_tokens for o in outcomes if o.finish)
    reasoning = sum(o.finish.reasoning_tokens for o in outcomes if o.finish)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def stream_options(body: dict, stream: bool) -> bool:
    """Whether a stream ends with a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    return get_bool(options, "include_usage", False)


def choices_count(body: dict) -> int:
    n = get_int(body, "n", 1, 1, MAX_CHOICES)
    best_of = get_int(body, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise InvalidRequest("'best_of' different from 'n' is not supported", param="best_of")
    return n


def request_tools(body: dict, flat: bool, model: ServedModel
                  ) -> tuple[list[dict] | None, bool, Constraint | None]:
    """The tools to render, whether calls are parsed from the output, and the grammar of a forced call
    (tool_choice "required" or a named function). Chat nests each function under "function"; Responses (`flat`)
    puts its fields on the tool itself."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    tools = []
    for i, tool in enumerate(raw or []):
        function = tool if flat else (tool.get("function") if isinstance(tool, dict) else None)
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            shape = '"name": ...' if flat else '"function": {"name": ...}'
            raise InvalidRequest(f'tools[{i}] must be a function tool: {{"type": "function", {shape}}}',
                                 param="tools")
        tools.append(function_tool(function.get("name"), function.get("description"), function.get("parameters"),
                                   f"tools[{i}]"))
    choice = body.get("tool_choice")
    if not tools and choice not in (None, "none"):
        raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
    parse, forced = tool_choice(choice, tools)
    constraint = forced_call(forced, tools, model.tool_format) if forced else None
    return check_tools(tools), bool(tools) and parse, constraint


def output_constraint(body: dict, forced_call_: Constraint | None, format_name: str, format_value: object,
                      flat: bool = False) -> Constraint | None:
    """The one structured-output constraint of an OpenAI request: a forced call, a response format, or the
    `structured_outputs` extension."""
    return one_of(("tool_choice", forced_call_), (format_name, response_format(format_value, format_name, flat)),
                  ("structured_outputs", extension(body)))


# --- chat ---------------------------------------------------------------------------------------------------------
def image_url_of(part: dict) -> object:
    """Chat's {"type": "image_url", "image_url": {"url": ...}} or Responses' {"type": "input_image",
    "image_url": ...}."""
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def message_text(content: object, where: str, images: bool = False) -> str | list[dict] | None:
    """A message's content: text parts joined, or, where `images` are allowed and present, the parts in order
    (frontend/images/inputs.py)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append(text_part(part["text"]))
            elif kind in ("image_url", "input_image") and images:
                parts.append(image_part(image_url_of(part)))
            else:
                raise InvalidRequest(f"{where}.content: part type {str(kind)[:40]!r} is not supported here",
                                     param="messages")
        return content_of(parts)
    raise InvalidRequest(f"{where}.content must be a string or a list of parts", param="messages")


def past_tool_calls(calls: object, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls must be a list", param="messages")
    result = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), (str, dict)):
            raise InvalidRequest(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                                 f"{{\"name\", \"arguments\"}}}}", param="messages")
        result.append(assistant_tool_call(str(call.get("id") or ""), function["name"], function.get("arguments")))
    return result


def past_reasoning(message: dict, where: str) -> str | None:
    """An assistant turn's reasoning: `reasoning_content` as DeepSeek and vLLM return it, or vLLM's newer
    `reasoning`."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(f"{where}.{key} must be a string", param="messages")
        if value:
            return value
    return None


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {str(role)[:40]!r}",
                                 param="messages")
        content = message_text(message.get("content"), where, images=role == "user")
        converted = {"role": "system" if role == "developer" else role, "content": content or ""}
        if role == "assistant" and message.get("tool_calls"):
            converted["tool_calls"] = past_tool_calls(message["tool_calls"], where)
        elif content is None:
            raise InvalidRequest(f"{where}.content is required", param="messages")
        if role == "assistant" and (reasoning := past_reasoning(message, where)):
            converted["reasoning_content"] = reasoning  # what reasoning templates (Qwen3) render back
        if role == "tool":
            converted["tool_call_id"] = str(message.get("tool_call_id") or "")
        if isinstance(message.get("name"), str):
            converted["name"] = message["name"]
        result.append(converted)
    return result


def chat_logprobs(body: dict) -> int | None:
    wanted = get_bool(body, "logprobs", False)
    top = top_logprobs(body, "top_logprobs")
    if top is not None and not wanted:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def template_kwargs(body: dict) -> dict:
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or TEMPLATE_ARGS & extra.keys():
        raise InvalidRequest(f"'chat_template_kwargs' must be an object without {sorted(TEMPLATE_ARGS)}",
                             param="chat_template_kwargs")
    return extra


def tool_call_json(call: ToolCall) -> dict:
    return {"id": f"call_{call.id}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    messages = chat_messages(body)
    logprobs = chat_logprobs(body)
    if body.get("logit_bias"):
        raise InvalidRequest("'logit_bias' is not supported", param="logit_bias")
    stream = get_bool(body, "stream", False)
    include_usage = stream_options(body, stream)
    n = choices_count(body)
    # Tools' and formats' grammars are validated in a worker process, waited for on the worker pool.
    tools, parse_tools, forced = await frontend.on_pool(request_tools, body, False, frontend.model)
    constraint = await frontend.on_pool(output_constraint, body, forced, "response_format", body.get("response_format"))
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final = get_bool(body, "continue_final_message", False)  # vLLM's extension: prefill the reply
    if continue_final and (messages[-1]["role"] != "assistant" or body.get("add_generation_prompt")):
        raise InvalidRequest("'continue_final_message' needs a final assistant message and "
                             "'add_generation_prompt' not true", param="continue_final_message")
    encoded = await encode_chat(frontend, messages, tools, add_generation_prompt, template_kwargs(body),
                                continue_final)
    ids = encoded.ids
    constraint = after_reasoning(constraint, encoded.opens_reasoning) if frontend.model.reasons else constraint
    params = sampling_params(frontend.model, body, len(ids),
                             requested_max_tokens(body, "max_completion_tokens", "max_tokens"), logprobs=logprobs)
    stop = get_stop(body, "stop")
    arrival = time.time()
    salt = get_cache_salt(body)
    requests = [GenerationRequest(ids, choice_params(params, i), stop, encoded.message_ends, arrival, constraint,
                                  encoded.images, salt)
                for i in range(n)]
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(arrival), "model": name}
    async with contextlib.aclosing(merge(frontend.client, frontend.model, requests)) as events:
        events = parse_replies(events, ReplyFormat.of(frontend.model, encoded, tools if parse_tools else None))
        if stream:
            return await stream_chat(request, frontend, await primed(events), meta, n, include_usage,
                                     logprobs is not None)
        outcomes = await collect(events, n)
    choices = []
    for i, outcome in enumerate(outcomes):
        message = {"role": "assistant", "content": outcome.text if outcome.text or not outcome.tool_calls else None,
                   "refusal": None}
        if frontend.model.reasons:
            message["reasoning_content"] = outcome.reasoning or None
        if outcome.tool_calls:
            message["tool_calls"] = [tool_call_json(c) for c in outcome.tool_calls]
        choices.append({"index": i, "message": message, "finish_reason": outcome.finish.reason,
                        "stop_reason": outcome.finish.matched_stop,
                        "logprobs": {"content": token_logprobs(frontend.model, outcome.logprobs), "refusal": None}
                        if logprobs is not None else None})
    payload = {**meta, "object": "chat.completion", "choices": choices, "usage": usage(outcomes, n)}
    if get_bool(body, "return_token_ids", False):  # vLLM's extension, used by the parity tests
        payload["prompt_token_ids"] = ids
        for choice, outcome in zip(choices, outcomes):
            choice["token_ids"] = outcome.token_ids
    return json_response(payload)


async def stream_chat(request: web.Request, frontend: Frontend,
                      events: AsyncIterator[tuple[int, Delta | ToolCall | Finish]], meta: dict, n: int,
                      include_usage: bool, logprobs: bool) -> web.StreamResponse:
    stream = await open_stream(request)

    def chunk(index: int, delta: dict, finish: Finish | None = None, logprobs_: dict | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs_,
                  "finish_reason": finish.reason if finish else None}
        if finish:
            choice["stop_reason"] = finish.matched_stop
        payload = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    for i in range(n):
        stream.add(chunk(i, {"role": "assistant", "content": ""}))
    outcomes = [Outcome() for _ in range(n)]
    calls = [0] * n
    finished = 0

    async def body() -> None:
        nonlocal finished
        async for index, event in events:
            outcomes[index].add(event)
            if isinstance(event, Delta):
                entries = unpack(event.logprobs) if logprobs else []
                if event.text or event.reasoning or entries:
                    delta = {"reasoning_content": event.reasoning} if event.reasoning else {}
                    if event.text or not event.reasoning:
                        delta["content"] = event.text
                    stream.add(chunk(index, delta, None, {
                        "content": token_logprobs(frontend.model, entries), "refusal": None} if logprobs else None))
            elif isinstance(event, ToolCall):
                # As OpenAI streams a call: its id and name with empty arguments, then the arguments.
                call = {"index": calls[index], **tool_call_json(event)}
                arguments, call["function"]["arguments"] = call["function"]["arguments"], ""
                stream.add(chunk(index, {"tool_calls": [call]}))
                stream.add(chunk(index, {"tool_calls": [{"index": calls[index],
                                                          "function": {"arguments": arguments}}]}))
                calls[index] += 1
            else:
                stream.add(chunk(index, {}, event))
                finished += 1
            if finished < n:  # after the last finish, the stream ends without waiting: one write
                await stream.flush()
        if include_usage:
            stream.add(sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(outcomes, n)}))

    return await finish_openai_stream(stream, body())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
