"""The OpenAI Responses dialect: POST /v1/responses, streaming (response.created ... response.completed, each
event numbered) and not. Nothing is stored, so `previous_response_id` is refused."""

from __future__ import annotations

import contextlib
import copy
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from common.errors import FlareError, InvalidRequest
from frontend.api.errors import as_flare_error
from frontend.api.json_body import json_response
from frontend.api.logprobs import TokenLogprob, token_logprobs, unpack
from frontend.api.models import requested_model
from frontend.api.openai_chat import message_text, output_constraint, request_tools
from frontend.api.params import get_bool, get_cache_salt, get_stop, get_str
from frontend.api.sampling import requested_max_tokens, sampling_params, top_logprobs
from frontend.chat.replies import ReplyFormat, parse_replies
from frontend.chat.structured import after_reasoning
from frontend.chat.tools import ToolCall, assistant_tool_call
from frontend.generation import Delta, Finish, GenerationRequest, merge
from frontend.images.inputs import encode_chat
from frontend.model import ServedModel
from frontend.server import frontend_of, read_json
from frontend.streaming import open_stream, primed, sse

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# ResponseError.code has a fixed vocabulary.
ERROR_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def input_messages(body: dict, reasons: bool) -> list[dict]:
    """`instructions` and `input` (a string, or message / function_call / function_call_output / reasoning
    items) as chat messages; a reasoning item, the function calls and the message after it join one assistant
    turn (its reasoning_content, for a model that `reasons`; others have no use for it)."""
    messages = []
    instructions = get_str(body, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a non-empty string or list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise InvalidRequest(f"{where}.role must be one of {sorted(ROLES)}, got {str(item.get('role'))[:40]!r}",
                                     param="input")
            content = message_text(item.get("content"), where, images=item["role"] == "user")
            if content is None:
                raise InvalidRequest(f"{where}.content is required", param="input")
            if ROLES[item["role"]] == "assistant" and _open_turn(messages) and not messages[-1]["content"]:
                messages[-1]["content"] = content
            else:
                messages.append({"role": ROLES[item["role"]], "content": content})
        elif kind == "function_call":
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise InvalidRequest(f"{where} needs string 'call_id', 'name' and 'arguments'", param="input")
            call = assistant_tool_call(item["call_id"], item["name"], item["arguments"])
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else message_text(output, where)
            if not isinstance(item.get("call_id"), str) or text is None:
                raise InvalidRequest(f"{where} needs a string 'call_id' and an 'output'", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            text = reasoning_text(item, where)
            if reasons and text:
                messages.append({"role": "assistant", "content": "", "reasoning_content": text})
        else:
            raise InvalidRequest(f"{where}.type {str(kind)[:40]!r} is not supported", param="input")
    return messages


def _open_turn(messages: list[dict]) -> bool:
    """The last turn is an assistant's that holds only reasoning so far."""
    return bool(messages) and messages[-1]["role"] == "assistant" and "reasoning_content" in messages[-1] \
        and not messages[-1].get("tool_calls")


def reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text parts, or its summary when it has no content."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequest(f"{where}.content must be a list of reasoning_text parts", param="input")
    return "".join(p["text"] for p in parts)


def usage(finish: Finish) -> dict:
    return {"input_tokens": finish.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": finish.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": finish.reasoning_tokens},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


class ResponseBuilder:
    """Builds the response's output items from generation events, and the stream events that describe each step
    (a non-streaming request simply ignores them). Text after a tool call opens a new message item."""

    def __init__(self, model: ServedModel, base: dict, logprobs: bool) -> None:
        self.model = model
        self.base = base
        self.logprobs = logprobs
        self.output: list[dict] = []
        self.sequence = -1
        self._item: dict | None = None  # the message or reasoning item that text goes to

    def event(self, kind: str, **fields: object) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def snapshot(self, status: str, **fields: object) -> dict:
        return {**self.base, "status": status, "output": copy.deepcopy(self.output), **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def text(self, text: str, entries: list[TokenLogprob]) -> list[dict]:
        events = self._open("message")
        part = self._item["content"][0]
        logprobs = token_logprobs(self.model, entries) if self.logprobs else []
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=self._item["id"],
                                 output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=logprobs))
        return events

    def reasoning(self, text: str) -> list[dict]:
        events = self._open("reasoning")
        self._item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=self._item["id"],
                                 output_index=len(self.output) - 1, content_index=0, delta=text))
        return events

    def _open(self, kind: str) -> list[dict]:
        """The open item is a message or a reasoning item, with one content part; it is closed for another."""
        if self._item is not None and self._item["type"] == kind:
            return []
        events = self._close()
        if kind == "message":
            self._item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                          "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self._item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                          "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(self._item)
        events += [self.event("response.output_item.added", output_index=len(self.output) - 1,
                              item=copy.deepcopy(self._item)),
                   self.event("response.content_part.added", item_id=self._item["id"],
                              output_index=len(self.output) - 1, content_index=0, part=copy.deepcopy(part))]
        self._item["content"].append(part)
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._item = self._item, None
        if item is None:
            return []
        part, index = item["content"][0], self.output.index(item)
        item["status"] = status
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = self.event("response.output_text.done", **common, text=part["text"], logprobs=part["logprobs"]) \
            if item["type"] == "message" else self.event("response.reasoning_text.done", **common, text=part["text"])
        return [done, self.event("response.content_part.done", **common, part=copy.deepcopy(part)),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def tool_call(self, call: ToolCall) -> list[dict]:
        events = self._close()
        item = {"id": f"fc_{call.id}", "type": "function_call", "call_id": f"call_{call.id}", "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item)))
        item.update(arguments=call.arguments_json, status="completed")
        events += [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"]),
                   self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=call.name, arguments=item["arguments"]),
                   self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]
        return events

    def finish(self, finish: Finish) -> list[dict]:
        """A response that ran out of tokens is "incomplete", as OpenAI reports it."""
        answered = any(item["type"] != "reasoning" for item in self.output)
        events = [] if answered else self._open("message")  # clients look for a message, even an empty one
        complete = finish.reason != "length"
        events += self._close("completed" if complete else "incomplete")
        details = None if complete else {"reason": "max_output_tokens"}
        status = "completed" if complete else "incomplete"
        response = self.snapshot(status, usage=usage(finish), incomplete_details=details,
                                 completed_at=time.time() if complete else None)
        return events + [self.event(f"response.{status}", response=response)]

    def fail(self, error: FlareError) -> list[dict]:
        code = ERROR_CODES.get(error.status, "server_error")
        return [self.event("error", code=code, message=error.display(), param=error.param),
                self.event("response.failed", response=self.snapshot(
                    "failed", error={"code": code, "message": error.display()}))]

    def add(self, event: Delta | ToolCall | Finish) -> list[dict]:
        if isinstance(event, Delta):
            entries = unpack(event.logprobs)
            events = self.reasoning(event.reasoning) if event.reasoning else []
            # Logprobs of reasoning tokens are not reported (OpenAI reports none either).
            shown = event.text or (self.logprobs and entries and not event.reasoning)
            return events + (self.text(event.text, entries) if shown else [])
        return self.tool_call(event) if isinstance(event, ToolCall) else self.finish(event)


async def responses(request: web.Request) -> web.StreamResponse:
    frontend = frontend_of(request)
    body = await read_json(request)
    name = requested_model(frontend.model, body)
    if body.get("previous_response_id") is not None:
        raise InvalidRequest("'previous_response_id' is not supported: this server stores no responses; send the "
                             "conversation in 'input'", param="previous_response_id")
    if get_bool(body, "background", False):
        raise InvalidRequest("'background' responses are not supported", param="background")
    messages = input_messages(body, frontend.model.reasons)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise InvalidRequest("'text' must be an object", param="text")
    text_format = (text or {}).get("format")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    top = top_logprobs(body, "top_logprobs")
    logprobs = (top or 0) if LOGPROBS_INCLUDE in include else None
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object", param="metadata")
    stream = get_bool(body, "stream", False)
    tools, parse_tools, forced = await frontend.on_pool(request_tools, body, True, frontend.model)
    constraint = await frontend.on_pool(output_constraint, body, forced, "text.format", text_format, True)
    encoded = await encode_chat(frontend, messages, tools, True, {})
    constraint = after_reasoning(constraint, encoded.opens_reasoning) if frontend.model.reasons else constraint
    max_tokens = requested_max_tokens(body, "max_output_tokens")
    params = sampling_params(frontend.model, body, len(encoded.ids), max_tokens, logprobs=logprobs)
    arrival = time.time()
    base = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": arrival, "error": None,
            "incomplete_details": None, "instructions": get_str(body, "instructions"),
            "max_output_tokens": max_tokens, "model": name, "parallel_tool_calls": get_bool(body,
            "parallel_tool_calls", True), "previous_response_id": None, "store": False,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "top_logprobs": top, "truncation": "disabled",
            "tools": [{"type": "function", **t["function"]} for t in tools or []], "usage": None,
            "metadata": metadata}
    builder = ResponseBuilder(frontend.model, base, logprobs is not None)
    generation = GenerationRequest(encoded.ids, params, get_stop(body, "stop"), encoded.message_ends, arrival,
                                   constraint, encoded.images, get_cache_salt(body))
    async with contextlib.aclosing(merge(frontend.client, frontend.model, [generation])) as events:
        events = parse_replies(events, ReplyFormat.of(frontend.model, encoded, tools if parse_tools else None))
        if stream:
            return await stream_response(request, builder, await primed(events))
        emitted: list[dict] = []
        async for _, event in events:
            emitted = builder.add(event)
    return json_response(emitted[-1]["response"])  # the Finish came last: its terminal event


async def stream_response(request: web.Request, builder: ResponseBuilder,
                          events: AsyncIterator[tuple[int, Delta | ToolCall | Finish]]) -> web.StreamResponse:
    stream = await open_stream(request)

    def send(payloads: list[dict]) -> None:
        for payload in payloads:
            stream.add(sse(payload, payload["type"]))

    send(builder.start())
    try:
        async for _, event in events:
            send(builder.add(event))
            if not isinstance(event, Finish):  # after the finish, the stream ends without waiting: one write
                await stream.flush()
    except ConnectionResetError:
        raise
    except Exception as exc:
        send(builder.fail(as_flare_error(exc)))
    return await stream.close()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", responses)
