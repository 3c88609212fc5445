"""Tool calls parsed from the model's text as it streams, in the format its chat template taught it (docs/design.md,
Frontends and dialects; README.md, Reasoning and tool calls). The format is read from the template text: one that writes
`[TOOL_CALLS]` is Mistral's, any other is Hermes (Qwen2.5/Qwen3's own, and what a template that knows no tools is
taught, see tools.py).

- Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them.
- Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 and tekken templates), or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (an optional `[CALL_ID]id` before `[ARGS]`), repeated for several calls.
- Llama 3 JSON, in either format: the whole reply is `{"name": ..., "parameters": {...}}`, several separated by `;`.
A call must name a declared tool and carry an object of arguments; anything else stays text.
"""

from __future__ import annotations

import json
import re

from common.protocol import Constraint
from frontend.chat.reasoning import partial_suffix
from frontend.chat.structured import checked, json_constraint, json_schema_text
from frontend.chat.tools import ToolCall

MISTRAL_OPEN = "[TOOL_CALLS]"
# What follows a Mistral [TOOL_CALLS] in the newer form: a name, an optional call id, then [ARGS] and the object.
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.:-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")


def tool_format(template_source: str) -> str:
    return "mistral" if MISTRAL_OPEN in template_source else "hermes"


def forced_call(tools: list[dict], all_tools: list[dict], tool_format: str) -> Constraint:
    """The grammar of one call to one of `tools`, its arguments following that tool's parameter schema, written
    as the model family writes calls (the parsers below read them back): Hermes `<tool_call>` tags around {"name",
    "arguments"}, or Mistral's `[TOOL_CALLS]name[ARGS]{...}`. Markers that are special tokens are spelled in text
    pieces, which decode to the same text the reply parser reads."""
    names = [t["function"]["name"] for t in all_tools]
    calls = []
    for tool in tools:
        function = tool["function"]
        json_constraint(function["parameters"], f"tools[{names.index(function['name'])}].parameters")
        calls.append(function)
    if tool_format == "mistral":
        bodies = [f'"{MISTRAL_OPEN}{f["name"]}[ARGS]" %json {json_schema_text(f["parameters"], "tools")}'
                  for f in calls]
        return checked(Constraint("lark", "start: " + " | ".join(bodies)), "tools")
    shapes = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
               "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in calls]
    schema = json_schema_text(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}, "tools")
    tags = f'"{HermesParser.OPEN}\\n" call "\\n{HermesParser.CLOSE}"'
    return checked(Constraint("lark", f"start: {tags}\ncall: %json {schema}"), "tools")


def tool_parser(format_: str, names: set[str]) -> ToolCallParser:
    return MistralParser(names) if format_ == "mistral" else HermesParser(names)


class ToolCallParser:
    """Feed text as it is generated; get back text that is safe to show and tool calls once they are complete.
    Text that may begin a call is held back until it is known not to. Subclasses read what follows OPEN."""

    OPEN = ""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.calls = 0
        self._buffer = ""
        self._mode = "start"  # start: only whitespace so far | text | call: after OPEN | json: Llama 3
        self._fresh = ""  # the text just fed: a call can only have completed in it

    def feed(self, text: str) -> list[str | ToolCall]:
        return self._feed(text, final=False)

    def _feed(self, text: str, final: bool) -> list[str | ToolCall]:
        self._buffer += text
        self._fresh = text
        out: list[str | ToolCall] = []
        while True:
            if self._mode == "start":
                stripped = self._buffer.lstrip()
                if not stripped or (self.OPEN.startswith(stripped) and not final):
                    return out
                self._mode = "json" if stripped[0] in "{[" and not stripped.startswith(self.OPEN) else "text"
            if self._mode == "json":
                return out
            if self._mode == "text":
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    # Held back: what may begin OPEN, and trailing whitespace, which is formatting (and dropped)
                    # if a call follows it, and content if text does.
                    safe = len(self._buffer) - partial_suffix(self._buffer, self.OPEN)
                    shown = self._buffer[:safe].rstrip()
                    if shown:
                        out.append(shown)
                        self._buffer = self._buffer[len(shown):]
                    return out
                if self._buffer[:at].strip():
                    out.append(self._buffer[:at].rstrip())
                self._buffer, self._mode = self._buffer[at + len(self.OPEN):], "call"
            pieces = self._take_call(final)
            if pieces is None:
                return out
            out += pieces
            self._mode = "text"

    def finish(self) -> list[str | ToolCall]:
        """The end of generation: whatever was held back is either complete calls or text after all."""
        out = self._feed("", final=True)
        if self._mode == "json":
            rest, self._buffer = self._buffer, ""
            calls = self._json_calls(rest)
            out.extend(calls if calls else [rest])
        rest, self._buffer = self._buffer, ""
        if self._mode != "json" and (self.calls == 0 or rest.strip()):
            out.append(rest)
        return [piece for piece in out if piece != ""]

    def _take_call(self, final: bool) -> list[str | ToolCall] | None:
        """The call(s) at the start of the buffer, consumed; None while incomplete. With `final`, what cannot
        be a call is returned as text (OPEN included), never None."""
        raise NotImplementedError

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

    def _all_calls(self, values: list[object]) -> list[ToolCall]:
        """Every value as a call, or none of them."""
        calls = [self._as_call(v) for v in values]
        if not calls or None in calls:
            return []
        self.calls += len(calls)
        return calls  # type: ignore[return-value]

    def _json_calls(self, text: str) -> list[ToolCall]:
        decoder, values, at = json.JSONDecoder(), [], 0
        text = text.strip()
        try:
            while at < len(text):
                value, at = decoder.raw_decode(text, at)
                values.extend(value if isinstance(value, list) else [value])
                at = len(text) - len(text[at:].lstrip().lstrip(";").lstrip())
        except ValueError:
            return []
        return self._all_calls(values)


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _take_call(self, final: bool) -> list[str | ToolCall] | None:
        end = self._buffer.find(self.CLOSE)
        if end < 0:
            if not final:
                return None
            body, self._buffer = self._buffer, ""
            return [self._call(body) or f"{self.OPEN}{body}"]
        body, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE):]
        return [self._call(body) or f"{self.OPEN}{body}{self.CLOSE}"]

    def _call(self, text: str) -> ToolCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = self._all_calls([value])
        return calls[0] if calls else None


class MistralParser(ToolCallParser):
    OPEN = MISTRAL_OPEN

    def _take_call(self, final: bool) -> list[str | ToolCall] | None:
        body = self._buffer.lstrip()
        if body[:1] == "[":  # a JSON array of calls
            value, end = _complete_json(body, 0, final or "]" in self._fresh)
            calls = self._all_calls(value) if isinstance(value, list) else []
        else:  # name[ARGS]{...}
            named = _MISTRAL_NAMED.match(body)
            rest = body[named.end():].lstrip() if named else ""
            broken = rest[:1] not in ("", "{") and not _begins_marker(rest)
            if (named is None and body) or broken:
                return self._not_a_call()
            if rest[:1] != "{":  # the name or its markers may still go on
                return self._not_a_call() if final else None
            value, end = _complete_json(body, len(body) - len(rest), final or "}" in self._fresh)
            calls = self._all_calls([{"name": named[1], "arguments": value}]) if isinstance(value, dict) else []
        if end is None:
            return self._not_a_call() if final else None
        if not calls:
            return self._not_a_call()
        self._buffer = body[end:]
        return calls  # type: ignore[return-value]

    def _not_a_call(self) -> list[str | ToolCall]:
        """The marker is text after all; what follows it is read again as text (it may hold another call)."""
        return [self.OPEN]


def _begins_marker(text: str) -> bool:
    """Whether `text` is, or begins, one of the markers between a Mistral call's name and its arguments."""
    return any(text.startswith(m) or m.startswith(text) for m in ("[ARGS]", "[CALL_ID]"))


def _complete_json(text: str, start: int, attempt: bool) -> tuple[object, int | None]:
    """The JSON value at `start` and where it ends, once the text holds all of it; (None, None) before. Parsing is
    attempted only when a closing bracket has just arrived, so a long value is not re-read for every token."""
    if not attempt:
        return None, None
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None, None
