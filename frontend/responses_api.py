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
from frontend.errors_render import as_flare_error
from frontend.generation import Delta, Finish, GenerationRequest, merge, with_tool_calls
from frontend.logprobs import TokenLogprob, token_logprobs, unpack
from frontend.model import ServedModel
from frontend.models_api import requested_model
from frontend.image_inputs import encode_chat
from frontend.openai_api import message_text, request_tools, text_format
from frontend.params import get_bool, get_stop, get_str
from frontend.sampling import requested_max_tokens, sampling_params, top_logprobs
from frontend.server import frontend_of, read_json
from frontend.streaming import open_stream, primed, sse
from frontend.tools import ToolCall, assistant_tool_call

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# ResponseError.code has a fixed vocabulary.
ERROR_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def input_messages(body: dict) -> list[dict]:
    """`instructions` and `input` (a string, or message / function_call / function_call_output items) as chat
    messages; consecutive function calls join one assistant turn."""
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
        elif kind != "reasoning":  # reasoning items carry nothing a non-reasoning model can use
            raise InvalidRequest(f"{where}.type {str(kind)[:40]!r} is not supported", param="input")
    return messages


def usage(finish: Finish) -> dict:
    return {"input_tokens": finish.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": finish.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
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
        self._message: dict | None = None

    def event(self, kind: str, **fields: object) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def snapshot(self, status: str, **fields: object) -> dict:
        return {**self.base, "status": status, "output": copy.deepcopy(self.output), **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def text(self, text: str, entries: list[TokenLogprob]) -> list[dict]:
        events = [] if self._message is not None else self._open_message()
        part = self._message["content"][0]
        logprobs = token_logprobs(self.model, entries) if self.logprobs else []
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self.event("response.output_text.delta", item_id=self._message["id"],
                                 output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=logprobs))
        return events

    def _open_message(self) -> list[dict]:
        self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                         "status": "in_progress", "content": []}
        self.output.append(self._message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1,
                             item=copy.deepcopy(self._message)),
                  self.event("response.content_part.added", item_id=self._message["id"],
                             output_index=len(self.output) - 1, content_index=0, part=copy.deepcopy(part))]
        self._message["content"].append(part)
        return events

    def _close_message(self, status: str = "completed") -> list[dict]:
        message, self._message = self._message, None
        if message is None:
            return []
        part, index = message["content"][0], self.output.index(message)
        message["status"] = status
        common = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [self.event("response.output_text.done", **common, text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", **common, part=copy.deepcopy(part)),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(message))]

    def tool_call(self, call: ToolCall) -> list[dict]:
        events = self._close_message()
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
        events = self._open_message() if not self.output else []  # clients look for a message, even an empty one
        complete = finish.reason != "length"
        events += self._close_message("completed" if complete else "incomplete")
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
            return self.text(event.text, entries) if event.text or (self.logprobs and entries) else []
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
    messages = input_messages(body)
    text = body.get("text")
    text_format(text.get("format") if isinstance(text, dict) else text, "text.format")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    top = top_logprobs(body, "top_logprobs")
    logprobs = (top or 0) if LOGPROBS_INCLUDE in include else None
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object", param="metadata")
    stream = get_bool(body, "stream", False)
    tools, parse_tools = request_tools(body, flat=True)
    ids, message_ends, images = await encode_chat(frontend, messages, tools, True, {})
    max_tokens = requested_max_tokens(body, "max_output_tokens")
    params = sampling_params(frontend.model, body, len(ids), max_tokens, logprobs=logprobs)
    arrival = time.time()
    base = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": arrival, "error": None,
            "incomplete_details": None, "instructions": get_str(body, "instructions"),
            "max_output_tokens": max_tokens, "model": name, "parallel_tool_calls": get_bool(body,
            "parallel_tool_calls", True), "previous_response_id": None, "store": False,
            "temperature": params.temperature, "top_p": params.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "top_logprobs": top, "truncation": "disabled",
            "tools": [{"type": "function", **t["function"]} for t in tools or []], "usage": None,
            "metadata": metadata}
    builder = ResponseBuilder(frontend.model, base, logprobs is not None)
    generation = GenerationRequest(ids, params, get_stop(body, "stop"), message_ends, arrival, images)
    async with contextlib.aclosing(merge(frontend.client, frontend.model, [generation])) as events:
        events = with_tool_calls(events, tools if parse_tools else None)
        if stream:
            return await stream_response(request, builder, await primed(events))
        emitted: list[dict] = []
        async for _, event in events:
            emitted = builder.add(event)
    return web.json_response(emitted[-1]["response"])  # the Finish came last: its terminal event


async def stream_response(request: web.Request, builder: ResponseBuilder,
                          events: AsyncIterator[tuple[int, Delta | ToolCall | Finish]]) -> web.StreamResponse:
    response = await open_stream(request)

    async def send(payloads: list[dict]) -> None:
        for payload in payloads:
            await response.write(sse(payload, payload["type"]))

    await send(builder.start())
    try:
        async for _, event in events:
            await send(builder.add(event))
    except ConnectionResetError:
        raise
    except Exception as exc:
        await send(builder.fail(as_flare_error(exc)))
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", responses)
