"""The Anthropic dialect: POST /v1/messages (streaming with Anthropic's full event sequence, and not) and
POST /v1/messages/count_tokens. A final assistant message is continued, as Anthropic's prefill is."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from common.errors import InvalidRequest
from common.protocol import Constraint
from frontend.api.errors import anthropic_error_event, as_flare_error
from frontend.api.json_body import json_response
from frontend.api.models import requested_model
from frontend.api.params import get_bool, get_cache_salt, get_int, get_stop
from frontend.api.sampling import sampling_params
from frontend.chat.replies import ReplyFormat, parse_replies
from frontend.chat.structured import after_reasoning, one_of, response_format
from frontend.chat.tool_parsers import forced_call
from frontend.chat.tools import ToolCall, assistant_tool_call, check_tools, function_tool, tool_choice
from frontend.generation import Delta, Finish, GenerationRequest, merge
from frontend.images.inputs import content_of, encode_chat, image_part, text_part
from frontend.model import EncodedChat, ServedModel
from frontend.server import Frontend, frontend_of, read_json
from frontend.streaming import open_stream, primed, sse

UNSUPPORTED_BLOCKS = ("document", "search_result", "container_upload")


def text_of(content: object, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise InvalidRequest(f"{where} must be a string or a list of text blocks", param=where.split("[")[0])


def image_source_url(source: object, where: str) -> str:
    """An image block's source as a URL: base64 becomes a data: URL (its media type checked with the bytes)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise InvalidRequest(f"{where} must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                         f"{{\"type\": \"url\", \"url\"}}", param="messages")


def conversation(body: dict) -> list[dict]:
    """`system` and `messages` as chat messages: tool_use blocks become the assistant's tool_calls, thinking blocks
    its reasoning_content, tool_result blocks become tool messages (before the user's own text, which follows
    them)."""
    result = []
    if body.get("system") is not None:
        system = text_of(body["system"], "system")
        if system:
            result.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"{where}.role must be 'user' or 'assistant'", param="messages")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            result.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise InvalidRequest(f"{where}.content must be a string or a non-empty list of content blocks",
                                 param="messages")
        parts, calls, results, thoughts = [], [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append(text_part(block["text"]))
            elif kind == "image" and role == "user":
                parts.append(image_part(image_source_url(block.get("source"), f"{at}.source")))
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("id"), str) \
                    and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
                calls.append(assistant_tool_call(block["id"], block["name"], block["input"]))
            elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
                output = text_of(block.get("content", ""), f"{at}.content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": f"Error: {output}" if block.get("is_error") else output})
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another server: nothing this model can read
            elif kind in UNSUPPORTED_BLOCKS:
                raise InvalidRequest(f"{at}: {kind} blocks are not supported by this model", param="messages")
            else:
                raise InvalidRequest(f"{at}: invalid or unknown block for a {role} message "
                                     f"(type {str(kind)[:40]!r})", param="messages")
        result += results
        if parts or calls or not results:
            turn = {"role": role, "content": content_of(parts)}
            if calls:
                turn["tool_calls"] = calls
            if thoughts:
                turn["reasoning_content"] = "".join(thoughts)
            result.append(turn)
    return result


def anthropic_tools(body: dict, tool_format: str) -> tuple[list[dict] | None, bool, Constraint | None]:
    """The tools, whether calls are parsed, and the grammar of a forced call (tool_choice any or tool)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequest("tools: must be a list", param="tools")
    tools = []
    for i, tool in enumerate(raw or []):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(f"tools[{i}]: only custom tools are supported (got type {str(kind)[:40]!r})",
                                 param="tools")
        tools.append(function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                                   f"tools[{i}]"))
    choice = body.get("tool_choice")
    if not tools and isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        raise InvalidRequest("tool_choice: forcing a tool call needs 'tools'", param="tool_choice")
    parse, forced = tool_choice(choice, tools, anthropic=True)
    return check_tools(tools), bool(tools) and parse, forced_call(forced, tools, tool_format) if forced else None


def output_format(body: dict) -> Constraint | None:
    """output_config.format: {"type": "json_schema", "schema": {...}} (Anthropic's structured outputs)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise InvalidRequest("output_config: must be an object", param="output_config")
    return response_format((config or {}).get("format"), "output_config.format", flat=True)


def thinking_enabled(body: dict, model: ServedModel) -> bool:
    """Whether the reply has thinking blocks. A model whose template reasons gets `enable_thinking` as this says;
    `budget_tokens` is checked but not enforced (the reasoning runs until the model closes it or max_tokens)."""
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is None or kind == "disabled":
        return False
    if kind not in ("enabled", "adaptive"):
        raise InvalidRequest('thinking: must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                             '{"type": "disabled"}', param="thinking")
    if kind == "enabled":
        get_int(thinking, "budget_tokens", None, 1)
    if not model.reasons:
        raise InvalidRequest("thinking: extended thinking is not supported by this model", param="thinking")
    return True


async def encode(frontend: Frontend, body: dict
                 ) -> tuple[EncodedChat, list[dict] | None, bool, bool, Constraint | None]:
    """The prompt, tools, whether calls are parsed, whether the reply thinks, and the output's constraint (a
    forced call or an output format)."""
    messages = conversation(body)
    tools, parse, forced = await frontend.on_pool(anthropic_tools, body, frontend.model.tool_format)
    constraint = one_of(("tool_choice", forced), ("output_config.format", await frontend.on_pool(output_format, body)))
    thinking = thinking_enabled(body, frontend.model)
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    extra = {"enable_thinking": thinking} if frontend.model.reasons else {}
    encoded = await encode_chat(frontend, messages, tools, True, extra, prefill)
    if frontend.model.reasons:
        constraint = after_reasoning(constraint, encoded.opens_reasoning)
    return encoded, tools, parse, thinking, constraint


async def count_tokens(request: web.Request) -> web.Response:
    frontend = frontend_of(request)
    body = await read_json(request)
    requested_model(frontend.model, body)
    encoded, *_ = await encode(frontend, body)
    return json_response({"input_tokens": len(encoded.ids)})


def stop_reason(finish: Finish) -> tuple[str, str | None]:
    if finish.reason == "tool_calls":
        return "tool_use", None
    if finish.reason == "length":
        return "max_tokens", None
    if isinstance(finish.matched_stop, str):
        return "stop_sequence", finish.matched_stop
    return "end_turn", None


def usage(finish: Finish) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
    return {"input_tokens": finish.prompt_tokens - finish.cached_tokens, "output_tokens": finish.completion_tokens,
            "cache_read_input_tokens": finish.cached_tokens, "cache_creation_input_tokens": 0}


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": call.arguments}


# Text and thinking blocks: their type, the field that holds their text, the delta that streams it, an empty one.
TEXT_BLOCKS = {"text": ("text", "text_delta", {"type": "text", "text": ""}),
               "thinking": ("thinking", "thinking_delta", {"type": "thinking", "thinking": "", "signature": ""})}


def text_pieces(event: Delta, thinking: bool) -> list[tuple[str, str]]:
    """(block type, text) of a delta; reasoning shows only when the request enabled thinking."""
    pieces = [("thinking", event.reasoning)] if thinking and event.reasoning else []
    return pieces + ([("text", event.text)] if event.text else [])


async def messages(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    max_tokens = get_int(body, "max_tokens", None, 1, 1 << 31)
    if max_tokens is None:
        raise InvalidRequest("max_tokens: field required", param="max_tokens")
    stream = get_bool(body, "stream", False)
    encoded, tools, parse, thinking, constraint = await encode(frontend, body)
    params = sampling_params(frontend.model, body, len(encoded.ids), max_tokens)
    generation = GenerationRequest(encoded.ids, params, get_stop(body, "stop_sequences"), encoded.message_ends,
                                   time.time(), constraint, encoded.images, get_cache_salt(body))
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": name,
               "content": []}
    async with contextlib.aclosing(merge(frontend.client, frontend.model, [generation])) as events:
        events = parse_replies(events, ReplyFormat.of(frontend.model, encoded, tools if parse else None))
        if stream:
            return await stream_message(request, await primed(events), message, len(encoded.ids), thinking)
        finish = None
        content = message["content"]
        async for _, event in events:
            if isinstance(event, Delta):
                for kind, text in text_pieces(event, thinking):
                    field, _, empty = TEXT_BLOCKS[kind]
                    if not content or content[-1]["type"] != kind:
                        content.append(dict(empty))
                    content[-1][field] += text
            elif isinstance(event, ToolCall):
                content.append(tool_use(event))
            elif isinstance(event, Finish):
                finish = event
    reason, sequence = stop_reason(finish)
    return json_response({**message, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(finish)})


async def stream_message(request: web.Request, events: AsyncIterator[tuple[int, Delta | ToolCall | Finish]],
                         message: dict, prompt_tokens: int, thinking: bool) -> web.StreamResponse:
    stream = await open_stream(request)
    block = -1  # index of the last block started
    open_kind: str | None = None  # the text or thinking block still open

    def send(kind: str, **fields: object) -> None:
        stream.add(sse({"type": kind, **fields}, kind))

    def close_block() -> None:
        nonlocal open_kind
        if open_kind is not None:
            send("content_block_stop", index=block)
            open_kind = None

    send("message_start", message={**message, "stop_reason": None, "stop_sequence": None,
                                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}})
    send("ping")
    try:
        async for _, event in events:
            if isinstance(event, Delta):
                for kind, text in text_pieces(event, thinking):
                    field, delta, empty = TEXT_BLOCKS[kind]
                    if open_kind != kind:
                        close_block()
                        block, open_kind = block + 1, kind
                        send("content_block_start", index=block, content_block=empty)
                    send("content_block_delta", index=block, delta={"type": delta, field: text})
            elif isinstance(event, ToolCall):
                close_block()
                block += 1
                send("content_block_start", index=block, content_block={**tool_use(event), "input": {}})
                send("content_block_delta", index=block,
                     delta={"type": "input_json_delta", "partial_json": event.arguments_json})
                send("content_block_stop", index=block)
            elif isinstance(event, Finish):
                close_block()
                reason, sequence = stop_reason(event)
                send("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage(event))
                send("message_stop")
            if not isinstance(event, Finish):  # after the finish, the stream ends without waiting: one write
                await stream.flush()
    except ConnectionResetError:
        raise
    except Exception as exc:
        stream.add(anthropic_error_event(as_flare_error(exc)))
    return await stream.close()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
