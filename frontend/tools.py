"""Tools: every dialect's tool list in the one shape chat templates expect, templates that know no tools taught the
Hermes convention in the system prompt, and tool calls parsed from the model's text as it streams.

Recognised output formats: Hermes/Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
text around them) and Llama 3 JSON (the whole reply is `{"name": ..., "parameters": {...}}`, several separated by
`;`). A call must name a declared tool and carry an object of arguments; anything else stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from common.errors import InvalidRequest
from common.protocol import Constraint
from frontend.structured import checked, json_constraint, json_schema_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"

HERMES_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


# --- requests -----------------------------------------------------------------------------------------------------
def function_tool(name: object, description: object, parameters: object, where: str) -> dict:
    """One tool as transformers' chat templates take it: {"type": "function", "function": {...}}."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", name):
        raise InvalidRequest(f"{where}.name must be 1 to 128 letters, digits, '_', '.', ':' or '-'", param="tools")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.description must be a string", param="tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"{where} parameters must be a JSON schema object", param="tools")
    function = {"name": name, "description": description or "",
                "parameters": parameters if parameters is not None else {"type": "object", "properties": {}}}
    return {"type": "function", "function": function}


def check_tools(tools: list[dict]) -> list[dict] | None:
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    return tools or None


def tool_choice(choice: object, tools: list[dict], anthropic: bool = False) -> tuple[bool, list[dict] | None]:
    """(whether calls are parsed from the output, the tools one of which the reply must call or None).
    OpenAI: "auto" | "none" | "required" | {"type": "function", "function": {"name"}} (Responses: {"type":
    "function", "name"}); Anthropic: {"type": "auto" | "none" | "any"} | {"type": "tool", "name"}."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in (None, "auto"):
        return True, None
    if kind == "none":
        return False, None
    if kind == ("any" if anthropic else "required"):
        return True, tools
    if isinstance(choice, dict) and kind == ("tool" if anthropic else "function"):
        function = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = function.get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise InvalidRequest(f"tool_choice names tool {str(name)[:60]!r}, which is not in 'tools'",
                                 param="tool_choice")
        return True, chosen
    shapes = ('{"type": "auto" | "none" | "any"} or {"type": "tool", "name": ...}' if anthropic else
              '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}')
    raise InvalidRequest(f"tool_choice must be {shapes}, got {json.dumps(choice)[:60]}", param="tool_choice")


def forced_call(tools: list[dict], all_tools: list[dict], hermes: bool) -> Constraint:
    """The grammar of one call to one of `tools`, its arguments following that tool's parameter schema, in the
    family's format: Hermes tags around {"name", "arguments"}, or (templates that render tools themselves without
    those tags) Llama 3's bare {"name", "parameters"}."""
    names = [t["function"]["name"] for t in all_tools]
    key = "arguments" if hermes else "parameters"
    calls = []
    for tool in tools:
        function = tool["function"]
        param = f"tools[{names.index(function['name'])}].parameters"
        json_constraint(function["parameters"], param)  # a 400 naming the tool, not the combined grammar
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                      "properties": {"name": {"const": function["name"]}, key: function["parameters"]}})
    schema = json_schema_text(calls[0] if len(calls) == 1 else {"anyOf": calls}, "tools")
    body = f'"{OPEN}\\n" call "\\n{CLOSE}"' if hermes else "call"
    return checked(Constraint("lark", f"start: {body}\ncall: %json {schema}"), "tools")


def uses_hermes_calls(template_source: str) -> bool:
    """Whether the family writes calls in Hermes tags: templates that know no tools are taught them (for_template),
    and templates that render tools with them say so."""
    return not template_supports_tools(template_source) or OPEN in template_source


def assistant_tool_call(call_id: str, name: str, arguments: object) -> dict:
    """A past call in the shape templates read; templates apply `tojson` to arguments, so a JSON string from
    the client becomes the object it encodes."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def template_supports_tools(source: str) -> bool:
    return re.search(r"\btools\b", source) is not None


def hermes_call(name: str, arguments: object) -> str:
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{payload}\n{CLOSE}"


def for_template(messages: list[dict], tools: list[dict] | None, supports_tools: bool
                 ) -> tuple[list[dict], list[dict] | None]:
    """What the template renders. A template that knows no tools gets them, and past calls and results, as
    Hermes-style text: the tools in the system prompt, calls in <tool_call> tags, results in <tool_response>."""
    if supports_tools:
        return messages, tools
    result = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            text = message.get("content") or ""
            result.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif message["role"] == "tool":
            result.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            result.append(message)
    if tools:
        prompt = HERMES_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{prompt}"}
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result, None


# --- output -------------------------------------------------------------------------------------------------------
class ToolCallParser:
    """Feed text as it is generated; get back text that is safe to show and tool calls once they are complete.
    Text that may begin a call is held back until it is known not to."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.calls = 0
        self._buffer = ""
        self._mode = "start"  # start: only whitespace so far | text | call: inside <tool_call> | json: Llama 3

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            if self._mode == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    return out
                self._mode = "json" if stripped[0] in "{[" else "text"
            if self._mode == "json":
                return out
            if self._mode == "text":
                at = self._buffer.find(OPEN)
                if at < 0:
                    # Held back: what may begin <tool_call>, and trailing whitespace, which is formatting (and
                    # dropped) if a call follows it, and content if text does.
                    safe = len(self._buffer) - _partial_suffix(self._buffer, OPEN)
                    shown = self._buffer[:safe].rstrip()
                    if shown:
                        out.append(shown)
                        self._buffer = self._buffer[len(shown):]
                    return out
                if self._buffer[:at].strip():
                    out.append(self._buffer[:at].rstrip())
                self._buffer, self._mode = self._buffer[at + len(OPEN):], "call"
            end = self._buffer.find(CLOSE)
            if end < 0:
                return out
            body, self._buffer, self._mode = self._buffer[:end], self._buffer[end + len(CLOSE):], "text"
            out.append(self._call(body) or f"{OPEN}{body}{CLOSE}")

    def finish(self) -> list[str | ToolCall]:
        """The end of generation: whatever was held back is either complete calls or text after all."""
        out: list[str | ToolCall] = []
        rest, self._buffer = self._buffer, ""
        if self._mode == "json":
            calls = self._llama_calls(rest)
            out.extend(calls if calls else [rest])
        elif self._mode == "call":
            out.append(self._call(rest) or f"{OPEN}{rest}")
        elif self.calls == 0 or rest.strip():
            out.append(rest)
        return [piece for piece in out if piece != ""]

    def _call(self, text: str) -> ToolCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        call = self._as_call(value)
        if call is not None:
            self.calls += 1
        return call

    def _as_call(self, value: object) -> ToolCall | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None

    def _llama_calls(self, text: str) -> list[ToolCall]:
        decoder, values, at = json.JSONDecoder(), [], 0
        text = text.strip()
        try:
            while at < len(text):
                value, at = decoder.raw_decode(text, at)
                values.extend(value if isinstance(value, list) else [value])
                at = len(text) - len(text[at:].lstrip().lstrip(";").lstrip())
        except ValueError:
            return []
        calls = [self._as_call(v) for v in values]
        if not calls or None in calls:
            return []
        self.calls += len(calls)
        return calls  # type: ignore[return-value]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    return max((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), default=0)
