"""Structured output end to end (docs/design.md, Beyond plain decoding): a real `flare run` with SmolLM2, judged through
the real openai and anthropic clients; every reply that finished validates against its schema (jsonschema)."""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
import jsonschema
import openai
import pytest

from tests.support.servers import Server
from tests.support.structured_schemas import SCHEMAS

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 100
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# Closed objects: an open one lets SmolLM2 add keys with long strings (a named get_time ran past 400 tokens).
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
        "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                                "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server(core_dir):
    server = Server(core_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def ask(what: str) -> list[dict]:
    return [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": f"Give me {what}."}]


async def schema_reply(client: openai.AsyncOpenAI, what: str, schema: dict, temperature: float, stream: bool,
                       seed: int) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    kwargs = dict(model=MODEL, messages=ask(what), max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                  response_format=fmt)
    if not stream:
        response = await client.chat.completions.create(**kwargs)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_every_schema_reply_validates_greedy_and_sampled_streamed_and_not(server) -> None:
    """Each schema greedy and sampled, one of them streamed (alternating), so all four ways are covered over the
    set; a few greedy ones are also run the other way, which must give the same text."""
    assert len(SCHEMAS) >= 40

    async def run() -> list[tuple[str, dict, float, bool, str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=900)
        cases = [(what, schema, t, (i + k) % 2 == 1) for i, (what, schema) in enumerate(SCHEMAS)
                 for k, t in enumerate((0.0, 1.0))]
        cases += [(what, schema, 0.0, i % 2 == 0) for i, (what, schema) in enumerate(SCHEMAS[:6])]
        replies = await asyncio.gather(*(schema_reply(client, what, schema, t, stream, seed=i)
                                         for i, (what, schema, t, stream) in enumerate(cases)))
        await client.close()
        return [(*case, *reply) for case, reply in zip(cases, replies)]

    results = asyncio.run(run())
    assert {(t, stream) for _, _, t, stream, _, _ in results} == {(0.0, False), (0.0, True), (1.0, False),
                                                                  (1.0, True)}
    cut = []
    for what, schema, temperature, stream, text, finish in results:
        assert finish in ("stop", "length"), (what, finish)
        if finish == "length":  # cut at max_tokens: reported as such, never passed off as complete
            cut.append(what)
            continue
        jsonschema.validate(json.loads(text), schema)
    assert len(cut) <= len(results) // 5, cut
    greedy: dict[str, set[str]] = {}
    for what, _, t, _, text, _ in results:
        if t == 0.0:
            greedy.setdefault(what, set()).add(text)
    assert all(len(texts) == 1 for texts in greedy.values())  # greedy is greedy whether streamed or not


def test_a_json_cut_by_max_tokens_finishes_with_length(oai) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    response = oai.chat.completions.create(model=MODEL, messages=ask("a story"), max_tokens=8, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "s", "schema": schema}})
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.content.startswith('{"story": "')


def test_json_object_and_seeded_sampling_is_reproducible(oai) -> None:
    response = oai.chat.completions.create(model=MODEL, messages=ask('exactly this JSON object: {"ok": true}'),
                                           max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    what, schema = SCHEMAS[0]

    def sampled() -> str:
        response = oai.chat.completions.create(
            model=MODEL, messages=ask(what), max_tokens=60, temperature=1.0, seed=1234,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        return response.choices[0].message.content

    first = sampled()
    jsonschema.validate(json.loads(first), schema)
    assert sampled() == first


def test_extension_regex_choice_and_grammar_through_completions(oai) -> None:
    def complete(prompt: str, spec: dict, **kwargs: object) -> openai.types.Completion:
        return oai.completions.create(**{"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0,
                                         "extra_body": {"structured_outputs": spec}, **kwargs})

    regex = complete("My phone number is", {"regex": r"\+[0-9]{3}-[0-9]{4}"}).choices[0]
    assert re.fullmatch(r"\+[0-9]{3}-[0-9]{4}", regex.text) and regex.finish_reason == "stop"
    choice = complete("Is the sky blue? Answer:", {"choice": ["yes", "no", "maybe"]}).choices[0]
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    grammar = complete("Six times seven:", {"grammar": gbnf}, n=2, seed=5, temperature=1.0)
    assert all(re.fullmatch(r"The answer is [0-9]{2}\.", c.text) for c in grammar.choices)
    stopped = complete("Count:", {"regex": "(one, two, three|one, two)"}, stop=[", two"]).choices[0]
    assert stopped.text == "one" and stopped.finish_reason == "stop"


def test_mixed_batch_free_requests_get_the_tokens_they_get_alone(fp32_server) -> None:
    """On the fp32 core, whose greedy tokens do not depend on the batch (conftest.fp32_server)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    oai = openai.OpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="unused", max_retries=0)

    def free(prompt: str) -> list[int]:
        response = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True})
        return response.choices[0].model_extra["token_ids"]

    alone = [free(p) for p in prompts]

    async def mixed() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="unused", max_retries=0)
        constrained = [client.chat.completions.create(
            model=MODEL, messages=ask(what), max_tokens=40, temperature=t,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
            for what, schema in SCHEMAS[:6] for t in (0.0, 1.0)]
        free_ = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                           extra_body={"return_token_ids": True}) for p in prompts]
        results = await asyncio.gather(*constrained, *free_)
        await client.close()
        return [r.choices[0].model_extra["token_ids"] for r in results[len(constrained):]]

    assert asyncio.run(mixed()) == alone


# --- forced tool calls --------------------------------------------------------------------------------------------
def check_call(name: str, arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, TOOL_SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_required_and_named_tool_calls(oai, stream: bool) -> None:
    for choice, expected in (("required", None), ({"type": "function", "function": {"name": "get_time"}},
                                                   "get_time")):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                      tools=CHAT_TOOLS, tool_choice=choice, max_tokens=80, temperature=0)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in oai.chat.completions.create(**kwargs, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                for call in (delta.tool_calls or []) if delta else []:
                    entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            got = [(c["name"], c["arguments"]) for c in calls.values()]
        else:
            response = oai.chat.completions.create(**kwargs)
            finish = response.choices[0].finish_reason
            got = [(c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls]
        assert finish == "tool_calls" and len(got) == 1
        name, arguments = got[0]
        assert expected in (None, name)
        check_call(name, arguments)


def test_responses_forced_function_call_and_text_format(oai) -> None:
    tools = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
    for choice, expected in (("required", None), ({"type": "function", "name": "get_weather"}, "get_weather")):
        response = oai.responses.create(model=MODEL, input="Weather in Rome?", tools=tools, tool_choice=choice,
                                        max_output_tokens=80, temperature=0)
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1 and expected in (None, calls[0].name)
        check_call(calls[0].name, calls[0].arguments)
    what, schema = SCHEMAS[0]
    response = oai.responses.create(model=MODEL, input=f"Give me {what} in JSON.", max_output_tokens=80,
                                    temperature=0, text={"format": {"type": "json_schema", "name": "p",
                                                                    "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_choice_any_and_tool(server, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
    for choice, expected in (({"type": "any"}, None), ({"type": "tool", "name": "get_time"}, "get_time")):
        kwargs = dict(model=MODEL, max_tokens=80, tools=tools, tool_choice=choice, extra_body={"temperature": 0},
                      messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
        if stream:
            with client.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1 and expected in (None, uses[0].name)
        check_call(uses[0].name, uses[0].input)


# --- refusals -----------------------------------------------------------------------------------------------------
BAD_SCHEMAS = [({"type": "objekt"}, "Invalid type"),
               ({"type": "array", "uniqueItems": True}, "uniqueItems"),
               ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
               ({"$ref": "#/$defs/missing"}, "does not exist")]


@pytest.mark.parametrize("schema,why", BAD_SCHEMAS)
def test_bad_schemas_are_400s_in_every_dialect(server, oai, schema: dict, why: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match=why) as chat:
        oai.chat.completions.create(model=MODEL, messages=ask("x"), response_format=fmt)
    assert chat.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match=why) as legacy:
        oai.completions.create(model=MODEL, prompt="x", extra_body={"response_format": fmt})
    assert legacy.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match=why) as responses:
        oai.responses.create(model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x",
                                                                      "schema": schema}})
    assert responses.value.body["param"] == "text.format.schema"
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=why) as message:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}],
                               tools=[{"name": "t", "input_schema": schema}], tool_choice={"type": "any"})
    assert message.value.body["type"] == "error" and message.value.body["error"]["type"] == "invalid_request_error"


def test_unknown_tools_bad_grammars_and_conflicts_are_400s(server, oai) -> None:
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        oai.chat.completions.create(model=MODEL, messages=ask("x"), tools=CHAT_TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        oai.responses.create(model=MODEL, input="x", tools=[{"type": "function", **CHAT_TOOLS[0]["function"]}],
                             tool_choice={"type": "function", "name": "nope"})
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="not in 'tools'"):
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}],
                               tools=[{"name": "t", "input_schema": WEATHER}], tool_choice={"type": "tool",
                                                                                            "name": "nope"})
    for spec, why in (({"regex": "[a-z"}, "unclosed character class"), ({"grammar": "root ::= missing"}, "missing"),
                      ({"choice": []}, "non-empty list"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                      ({"json": "{not json"}, "not valid JSON")):
        with pytest.raises(openai.BadRequestError, match=why) as error:
            oai.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": spec})
        assert error.value.body["param"].startswith("structured_outputs")
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        oai.chat.completions.create(model=MODEL, messages=ask("x"), response_format={"type": "json_object"},
                                    extra_body={"structured_outputs": {"regex": "a+"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(model=MODEL, messages=ask("x"), response_format={"type": "xml"})
