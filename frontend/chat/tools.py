"""Tools on the way in: every dialect's tool list in the one shape chat templates expect, past calls and results
in the shape the model's template takes them, and templates that know no tools taught the Hermes convention in the
system prompt. Calls on the way out are parsed in tool_parsers.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field

from common.errors import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")

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


def mistral_call_id(call_id: str) -> str:
    """Mistral's templates take only ids of 9 letters and digits; any other id maps to 9 that are stable, so a
    call and its result still match."""
    if MISTRAL_CALL_ID.fullmatch(call_id):
        return call_id
    return hashlib.blake2b(call_id.encode(), digest_size=8).hexdigest()[:9]


def for_template(messages: list[dict], tools: list[dict] | None, supports_tools: bool, tool_format: str
                 ) -> tuple[list[dict], list[dict] | None]:
    """What the template renders. A template that knows no tools gets them, and past calls and results, as
    Hermes-style text: the tools in the system prompt, calls in <tool_call> tags, results in <tool_response> in a
    user turn (results in a row, and the user's text after them, share one turn: templates such as Gemma's insist
    that user and assistant alternate)."""
    if supports_tools:
        return (_mistral_ids(messages) if tool_format == "mistral" else messages), tools
    result: list[dict] = []
    results_turn = False  # the last turn holds tool results
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            text = message.get("content") or ""
            rest = {key: value for key, value in message.items() if key != "tool_calls"}
            result.append({**rest, "content": f"{text}\n{calls}" if text else calls})
        elif message["role"] in ("tool", "user") and results_turn:
            text = message["content"]
            text = f"<tool_response>\n{text}\n</tool_response>" if message["role"] == "tool" else text
            result[-1] = {**result[-1], "content": f"{result[-1]['content']}\n{text}"}
        elif message["role"] == "tool":
            result.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            result.append(message)
        results_turn = message["role"] == "tool" or (results_turn and message["role"] == "user")
    if tools:
        prompt = HERMES_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{prompt}"}
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result, None


def _mistral_ids(messages: list[dict]) -> list[dict]:
    result = []
    for message in messages:
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [{**c, "id": mistral_call_id(c["id"])} for c in message["tool_calls"]]}
        elif message["role"] == "tool":
            message = {**message, "tool_call_id": mistral_call_id(message.get("tool_call_id") or "")}
        result.append(message)
    return result
