"""The bounds on structured-output constraints (common/constraint_limits.py) refuse what would crash or stall the
grammar engine, and none of the grammars and schemas applications send."""

from __future__ import annotations

import json

import pytest

from common.constraint_limits import constraint_problem
from common.protocol import Constraint
from frontend.chat.structured import after_reasoning, json_schema_text
from frontend.chat.tool_parsers import forced_call
from frontend.chat.tools import function_tool
from tests.support.structured_schemas import SCHEMAS

# A JSON grammar as people write it in Lark: quoted brackets, character classes and counted repetitions.
JSON_LARK = r'''
?start: value
?value: object | array | string | NUMBER | "true" | "false" | "null"
array: "[" [value ("," value)*] "]"
object: "{" [pair ("," pair)*] "}"
pair: string ":" value
string: /"([^"\\]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,200}"/
NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?/
'''


def test_what_applications_send_is_within_the_bounds() -> None:
    for _, schema in SCHEMAS:
        assert constraint_problem("json_schema", json_schema_text(schema, "schema")) is None
    plain = [schema for _, schema in SCHEMAS if "$ref" not in json.dumps(schema)]  # refs do not nest into calls
    tools = [function_tool(f"tool_{i}", "a tool", schema, f"tools[{i}]") for i, schema in enumerate(plain)]
    for tool_format in ("hermes", "mistral"):
        call = forced_call(tools, tools, tool_format)  # validated by the grammar engine's worker process too
        assert constraint_problem(call.kind, call.text) is None
    assert constraint_problem("lark", JSON_LARK) is None
    assert constraint_problem("gbnf", 'root ::= "(" [a-z]{1,8} ")" | "[" digit{3} "]"\ndigit ::= [0-9]') is None
    for regex in (r"\d{4}-\d{2}-\d{2}", r"[(\[]{2}(a|b){0,100}", r"(\w+@\w+\.com){1,10}"):
        assert constraint_problem("regex", regex) is None
    wrapped = after_reasoning(Constraint("json_schema", json_schema_text(SCHEMAS[0][1], "schema")), False)
    assert constraint_problem(wrapped.kind, wrapped.text) is None


@pytest.mark.parametrize("kind,text,bound", [
    ("regex", "((a{100}){100}){2}", "expands to 20000 items"),
    ("regex", "(" * 65 + "a" + ")" * 65, "nest more than 64 deep"),
    ("lark", "start: " + "[" * 65 + '"a"' + "]" * 65, "nest more than 64 deep"),
    ("gbnf", "\n".join(f"r{i} ::= r{i + 1}" for i in range(1001)), "1001 rules"),
    ("choice", json.dumps([f"c{i}" for i in range(1001)]), "1001 choices"),
    ("json_schema", json.dumps({"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(501)}}), "'$ref's"),
    ("json_schema", json.dumps({"type": "string", "pattern": "(x{200}){200}"}), "'pattern': a counted repetition"),
    ("json_schema", json.dumps({"enum": list(range(1001))}), "'enum' has 1001 branches"),
    ("llguidance", json.dumps({"grammars": [{"lark_grammar": "start: @a"}, {"name": "a", "json_schema": {
        "anyOf": [{"const": i} for i in range(1001)]}}]}), "'anyOf' has 1001 branches"),
])
def test_past_a_bound_the_problem_names_it(kind: str, text: str, bound: str) -> None:
    assert bound in (constraint_problem(kind, text) or "")
