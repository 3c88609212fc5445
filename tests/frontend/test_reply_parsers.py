"""Reply parsers on their own: reasoning split from the answer and Mistral tool calls, however the text is cut into
chunks (the Hermes parser's properties are in test_api_tools.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.chat.reasoning import ReasoningParser, opens_reasoning, template_reasons
from frontend.chat.replies import ReplyFormat
from frontend.chat.tool_parsers import MistralParser, tool_format
from frontend.chat.tools import ToolCall
from tests.frontend.test_api_tools import chunked, run, shape

TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30)
WHITESPACE = st.sampled_from(["", "\n", "\n\n", " ", " \n"])
CUTS = st.lists(st.integers(0, 200), max_size=12)


def split(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    pieces = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    return "".join(r for r, _ in pieces), "".join(a for _, a in pieces)


# --- reasoning ----------------------------------------------------------------------------------------------------
@given(inside=st.booleans(), reasoning=TEXT, answer=TEXT, gaps=st.lists(WHITESPACE, min_size=3, max_size=3),
       cuts=CUTS)
@settings(max_examples=400, deadline=None)
def test_reasoning_and_answer_are_split_however_the_text_is_cut(inside: bool, reasoning: str, answer: str,
                                                                gaps: list[str], cuts: list[int]) -> None:
    if "</think>" in reasoning:
        return
    text = ("" if inside else gaps[0] + "<think>") + gaps[1] + reasoning + gaps[2] + "</think>" + gaps[0] + answer
    # Whitespace beside a tag is formatting.
    assert split(ReasoningParser(inside), chunked(text, cuts)) == (reasoning.strip(), answer.lstrip())


@given(text=TEXT, cuts=CUTS)
@settings(max_examples=300, deadline=None)
def test_a_reply_that_does_not_open_reasoning_passes_through_unchanged(text: str, cuts: list[int]) -> None:
    if text.lstrip().startswith("<think>"):
        return
    assert split(ReasoningParser(False), chunked(text, cuts)) == ("", text)


@given(reasoning=TEXT, cuts=CUTS)
@settings(max_examples=200, deadline=None)
def test_a_thought_cut_off_is_all_reasoning(reasoning: str, cuts: list[int]) -> None:
    if "</think>" in reasoning:
        return
    assert split(ReasoningParser(True), chunked(reasoning, cuts)) == (reasoning.strip(), "")


def test_what_the_template_and_prompt_say() -> None:
    assert template_reasons("{{ '<think>\\n' }}") and not template_reasons("{{ messages }}")
    assert opens_reasoning("<|im_start|>assistant\n<think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert tool_format('{{ "[TOOL_CALLS] [" }}') == "mistral" and tool_format("<tool_call>") == "hermes"


# --- Mistral tool calls -------------------------------------------------------------------------------------------
CITIES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)


def mistral_array(cities: list[str], space: str) -> str:
    calls = [{"name": "get_weather", "arguments": {"city": city}} for city in cities]
    return f"[TOOL_CALLS]{space}{json.dumps(calls)}"


def mistral_named(cities: list[str], call_id: bool) -> str:
    marker = "[CALL_ID]a1b2c3d4e" if call_id else ""
    return "".join(f"[TOOL_CALLS]get_weather{marker}[ARGS]{json.dumps({'city': city})}" for city in cities)


@given(prefix=st.sampled_from(["", "Let me check.\n", " "]), cities=st.lists(CITIES, min_size=1, max_size=3),
       form=st.sampled_from(["array", "array ", "named", "named+id"]), cuts=CUTS)
@settings(max_examples=300, deadline=None)
def test_mistral_calls_are_found_however_the_text_is_cut(prefix: str, cities: list[str], form: str,
                                                         cuts: list[int]) -> None:
    calls = mistral_array(cities, form[5:]) if form.startswith("array") else mistral_named(cities, "+id" in form)
    pieces = run(MistralParser({"get_weather"}), chunked(prefix + calls, cuts))
    expected_text = [prefix.rstrip()] if prefix.strip() else []
    assert shape(pieces) == expected_text + [("get_weather", {"city": c}) for c in cities]


MISTRAL_PIECES = st.one_of(st.text(max_size=10), st.sampled_from(["[", "[TOOL_CALLS]", "[ARGS]", "{", "}", "]"]),
                           CITIES.map(lambda city: mistral_named([city], False)),
                           CITIES.map(lambda city: mistral_array([city], " ")))


@given(pieces=st.lists(MISTRAL_PIECES, max_size=6), cuts=CUTS)
@settings(max_examples=300, deadline=None)
def test_mistral_result_does_not_depend_on_how_the_text_is_cut(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole = run(MistralParser({"get_weather"}), [text])
    assert shape(run(MistralParser({"get_weather"}), chunked(text, cuts))) == shape(whole)


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] not json at all",
    '[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}]',  # a tool nobody declared
    '[TOOL_CALLS]get_weather[ARGS][1, 2]',  # arguments not an object
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut off mid-call
    "Use [brackets] freely",
    "[TOOL_CALLS]",
])
def test_what_is_not_a_mistral_call_stays_text(text: str) -> None:
    assert run(MistralParser({"get_weather"}), [text]) == [text]
    assert run(MistralParser({"get_weather"}), list(text)) == [text]


def test_a_call_after_a_broken_one_is_found() -> None:
    text = '[TOOL_CALLS] oops [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    for chunks in ([text], list(text)):
        assert shape(run(MistralParser({"get_weather"}), chunks)) == ["[TOOL_CALLS] oops",
                                                                       ("get_weather", {"city": "Oslo"})]


# --- both at once -------------------------------------------------------------------------------------------------
@given(cuts=CUTS)
@settings(max_examples=100, deadline=None)
def test_reasoning_then_a_hermes_call(cuts: list[int]) -> None:
    text = ('I need the weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')
    parser = ReplyFormat(reasoning=True, starts_in_reasoning=True, tool_names=frozenset({"get_weather"})).parser()
    results = [parser.feed(chunk) for chunk in chunked(text, cuts)] + [parser.finish()]
    pieces = [p for _, ps in results for p in ps]
    assert "".join(r for r, _ in results) == "I need the weather."
    assert "".join(p for p in pieces if isinstance(p, str)) == "Checking."
    assert [(c.name, c.arguments) for c in pieces if isinstance(c, ToolCall)] == [("get_weather", {"city": "Oslo"})]
    assert parser.calls == 1
