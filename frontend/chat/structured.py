"""Structured output requests (docs/design.md, Beyond plain decoding): each dialect's field becomes one Constraint for
the wire, bounded (common/constraint_limits.py) and validated with the grammar engine the engine compiles with
(llguidance: torch-free, so the frontend may import it; it runs in worker processes, grammar_check.py), so a bad or
oversized schema or grammar is a 400 naming its field before anything reaches the engine.

Fields: OpenAI `response_format` (chat, completions) and Responses `text.format`: json_object / json_schema;
forced tool calls (tools.py builds their grammar); and the extension field `structured_outputs`, as vLLM names
it: exactly one of {"json": schema, "regex": str, "choice": [str, ...], "grammar": EBNF/GBNF/Lark str}.

A model that reasons (`<think>…</think>`, frontend/chat/reasoning.py) reasons freely first: `after_reasoning` wraps the
constraint in an llguidance grammar whose answer part is the original grammar, so the grammar applies after the
reasoning part.

JSON is generated compactly (", " and ": " separators, no other whitespace) unless the schema's own
"x-guidance" options say otherwise: free whitespace lets a small model pad forever instead of answering.
"""

from __future__ import annotations

import json
import re

from llguidance import grammar_from

from common.constraint_limits import constraint_problem
from common.errors import InvalidRequest
from common.protocol import Constraint
from frontend.chat import reasoning
from frontend.chat.grammar_check import VALIDATOR, ValidatorCrashed

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EXTENSION = "structured_outputs"
EXTENSION_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf"}


def json_schema_text(schema: object, param: str) -> str:
    """A schema as the wire carries it: an object, with the compact layout unless it sets its own."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{param}' must be a JSON schema object", param=param)
    return json.dumps({"x-guidance": JSON_LAYOUT, **schema}, ensure_ascii=False)


def checked(constraint: Constraint, param: str) -> Constraint:
    """The constraint, if it is within the bounds (common/constraint_limits.py) and the grammar engine accepts it:
    unknown or unsupported keywords, unsatisfiable schemas and malformed grammars are a 400 that names the field.
    The grammar engine runs in a worker process (grammar_check.py) and waits there, so this runs on the frontend's
    worker pool, never on the event loop."""
    problem = constraint_problem(constraint.kind, constraint.text)
    if problem is not None:
        raise InvalidRequest(f"'{param}' is too large to enforce: {problem}", param=param)
    try:
        error, messages = VALIDATOR.check(constraint.kind, constraint.text)
    except ValidatorCrashed:
        raise InvalidRequest(f"'{param}' cannot be enforced: the grammar engine failed on it", param=param) from None
    if error:
        detail = messages[0].strip() if messages else "invalid"
        raise InvalidRequest(f"'{param}' cannot be enforced: {detail[:400]}", param=param)
    return constraint


def json_constraint(schema: object, param: str) -> Constraint:
    return checked(Constraint("json_schema", json_schema_text(schema, param)), param)


def response_format(value: object, param: str, flat: bool = False) -> Constraint | None:
    """OpenAI's response_format ({"type": "json_schema", "json_schema": {"name", "schema", "strict"}}) or, `flat`,
    Responses' text.format ({"type": "json_schema", "name", "schema", "strict"}). None for plain text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_constraint({"type": "object"}, param)
    if kind != "json_schema":
        raise InvalidRequest(f"'{param}' must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}, "
                             f"got type {str(kind)[:40]!r}", param=param)
    spec = value if flat else value.get("json_schema")
    where = param if flat else f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(f"'{where}' must be an object with 'name' and 'schema'", param=param)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"'{where}.name' must be a string", param=param)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequest(f"'{where}.strict' must be a boolean", param=param)
    return json_constraint(spec.get("schema", {}), f"{where}.schema")


def extension(body: dict) -> Constraint | None:
    """vLLM's `structured_outputs` field: exactly one of json, regex, choice, grammar."""
    value = body.get(EXTENSION)
    if value is None:
        return None
    given = [key for key in EXTENSION_KINDS if isinstance(value, dict) and value.get(key) is not None]
    if not isinstance(value, dict) or len(given) != 1 or set(value) - set(EXTENSION_KINDS):
        raise InvalidRequest(f"'{EXTENSION}' must be an object with exactly one of {sorted(EXTENSION_KINDS)}",
                             param=EXTENSION)
    key = given[0]
    param, item = f"{EXTENSION}.{key}", value[key]
    if key == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError as exc:
                raise InvalidRequest(f"'{param}' is not valid JSON: {exc}", param=param) from None
        return json_constraint(item, param)
    if key == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise InvalidRequest(f"'{param}' must be a non-empty list of strings", param=param)
        return checked(Constraint("choice", json.dumps(item, ensure_ascii=False)), param)
    if not isinstance(item, str) or not item.strip():
        raise InvalidRequest(f"'{param}' must be a non-empty string", param=param)
    return checked(Constraint(EXTENSION_KINDS[key], item), param)


def one_of(*constraints: tuple[str, Constraint | None]) -> Constraint | None:
    """At most one structured-output field per request; two would contradict each other."""
    given = [(name, c) for name, c in constraints if c is not None]
    if len(given) > 1:
        raise InvalidRequest(f"'{given[0][0]}' and '{given[1][0]}' cannot be combined", param=given[1][0])
    return given[0][1] if given else None


def after_reasoning(constraint: Constraint | None, opened: bool) -> Constraint | None:
    """The constraint behind a free reasoning part: required and already open when the prompt opened `<think>`
    (`opened`), otherwise optional (the reply may open it, or answer at once). Whitespace after the reasoning is
    formatting (the reply parser drops it)."""
    if constraint is None:
        return None
    grammar = grammar_from(constraint.kind, constraint.text)
    answer = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    answer[0] = {**answer[0], "name": "answer"}
    # A lazy lexeme ends at the first match of its whole regex, so the closing tag belongs inside it.
    close = re.escape(reasoning.CLOSE).replace("/", "\\/")
    thought = f"thought[lazy]: /(?s:.*){close}/\nws: /[ \\t\\r\\n]*/"
    start = "start: thought ws @answer" if opened else f"start: ({json.dumps(reasoning.OPEN)} thought ws)? @answer"
    return Constraint("llguidance", json.dumps({"grammars": [{"lark_grammar": f"{start}\n{thought}"}, *answer]}))
