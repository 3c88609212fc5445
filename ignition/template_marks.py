"""Annotate a chat template with `mark()` calls where each message ends.

The frontend renders the annotated template and records the offset of every mark (frontend/chat/templates.py).
Message ends become prefix-cache checkpoints: turn N+1 of a conversation re-renders turns 1..N identically, so
the engine can reuse the KV pages cached up to the end of turn N instead of recomputing them.

The mark goes just before the `endfor` (or the loop's `else`) of each loop over the messages, written so that,
under trim_blocks and lstrip_blocks, the template renders exactly the same text apart from the marks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["annotate", "has_marks"]

_STRING = r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*\""""
# One template token: raw block, comment, expression or statement; strings are skipped whole so that a `%}`
# inside a string literal does not end a tag.
_TOKEN = re.compile(
    r"(?P<raw>\{%[-+]?\s*raw\s*[-+]?%\}.*?\{%[-+]?\s*endraw\s*[-+]?%\})"
    r"|(?P<comment>\{#.*?#\})"
    rf"|(?P<expr>\{{\{{(?:{_STRING}|[^'\"}}]|\}}(?!\}}))*\}}\}})"
    rf"|\{{%(?P<lead>[-+]?)\s*(?P<stmt>(?:{_STRING}|[^'\"%]|%(?!\}}))*?)\s*[-+]?%\}}",
    re.DOTALL,
)
_OPENERS = {"for", "if", "macro", "call", "filter", "with", "autoescape", "block", "generation"}
_BLOCK_SET = re.compile(r"set\s+[\w.,\s]+$")  # `{% set x %}...{% endset %}`, unlike `{% set x = 1 %}`
# A loop over the conversation: `messages`, `loop_messages`, `messages[1:]`, `messages | selectattr(...)`,
# `hist_msgs`, `range(messages|length)`...
_MESSAGE_LOOP = re.compile(
    r"for\s+.+?\s+in\s+(?:\(\s*)?(?:[\w.]*(?:messages|msgs)\b|range\(\s*(?:0\s*,\s*)?messages\s*\|\s*length\s*\))"
    r"(?P<rest>.*)",
    re.DOTALL,
)
# Not the message list itself: one message (`messages[0].content`), or reversed to scan history (Qwen3's
# last-query search), which emits nothing per message.
_NOT_THE_LIST = re.compile(r"^\s*(?:\[[^\]:]*\]|\.)|\[\s*:\s*:\s*-|reverse")
_MARK = re.compile(r"\{\{[-+]?\s*mark\(\s*\)")


@dataclass
class _Block:
    keyword: str
    opening: re.Match[str]
    message_loop: bool  # a for loop over the conversation (by its iterable), not nested in another
    else_tag: re.Match[str] | None = None


def has_marks(source: str) -> bool:
    return _MARK.search(source) is not None


def annotate(source: str) -> str:
    """Insert a `mark()` call at the end of each message, or return `source` unchanged if it has no message loop."""
    edits: list[tuple[int, int, str]] = []
    stack: list[_Block] = []
    for m in _TOKEN.finditer(source):
        stmt = m["stmt"]
        if stmt is None:
            continue
        keyword = stmt.split(maxsplit=1)[0] if stmt else ""
        if keyword in _OPENERS or _BLOCK_SET.match(stmt):
            stack.append(_Block(keyword, m, keyword == "for" and _is_candidate(stmt, stack)))
        elif keyword == "else" and stack and stack[-1].keyword == "for":
            stack[-1].else_tag = m  # a for-else's else branch runs only when there are no messages
        elif keyword.startswith("end") and stack:
            block = stack.pop()
            end = block.else_tag or m
            if block.message_loop and _emits_text(source[block.opening.end() : end.start()]):
                edits.append(_mark_before(source, end))
    for start, stop, text in reversed(edits):
        source = source[:start] + text + source[stop:]
    return source


def _is_candidate(stmt: str, enclosing: list[_Block]) -> bool:
    # Loops in macros are helpers (e.g. looking up a tool call id), and a loop nested in the message loop
    # looks ahead at later messages: neither ends a message.
    if any(block.keyword in ("macro", "call") or block.message_loop for block in enclosing):
        return False
    loop = _MESSAGE_LOOP.match(stmt)
    return loop is not None and _NOT_THE_LIST.search(loop["rest"]) is None


def _emits_text(body: str) -> bool:
    # Loops that only validate (e.g. role alternation with raise_exception) produce no text to mark.
    return _TOKEN.sub(_output_of, body).strip() != ""


def _output_of(m: re.Match[str]) -> str:
    emits = m["expr"] is not None and not re.match(r"\{\{[-+]?\s*raise_exception\b", m["expr"])
    return "x" if emits else ""


def _mark_before(source: str, tag: re.Match[str]) -> tuple[int, int, str]:
    """(start, stop, text): replace source[start:stop] by text so the output gains only the mark."""
    start = tag.start()
    if tag["lead"] == "-":
        return start, start, "{{- mark() }}"
    line_start = start
    while line_start > 0 and source[line_start - 1] in " \t":
        line_start -= 1
    if tag["lead"] != "+" and (line_start == 0 or source[line_start - 1] == "\n"):
        # lstrip_blocks would strip this indentation before the tag, but not before an expression.
        return line_start, start, "{{ mark() }}"
    return start, start, "{{ mark() }}"
