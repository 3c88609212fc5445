"""Hostile HTTP input against a real `flare run`, tried as an attacker would (docs/design.md, Trust boundaries):
grammars that crash or stall the grammar engine, a prompt and stop lists that would stall a frontend for everyone,
bodies trickled to hold admission, browser pages on other origins or behind DNS rebinding, and header bytes that
are not UTF-8. Each is refused with a clear status while the server keeps serving."""

from __future__ import annotations

import json
import socket
import threading

import anthropic
import httpx
import openai
import pytest

from tests.support.servers import TEST_API_KEY, Server

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Hi"}]
TRICKLERS = 4  # more than the capacity of the small server below
SMALL_CAPACITY = 2
APP_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def small_server(core_dir):
    """Admission for two requests, bodies within two seconds, and one web origin allowed."""
    server = Server(core_dir, "--capacity", str(SMALL_CAPACITY), "--body-timeout", "2", "--allowed-origins",
                    APP_ORIGIN)
    yield server
    server.stop()


def healthy(base_url: str) -> bool:
    return httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def chained_rules(count: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(count)), f'r{count}: "b"'])


@pytest.mark.parametrize("spec,why", [
    ({"grammar": chained_rules(3000)}, "3002 rules, over the limit of 1000"),
    ({"regex": "(a{1000}){1000}"}, "expands to 1000000 items, over the limit of 10000"),
    ({"regex": "|".join(f"w{i}" for i in range(200_000))}, "characters, over the limit of 131072"),
    ({"json": {"anyOf": [{"const": i} for i in range(5000)]}}, "'anyOf' has 5000 branches, over the limit of 1000"),
])
def test_grammars_past_the_bounds_are_400s_naming_the_bound(server, oai, spec: dict, why: str) -> None:
    with pytest.raises(openai.BadRequestError, match=why) as error:
        oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body={"structured_outputs": spec})
    assert error.value.body["param"].startswith("structured_outputs.")
    assert healthy(server.base_url)


def test_a_grammar_that_crashes_the_grammar_engine_is_a_400_and_the_server_keeps_serving(server, oai) -> None:
    # 990 chained rules are within the bounds, but each one's brackets take llguidance's recursion past its stack:
    # the worker process validating it dies, the frontend does not.
    grammar = "\n".join(["start: r0", *(f'r{i}: ((("a" r{i + 1})))' for i in range(990)), 'r990: "b"'])
    with pytest.raises(openai.BadRequestError, match="the grammar engine failed on it"):
        oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                    extra_body={"structured_outputs": {"grammar": grammar}})
    reply = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                        extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    assert reply.choices[0].message.content
