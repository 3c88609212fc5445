"""How large a structured-output constraint may be (docs/design.md, Trust boundaries): bounds checked on the
constraint's text before the grammar engine (llguidance) sees it, by the frontend when it reads a request and by the
engine before it compiles one, and the grammar engine's own limits, which both use.

Why these bounds: llguidance recurses over a grammar's structure, so a long enough chain of rules (3,000 chained Lark
rules, 1,000 chained schema "$ref"s) or deep enough nesting overflows its stack and kills the process; counted repetitions multiply
into lexer states (`(a{1000}){1000}` takes seconds per mask) and thousands of alternatives into Earley items. Each
bound is far above what a hand-written grammar or a real schema uses (OpenAI's own schema limits are 10 levels of
nesting and 1,000 enum values).
"""

from __future__ import annotations

import json
import re

MAX_GRAMMAR_CHARS = 131_072  # a schema, regex, Lark or GBNF grammar, or choice list, as text
MAX_GRAMMAR_RULES = 1_000  # rule definitions in a Lark or GBNF grammar
MAX_NESTING = 64  # brackets inside one another in a grammar or regex; objects and lists in a schema
MAX_BRANCHES = 1_000  # alternatives of one anyOf, oneOf, allOf, enum or prefixItems; strings of one choice
MAX_SCHEMA_NODES = 10_000  # objects and lists in a whole schema
MAX_SCHEMA_REFS = 500  # "$ref"s in a whole schema (a chain of 1,000 crashes llguidance)
MAX_REPETITION = 10_000  # a counted repetition's expansion, {n,m} counts multiplied through nesting

# The grammar engine's own limits (llguidance.LLParserLimits). Lexer work allowed per mask, about 70 ms at worst
# (the default, 200_000, is too little for the date-time format's regex at some states); errors name the failure
# without echoing the parser state and the whole grammar.
LLGUIDANCE_LIMITS = dict(step_lexer_fuel=1_000_000, verbose_errors=False)

# A rule's definition in Lark (`name:`, `?name.2:`, `name{x}:`) or GBNF (`name ::=`); llguidance reads either form
# whichever the constraint's kind says.
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.-]*(\{[^}]*\})?(\.-?\d+)?\s*(:|::=)", re.M)
_COUNT = re.compile(r"\{(\d{1,12})(,(\d{0,12}))?\}")
_BRANCH_KEYS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def constraint_problem(kind: str, text: str) -> str | None:
    """What makes this constraint (a `Constraint`'s kind and text) too large to hand to the grammar engine, naming
    the bound; None when it is within every bound."""
    if len(text) > MAX_GRAMMAR_CHARS:
        return f"the grammar is {len(text)} characters, over the limit of {MAX_GRAMMAR_CHARS}"
    if kind in ("json_schema", "json"):
        return schema_problem(text)
    if kind == "llguidance":  # {"grammars": [{"lark_grammar": ...} or {"json_schema": ...}, ...]} (after reasoning)
        try:
            parts = json.loads(text)["grammars"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return None  # the grammar engine names what is wrong with it
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and isinstance(part.get("lark_grammar"), str):
                problem = constraint_problem("lark", part["lark_grammar"])
            elif isinstance(part, dict) and "json_schema" in part:
                problem = schema_problem(json.dumps(part["json_schema"]))
            else:
                problem = None
            if problem is not None:
                return problem
        return None
    if kind == "choice":
        try:
            choices = json.loads(text)
        except ValueError:
            return None  # the grammar engine names what is wrong with it
        if isinstance(choices, list) and len(choices) > MAX_BRANCHES:
            return f"{len(choices)} choices, over the limit of {MAX_BRANCHES}"
        return None
    if kind in ("lark", "gbnf") and (rules := len(_RULE.findall(text))) > MAX_GRAMMAR_RULES:
        return f"the grammar has {rules} rules, over the limit of {MAX_GRAMMAR_RULES}"
    return pattern_problem(text, literals=kind != "regex")


def pattern_problem(text: str, literals: bool) -> str | None:
    """Nesting and counted repetition in a regex or grammar. `literals`: the text is a grammar, whose quoted
    strings are skipped and whose [ ] are optional groups, not character classes."""
    levels = [1]  # the largest expansion seen so far in each open group
    last = 1  # the expansion of the atom just read (a group's: its largest inside)
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            last = 1
            continue
        if literals and c == '"':
            end = i + 1
            while end < len(text) and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            i, last = end + 1, 1
            continue
        if not literals and c == "[":
            end = i + 1
            while end < len(text) and text[end] != "]":
                end += 2 if text[end] == "\\" else 1
            i, last = end + 1, 1
            continue
        if c == "(" or (literals and c == "["):
            levels.append(1)
            if len(levels) > MAX_NESTING:
                return f"brackets nest more than {MAX_NESTING} deep"
        elif c in ")]" and len(levels) > 1:
            last = levels.pop()
            levels[-1] = max(levels[-1], last)
        elif c == "{" and (count := _COUNT.match(text, i)):
            high = int(count[3]) if count[3] else int(count[1])
            last *= max(high, 1)
            if last > MAX_REPETITION:
                return f"a counted repetition expands to {last} items, over the limit of {MAX_REPETITION}"
            levels[-1] = max(levels[-1], last)
            i = count.end()
            continue
        else:
            last = 1
        i += 1
    return None


def schema_problem(text: str) -> str | None:
    """Nesting, branch counts and patterns of a JSON schema given as text."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return None if text.count("{") + text.count("[") < MAX_SCHEMA_NODES else "the schema is nested too deeply"
    nodes = refs = 0
    stack: list[tuple[object, int, str]] = [(schema, 1, "")]
    while stack:
        value, depth, key = stack.pop()
        if isinstance(value, (dict, list)):
            nodes += 1
            if depth > MAX_NESTING:
                return f"the schema nests objects and lists more than {MAX_NESTING} deep"
            if nodes > MAX_SCHEMA_NODES:
                return f"the schema has more than {MAX_SCHEMA_NODES} objects and lists"
        if isinstance(value, dict):
            refs += "$ref" in value
            if refs > MAX_SCHEMA_REFS:
                return f"the schema has more than {MAX_SCHEMA_REFS} '$ref's"
            stack.extend((item, depth + 1, name) for name, item in value.items())
            if isinstance(value.get("pattern"), str) and (problem := pattern_problem(value["pattern"], False)):
                return f"'pattern': {problem}"
        elif isinstance(value, list):
            if key in _BRANCH_KEYS and len(value) > MAX_BRANCHES:
                return f"'{key}' has {len(value)} branches, over the limit of {MAX_BRANCHES}"
            stack.extend((item, depth + 1, "") for item in value)
    return None
