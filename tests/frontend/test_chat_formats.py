"""Chat formats of the model families through their real templates: rendering equals jinja2 as transformers sets
it up, and reasoning and tool calls come back in each dialect's shape through the real clients, streamed and not,
from token streams the scripted engine produces in each family's own format."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.chat.templates import ChatTemplate, TemplateError
from frontend.chat.tools import for_template, template_supports_tools
from frontend.model import ServedModel
from ignition.template_marks import annotate
from tests.frontend.test_api_fuzz import ANY_JSON, check_error, check_stream, either
from tests.frontend.test_api_tools import ANTHROPIC_TOOLS, CHAT_TOOLS, RESPONSES_TOOLS, hermes
from tests.frontend.test_templates import TOOLS, _fixed_strftime_now, _jinja2_template, needs_corpus
from tests.support.chat_family_cores import (MISTRAL_SPECIAL, QWEN_TOKENS, corpus_template, differential_template,
                                             family_core)
from tests.support.scripted_engine import ScriptedStack

pytestmark = needs_corpus

FAMILIES = ["qwen_25", "qwen3", "gemma3", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken"]
SYSTEM = {"role": "system", "content": "You are terse."}
REASONING_CHAT = [SYSTEM, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."},
                  {"role": "user", "content": "And 3+3?"}]
TOOL_LOOP = [SYSTEM, {"role": "user", "content": "Weather in Paris and Rome?"},
             {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.", "tool_calls": [
                 {"id": "call_0123456789abcdef", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                 {"id": "call_fedcba9876543210", "type": "function",
                  "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
             {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "22C"},
             {"role": "tool", "tool_call_id": "call_fedcba9876543210", "content": "25C"},
             {"role": "user", "content": "Thanks, and Oslo?"}]


# --- rendering ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_family_templates_render_as_transformers_does(family: str) -> None:
    """What Flare renders for each family (after adapting tools to the template) equals jinja2's rendering of the
    same input, with thinking on, off and unsaid; the template may refuse a conversation, then jinja2 must too."""
    source = differential_template(family)
    ours = ChatTemplate(annotate(source), bos_token="<s>", eos_token="</s>", strftime_now=_fixed_strftime_now)
    reference = _jinja2_template(source)
    model_format = "mistral" if "[TOOL_CALLS]" in source else "hermes"
    rendered = 0
    for messages, tools in [(REASONING_CHAT, None), (TOOL_LOOP, TOOLS), (TOOL_LOOP[:-1], TOOLS)]:
        adapted, adapted_tools = for_template(messages, tools, template_supports_tools(source), model_format)
        for extra in [{}, {"enable_thinking": True}, {"enable_thinking": False}]:
            kwargs = dict(messages=adapted, tools=adapted_tools, add_generation_prompt=True, documents=None, **extra)
            try:
                want = reference.render(bos_token="<s>", eos_token="</s>", **kwargs)
            except Exception:
                want = None
            try:
                got = ours.render(**kwargs).text
            except TemplateError:
                got = None
            assert got == want, f"{family} {extra}"
            rendered += got is not None
    assert rendered >= 3, f"{family}: the template refused most conversations"


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn() -> None:
    ours = ChatTemplate(annotate(differential_template("gemma3")), bos_token="<bos>")
    adapted, _ = for_template(TOOL_LOOP, TOOLS, False, "hermes")
    text = ours.render(adapted).text
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.\n\nYou are a function calling AI model.")
    assert "<start_of_turn>system" not in text
    # Two results and the user's next words share one user turn: Gemma insists that roles alternate.
    assert "<tool_response>\n22C\n</tool_response>\n<tool_response>\n25C\n</tool_response>\nThanks, and Oslo?" in text


def test_mistral_tool_call_ids_become_what_its_templates_take() -> None:
    adapted, _ = for_template(TOOL_LOOP[:-1], TOOLS, True, "mistral")  # Mistral wants a reply to results first
    text = ChatTemplate(differential_template("mistral_v3_tekken")).render(adapted, tools=TOOLS).text
    call_id = adapted[2]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and adapted[3]["tool_call_id"] == call_id
    assert f'"id": "{call_id}"' in text and f'"call_id": "{call_id}"' in text


# --- through the API ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stacks(core_dir, tmp_path_factory):
    """One scripted stack per family, started when a test first asks for it."""
    root = tmp_path_factory.mktemp("families")
    recipes = {
        # Qwen3 as shipped in the differential set: the generation prompt opens <think>.
        "qwen3": lambda: family_core(core_dir, root / "qwen3", "qwen3", differential_template("qwen3"), QWEN_TOKENS),
        # Qwen3-0.6B's own template: the reply opens <think> itself; no added tokens, so every tag arrives cut into
        # several tokens.
        "qwen3-own": lambda: family_core(core_dir, root / "qwen3-own", "qwen3-own",
                                         corpus_template("Qwen/Qwen3-0.6B")),
        "qwen_25": lambda: family_core(core_dir, root / "qwen25", "qwen25", differential_template("qwen_25"),
                                       QWEN_TOKENS),
        "mistral": lambda: family_core(core_dir, root / "mistral", "mistral",
                                       differential_template("mistral_v3_tekken"), special=MISTRAL_SPECIAL),
        "gemma3": lambda: family_core(core_dir, root / "gemma3", "gemma3", differential_template("gemma3")),
    }
    started: dict[str, ScriptedStack] = {}

    def get(family: str) -> ScriptedStack:
        if family not in started:
            started[family] = ScriptedStack(recipes[family]())
        return started[family]

    yield get
    for stack in started.values():
        stack.stop()


def clients(stack: ScriptedStack) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0,
                          _strict_response_validation=True),
            anthropic.Anthropic(base_url=stack.base_url, api_key="none", max_retries=0,
                                _strict_response_validation=True))


def script(stack: ScriptedStack, reply: str) -> str:
    return stack.engine.script(f"ask-{uuid.uuid4().hex[:8]}", reply)


def prompt_of(stack: ScriptedStack, marker: str) -> str:
    return stack.engine.tokenizer.decode(stack.engine.submits_with(marker)[-1].prompt, skip_special_tokens=False)


def streamed_chat(oai: openai.OpenAI, **request) -> tuple[str, str, list, str]:
    """(reasoning, content, tool call fragments, finish reason) of a streamed chat completion."""
    reasoning = content = finish = ""
    fragments = []
    for chunk in oai.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        assert "<think>" not in (delta.content or "") and "</think>" not in (delta.content or "")
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        fragments += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, fragments, finish


THOUGHT = "The user asks for 2+2.\nThat is 4."


@pytest.mark.parametrize("family, reply", [("qwen3", f"{THOUGHT}\n</think>\n\nIt is 4."),
                                           ("qwen3-own", f"<think>\n{THOUGHT}\n</think>\n\nIt is 4.")])
def test_openai_chat_separates_reasoning(stacks, family: str, reply: str) -> None:
    stack = stacks(family)
    oai, _ = clients(stack)
    marker = script(stack, reply)
    request = dict(model=family, messages=[{"role": "user", "content": marker}])
    response = oai.chat.completions.create(**request)
    message = response.choices[0].message
    assert message.content == "It is 4." and message.model_extra["reasoning_content"] == THOUGHT
    assert 0 < response.usage.completion_tokens_details.reasoning_tokens < response.usage.completion_tokens
    assert streamed_chat(oai, **request) == (THOUGHT, "It is 4.", [], "stop")
    with oai.chat.completions.stream(**request) as stream:  # the SDK's own accumulation of the deltas
        final = stream.get_final_completion().choices[0].message
    assert (final.content, final.model_extra["reasoning_content"]) == ("It is 4.", THOUGHT)


def test_enable_thinking_reaches_the_template(stacks) -> None:
    stack = stacks("qwen3")
    oai, _ = clients(stack)
    marker = script(stack, "Just 4.")
    response = oai.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": marker}],
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_of(stack, marker).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = response.choices[0].message
    assert message.content == "Just 4." and message.model_extra["reasoning_content"] is None
    for bad in (["enable_thinking"], "no", {"add_generation_prompt": False}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": marker}],
                                        extra_body={"chat_template_kwargs": bad})
        assert info.value.body["param"] == "chat_template_kwargs"


def test_reasoning_then_a_tool_call_and_the_reasoning_rendered_back(stacks) -> None:
    stack = stacks("qwen3")
    oai, _ = clients(stack)
    marker = script(stack, "Need the weather.\n</think>\n\n" + hermes("get_weather", {"city": "Oslo"}))
    request = dict(model="qwen3", messages=[{"role": "user", "content": marker}], tools=CHAT_TOOLS)
    choice = oai.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    reasoning, content, fragments, finish = streamed_chat(oai, **request)
    assert (reasoning, content, finish) == ("Need the weather.", "", "tool_calls") and fragments[0].id
    followup = script(stack, "Cold.\n</think>\n\nIt is cold in Oslo.")
    history = [{"role": "user", "content": followup},
               {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                "tool_calls": [choice.message.tool_calls[0].model_dump()]},
               {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "-3C"}]
    answer = oai.chat.completions.create(model="qwen3", messages=history, tools=CHAT_TOOLS).choices[0].message
    assert answer.content == "It is cold in Oslo." and answer.model_extra["reasoning_content"] == "Cold."
    prompt = prompt_of(stack, followup)
    assert "<think>\nNeed the weather.\n</think>\n\n<tool_call>" in prompt and "# Tools" in prompt


def test_responses_reasoning_item(stacks) -> None:
    stack = stacks("qwen3")
    oai, _ = clients(stack)
    marker = script(stack, f"{THOUGHT}\n</think>\n\nIt is 4.")
    response = oai.responses.create(model="qwen3", input=marker)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT and response.output_text == "It is 4."
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with oai.responses.stream(model="qwen3", input=marker) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [e.sequence_number for e in events] == list(range(len(events)))
    followup = script(stack, "Still.\n</think>\n\nYes.")
    answer = oai.responses.create(model="qwen3", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": followup},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3C"}])
    assert answer.output_text == "Yes."
    assert "<think>\nHmm.\n</think>\n\n<tool_call>" in prompt_of(stack, followup)


def test_anthropic_thinking_blocks_when_enabled(stacks) -> None:
    stack = stacks("qwen3")
    _, claude = clients(stack)
    marker = script(stack, f"{THOUGHT}\n</think>\n\nIt is 4.")
    request = dict(model="qwen3", max_tokens=200, messages=[{"role": "user", "content": marker}],
                   thinking={"type": "enabled", "budget_tokens": 1024})
    message = claude.messages.create(**request)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", THOUGHT), ("text", "It is 4.")]
    with claude.messages.stream(**request) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.content[0].thinking == THOUGHT and final.content[1].text == "It is 4."
    assert "thinking_delta" in deltas and "text_delta" in deltas
    # Without thinking, the template is told so and the reply has no thinking block.
    plain = script(stack, "Four.")
    message = claude.messages.create(model="qwen3", max_tokens=200, messages=[{"role": "user", "content": plain}])
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Four."
    assert prompt_of(stack, plain).endswith("<think>\n\n</think>\n\n")
    # The thinking of a past turn goes back to the template.
    again = script(stack, "Ok.\n</think>\n\nDone.")
    claude.messages.create(**{**request, "messages": [
        {"role": "user", "content": again},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3C"}]}]},
        tools=ANTHROPIC_TOOLS)
    assert "<think>\nCall it.\n</think>\n\n<tool_call>" in prompt_of(stack, again)


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "bogus"}])
def test_thinking_is_refused_by_a_model_that_cannot_think(stacks, thinking: dict) -> None:
    stack = stacks("mistral")
    _, claude = clients(stack)
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model="mistral", max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                               thinking=thinking)
    card = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]
    assert "thinking" not in card["capabilities"]
    assert "thinking" in httpx.get(f"{stacks('qwen3').base_url}/v1/models").json()["data"][0]["capabilities"]


MISTRAL_CALLS = {
    "array": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
    "named": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
}


@pytest.mark.parametrize("form", sorted(MISTRAL_CALLS))
def test_mistral_tool_calls(stacks, form: str) -> None:
    stack = stacks("mistral")
    oai, claude = clients(stack)
    marker = script(stack, MISTRAL_CALLS[form])
    request = dict(model="mistral", messages=[{"role": "user", "content": marker}], tools=CHAT_TOOLS)
    choice = oai.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert prompt_of(stack, marker).count("[AVAILABLE_TOOLS]") == 1  # the template's own tool prompt
    _, content, fragments, finish = streamed_chat(oai, **request)
    assert (content, finish) == ("", "tool_calls") and [f.index for f in fragments if f.id] == [0, 1]
    message = claude.messages.create(model="mistral", max_tokens=200, tools=ANTHROPIC_TOOLS,
                                     messages=[{"role": "user", "content": marker}])
    assert [b.input for b in message.content] == [{"city": "Paris"}, {"city": "Rome"}]
    # The results go back under ids the template accepts (it refuses any id but 9 letters and digits).
    followup = script(stack, "Warm in both.")
    history = [{"role": "user", "content": followup},
               {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
               *({"role": "tool", "tool_call_id": c.id, "content": "20C"} for c in calls)]
    assert oai.chat.completions.create(model="mistral", messages=history).choices[0].message.content == \
        "Warm in both."
    assert prompt_of(stack, followup).count("[TOOL_RESULTS]") == 2


def test_mistral_marker_without_tools_is_text(stacks) -> None:
    stack = stacks("mistral")
    oai, _ = clients(stack)
    marker = script(stack, MISTRAL_CALLS["named"])
    message = oai.chat.completions.create(model="mistral", messages=[{"role": "user", "content": marker}]
                                          ).choices[0].message
    assert message.content == MISTRAL_CALLS["named"] and message.tool_calls is None


def test_qwen25_hermes_calls_with_its_own_tool_prompt(stacks) -> None:
    stack = stacks("qwen_25")
    oai, _ = clients(stack)
    marker = script(stack, "Checking.\n" + hermes("get_weather", {"city": "Lima"}))
    request = dict(model="qwen25", messages=[{"role": "user", "content": marker}], tools=CHAT_TOOLS)
    message = oai.chat.completions.create(**request).choices[0].message
    assert message.content == "Checking." and message.tool_calls[0].function.name == "get_weather"
    assert "reasoning_content" not in message.model_extra  # Qwen2.5 does not think
    prompt = prompt_of(stack, marker)
    assert "# Tools" in prompt and "You are a function calling AI model" not in prompt  # the template's own
    reasoning, content, fragments, finish = streamed_chat(oai, **request)
    assert (reasoning, content, finish) == ("", "Checking.", "tool_calls") and len(fragments) == 2


def test_gemma3_tool_loop_through_the_taught_format(stacks) -> None:
    stack = stacks("gemma3")
    _, claude = clients(stack)
    marker = script(stack, hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_weather", {"city": "Rome"}))
    message = claude.messages.create(model="gemma3", max_tokens=200, tools=ANTHROPIC_TOOLS, system="Be brief.",
                                     messages=[{"role": "user", "content": marker}])
    assert message.stop_reason == "tool_use" and [b.input["city"] for b in message.content] == ["Paris", "Rome"]
    followup = script(stack, "Both warm.")
    answer = claude.messages.create(model="gemma3", max_tokens=200, tools=ANTHROPIC_TOOLS, system="Be brief.",
                                    messages=[{"role": "user", "content": followup},
                                              {"role": "assistant", "content": [b.model_dump() for b in
                                                                                message.content]},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result", "tool_use_id": b.id, "content": "20C"}
                                                  for b in message.content] + [{"type": "text", "text": "Thanks"}]}])
    assert answer.content[0].text == "Both warm."
    prompt = prompt_of(stack, followup)
    assert prompt.count("<start_of_turn>user") == 2 and "<start_of_turn>user\nBe brief.\n\n" in prompt
    assert "</tool_response>\nThanks<end_of_turn>" in prompt


def test_served_model_reads_the_format_from_the_template(stacks) -> None:
    for family, reasons, tools in [("qwen3", True, "hermes"), ("mistral", False, "mistral"),
                                   ("gemma3", False, "hermes")]:
        model = ServedModel(stacks(family).core)
        assert (model.reasons, model.tool_format) == (reasons, tools)
    mistral = ServedModel(stacks("mistral").core)
    assert mistral.tokenizer.token_to_id("[TOOL_CALLS]") not in mistral.hidden_token_ids
    assert mistral.tokenizer.token_to_id("[INST]") in mistral.hidden_token_ids


# --- fuzzing the reasoning fields ---------------------------------------------------------------------------------
THINKING = either(st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"},
                                   {"type": "disabled"}, {"type": "enabled", "budget_tokens": "many"}]))
PAST_TURN = st.fixed_dictionaries({"role": st.just("assistant")}, optional={
    "content": either(st.just("4."), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "redacted_thinking", "text"])},
        optional={"thinking": either(st.just("Hmm.")), "text": either(st.just("4.")), "signature": ANY_JSON}),
        max_size=2)),
    "reasoning_content": ANY_JSON, "reasoning": ANY_JSON})
REASONING_INPUT = st.fixed_dictionaries({"type": st.just("reasoning")}, optional={
    "content": either(st.just([{"type": "reasoning_text", "text": "Hmm."}])), "summary": ANY_JSON})


@given(route=st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/responses"]),
       fields=st.fixed_dictionaries({}, optional={"chat_template_kwargs": either(st.just({"enable_thinking": False})),
                                                  "thinking": THINKING, "stream": st.booleans(),
                                                  "tools": st.just(CHAT_TOOLS)}),
       past=st.lists(PAST_TURN, max_size=1), reasoning_items=st.lists(REASONING_INPUT, max_size=1))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
def test_reasoning_fields_never_get_a_5xx(stacks, route: str, fields: dict, past: list, reasoning_items: list
                                          ) -> None:
    stack = stacks("qwen3")
    marker = stack.engine.script("fuzz-reasoning", "Hmm.\n</think>\n\n" + hermes("get_weather", {"city": "Oslo"}))
    turns = [{"role": "user", "content": f"{marker} 2+2?"}, *past, {"role": "user", "content": "And?"}]
    body = {"model": "qwen3", **fields}
    if route == "/v1/responses":
        body["input"] = [turns[0], *reasoning_items, turns[-1]]
        body["tools"] = [{"type": "function", **t["function"]} for t in fields.get("tools", [])]
    else:
        body["messages"] = turns
        body["max_tokens"] = 64
    response = httpx.post(f"{stack.base_url}{route}", content=json.dumps(body).encode(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text[:300])
    if response.status_code >= 400:
        check_error(route, response.json())
    elif response.headers["Content-Type"].startswith("text/event-stream"):
        check_stream(route, response.text)
