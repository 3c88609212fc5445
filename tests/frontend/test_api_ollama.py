"""The Ollama routes where a 135M model cannot show them, through the real ollama client and a real frontend with
Qwen3's template before the scripted engine: thinking and `think`, tool calls and tool results, fill in the middle,
and a failure in the middle of a stream."""

from __future__ import annotations

import json
import uuid

import ollama
import pytest

from tests.support.scripted_engine import ScriptedStack

MODEL = "qwen3"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "required": ["city"],
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def client(thinking_stack: ScriptedStack) -> ollama.Client:
    return ollama.Client(host=thinking_stack.base_url)


def marker(stack: ScriptedStack, reply: str, **options: object) -> str:
    return stack.engine.script(f"ask-{uuid.uuid4().hex[:8]}", reply, **options)


def prompt_of(stack: ScriptedStack, mark: str) -> str:
    (submit,) = stack.engine.submits_with(mark)
    return stack.engine.tokenizer.decode(submit.prompt, skip_special_tokens=False)


def test_show_lists_thinking_and_insert(client: ollama.Client) -> None:
    assert {"thinking", "insert", "tools"} <= set(client.show(MODEL).capabilities)


def test_thinking_comes_apart_from_the_answer(thinking_stack: ScriptedStack, client: ollama.Client) -> None:
    mark = marker(thinking_stack, "Two and two make four.\n</think>\n\nIt is 4.")
    whole = client.chat(model=MODEL, messages=[{"role": "user", "content": mark}], think=True)
    assert whole.message.thinking == "Two and two make four." and whole.message.content == "It is 4."
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": mark}], stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == "It is 4." and parts[-1].done
    generated = client.generate(model=MODEL, prompt=mark, think="high")
    assert generated.thinking == "Two and two make four." and generated.response == "It is 4."
    # A final assistant turn is continued, its reasoning rendered by the template.
    again = marker(thinking_stack, ", surely.")
    continued = client.chat(model=MODEL, messages=[{"role": "user", "content": again},
                                                   {"role": "assistant", "content": "It is 4", "thinking": "Adding."}])
    assert continued.message.content == ", surely."
    assert prompt_of(thinking_stack, again).endswith("<|im_start|>assistant\n<think>\nAdding.\n</think>\n\nIt is 4")


def test_think_false_reaches_the_template(thinking_stack: ScriptedStack, client: ollama.Client) -> None:
    mark = marker(thinking_stack, "It is 4.")
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": mark}], think=False)
    assert reply.message.content == "It is 4." and reply.message.thinking is None
    assert prompt_of(thinking_stack, mark).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def hermes_call(city: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}\n</tool_call>"


def test_tool_calls_and_results(thinking_stack: ScriptedStack, client: ollama.Client) -> None:
    mark = marker(thinking_stack, "Checking.\n</think>\n\n" + hermes_call("Paris"))
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": mark}], tools=[WEATHER_TOOL])
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert reply.done_reason == "stop" and reply.message.content == ""
    assert json.dumps(WEATHER_TOOL) in prompt_of(thinking_stack, mark)  # the tools reach the template
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": mark}], tools=[WEATHER_TOOL],
                             stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", {"city": "Paris"})]
    followup = marker(thinking_stack, "Done.\n</think>\n\nIt is sunny in Paris.")
    answer = client.chat(model=MODEL, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": followup},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}])
    assert answer.message.content == "It is sunny in Paris." and not answer.message.tool_calls
    prompt = prompt_of(thinking_stack, followup)
    assert hermes_call("Paris") in prompt and "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_suffix_fills_in_the_middle(thinking_stack: ScriptedStack, client: ollama.Client) -> None:
    mark = marker(thinking_stack, "    return a + b")
    reply = client.generate(model=MODEL, prompt=f"def add(a, b):  # {mark}\n", suffix="\n\nprint(add(1, 2))")
    assert reply.response == "    return a + b"
    assert prompt_of(thinking_stack, mark) == \
        f"<|fim_prefix|>def add(a, b):  # {mark}\n<|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>"


def test_a_failure_mid_stream_is_an_error_line(thinking_stack: ScriptedStack, client: ollama.Client) -> None:
    mark = marker(thinking_stack, "Thinking hard about it.", fail_after=3)
    parts = []
    with pytest.raises(ollama.ResponseError, match="scripted failure"):
        for part in client.chat(model=MODEL, messages=[{"role": "user", "content": mark}], stream=True):
            parts.append(part)
    assert parts and not any(p.done for p in parts)
