"""Tools: the parser on its own (any chunking, both formats), the prompt a template without tool support gets,
and tool calls through every dialect's real client, streaming and not, against the scripted engine."""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.chat.tool_parsers import HermesParser, ToolCallParser
from frontend.chat.tools import ToolCall
from frontend.model import ServedModel
from tests.support.scripted_engine import ScriptedStack

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": WEATHER}}]


def hermes(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run(parser: ToolCallParser, chunks: list[str]) -> list[str | ToolCall]:
    pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    merged: list[str | ToolCall] = []
    for piece in pieces:  # adjacent text pieces are one text, however the input was cut
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return merged


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def shape(pieces: list[str | ToolCall]) -> list[object]:
    return [(p.name, p.arguments) if isinstance(p, ToolCall) else p for p in pieces]


# --- the parser ---------------------------------------------------------------------------------------------------
CITIES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)


@given(prefix=st.sampled_from(["", "Let me check.\n", "  "]), cities=st.lists(CITIES, min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 400), max_size=12))
@settings(max_examples=200, deadline=None)
def test_hermes_calls_are_found_however_the_text_is_cut(prefix: str, cities: list[str], cuts: list[int]) -> None:
    text = prefix + "\n".join(hermes("get_weather", {"city": c}) for c in cities) + "\n"
    pieces = run(HermesParser({"get_weather"}), chunked(text, cuts))
    expected_text = [prefix.rstrip()] if prefix.strip() else []  # whitespace beside a call is formatting
    assert shape(pieces) == expected_text + [("get_weather", {"city": c}) for c in cities]


@given(text=st.text(max_size=80), cuts=st.lists(st.integers(0, 100), max_size=8))
@settings(max_examples=300, deadline=None)
def test_text_without_calls_passes_through_unchanged(text: str, cuts: list[int]) -> None:
    if "<tool_call>" in text or text.lstrip()[:1] in ("{", "["):
        return
    pieces = run(HermesParser({"get_weather"}), chunked(text, cuts))
    assert "".join(p for p in pieces if isinstance(p, str)) == text
    assert not any(isinstance(p, ToolCall) for p in pieces)


PIECES = st.one_of(st.text(max_size=12), st.sampled_from([" ", "\n", "<tool", "<tool_call>", "</tool_call>"]),
                   CITIES.map(lambda city: hermes("get_weather", {"city": city})))


@given(pieces=st.lists(PIECES, max_size=6), cuts=st.lists(st.integers(0, 400), max_size=12))
@settings(max_examples=300, deadline=None)
def test_the_result_does_not_depend_on_how_the_text_is_cut(pieces: list[str], cuts: list[int]) -> None:
    text = "".join(pieces)
    whole = run(HermesParser({"get_weather"}), [text])
    assert shape(run(HermesParser({"get_weather"}), chunked(text, cuts))) == shape(whole)


def test_llama3_json_calls_one_or_several() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert shape(run(HermesParser({"get_weather"}), [one[:7], one[7:]])) == [("get_weather", {"city": "Paris"})]
    two = one + '; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert shape(run(HermesParser({"get_weather"}), [two])) == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # JSON that is not a call
    '{"name": "launch_rockets", "parameters": {}}',  # a tool nobody declared
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off mid-call
])
def test_what_is_not_a_valid_call_stays_text(text: str) -> None:
    assert run(HermesParser({"get_weather"}), [text]) == [text]


def test_a_template_without_tools_gets_them_in_the_system_prompt(core_dir) -> None:
    model = ServedModel(core_dir)
    assert not model.supports_tools  # SmolLM2's template ignores tools: the Hermes fallback applies
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = model.encode_chat(messages, CHAT_TOOLS, True, {}).ids
    prompt = model.tokenizer.decode(ids, skip_special_tokens=False)
    assert json.dumps(CHAT_TOOLS[0]) in prompt and "<tool_call>" in prompt
    assert hermes("get_weather", {"city": "Paris"}) in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


# --- through the dialects -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(core_dir):
    stack = ScriptedStack(core_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key="none", max_retries=0,
                               _strict_response_validation=True)


MODEL = "smollm2-135m-instruct"


def scripted_call(stack: ScriptedStack, city: str, before: str = "") -> str:
    """A fresh marker whose reply is `before` then a Hermes call of get_weather(city)."""
    return stack.engine.script(f"ask-{uuid.uuid4().hex[:8]}", before + hermes("get_weather", {"city": city}))


def test_openai_chat_returns_tool_calls(stack, oai) -> None:
    marker = scripted_call(stack, "Paris")
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": marker}],
                                           tools=CHAT_TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = stack.engine.tokenizer.decode(stack.engine.submits_with(marker)[0].prompt, skip_special_tokens=False)
    assert json.dumps(CHAT_TOOLS[0]) in prompt  # rendered into the prompt


def test_openai_chat_streams_tool_calls_as_openai_does(stack, oai) -> None:
    marker = scripted_call(stack, "Oslo", before="Checking.\n")
    with oai.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": marker}],
                                     tools=CHAT_TOOLS) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    fragments = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert fragments[0].id and fragments[0].function.name == "get_weather" and fragments[0].function.arguments == ""
    assert all(f.index == 0 and f.id is None for f in fragments[1:])
    message = final.choices[0].message
    assert message.content == "Checking." and final.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_openai_tool_results_are_rendered_back(stack, oai) -> None:
    marker = stack.engine.script(f"followup-{uuid.uuid4().hex[:8]}", "It is sunny in Paris.")
    response = oai.chat.completions.create(model=MODEL, tools=CHAT_TOOLS, messages=[
        {"role": "user", "content": marker},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}])
    assert response.choices[0].message.content == "It is sunny in Paris."
    assert response.choices[0].finish_reason == "stop"
    prompt = stack.engine.tokenizer.decode(stack.engine.submits_with(marker)[0].prompt, skip_special_tokens=False)
    assert hermes("get_weather", {"city": "Paris"}) in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt


def test_tool_choice_none_parses_nothing(stack, oai) -> None:
    marker = scripted_call(stack, "Lima")
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": marker}],
                                           tools=CHAT_TOOLS, tool_choice="none")
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == hermes("get_weather", {"city": "Lima"})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):  # forcing is test_structured_output.py's
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": marker}], tools=CHAT_TOOLS,
                                    tool_choice="sometimes")


def test_llama3_json_through_chat(stack, oai) -> None:
    marker = stack.engine.script(f"llama-{uuid.uuid4().hex[:8]}",
                                 '{"name": "get_weather", "parameters": {"city": "Kyoto"}}')
    response = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": marker}],
                                           tools=CHAT_TOOLS)
    assert json.loads(response.choices[0].message.tool_calls[0].function.arguments) == {"city": "Kyoto"}


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                    "parameters": WEATHER, "strict": False}]


def test_responses_function_calls_streaming_and_not(stack, oai) -> None:
    marker = scripted_call(stack, "Lagos", before="One moment.\n")
    response = oai.responses.create(model=MODEL, input=marker, tools=RESPONSES_TOOLS)
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call"] and response.status == "completed"
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Lagos"}
    with oai.responses.stream(model=MODEL, input=marker, tools=RESPONSES_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Lagos"}
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.function_call_arguments.done" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    followup = stack.engine.script(f"rfollow-{uuid.uuid4().hex[:8]}", "Warm in Lagos.")
    answer = oai.responses.create(model=MODEL, tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": followup},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "31 C"}])
    assert answer.output_text == "Warm in Lagos."
    prompt = stack.engine.tokenizer.decode(stack.engine.submits_with(followup)[0].prompt, skip_special_tokens=False)
    assert "<tool_response>\n31 C\n</tool_response>" in prompt


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


def test_anthropic_tool_use_streaming_and_not(stack, claude) -> None:
    marker = scripted_call(stack, "Cairo", before="Let me look.\n")
    message = claude.messages.create(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                     messages=[{"role": "user", "content": marker}])
    assert message.stop_reason == "tool_use"
    text, use = message.content
    assert text.text == "Let me look." and use.type == "tool_use" and use.input == {"city": "Cairo"}
    assert use.id.startswith("toolu_")
    with claude.messages.stream(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                messages=[{"role": "user", "content": marker}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Cairo"}
    assert events.count("content_block_start") == 2 and events[-1] == "message_stop"
    followup = stack.engine.script(f"afollow-{uuid.uuid4().hex[:8]}", "Hot in Cairo.")
    answer = claude.messages.create(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": followup},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "get_weather",
                                           "input": {"city": "Cairo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "38 C"}]}])
    assert answer.content[0].text == "Hot in Cairo." and answer.stop_reason == "end_turn"
    prompt = stack.engine.tokenizer.decode(stack.engine.submits_with(followup)[0].prompt, skip_special_tokens=False)
    assert hermes("get_weather", {"city": "Cairo"}) in prompt and "<tool_response>\n38 C\n</tool_response>" in prompt
