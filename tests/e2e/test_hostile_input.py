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
SMALL_CAPACITY = 2
SMALL_BODY_LIMIT = 1 << 20
TRICKLERS = 4  # more than the small frontend's capacity; as many bodies of the largest size as it reads at once
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
    reply = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                        extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    assert reply.choices[0].message.content


def test_a_huge_prompt_is_refused_before_tokenizing_while_health_answers(server) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a " * (15 << 20)}]}).encode()
    done = threading.Event()
    answer: list[httpx.Response] = []

    def post() -> None:
        try:
            answer.append(httpx.post(f"{server.base_url}/v1/chat/completions", content=body, timeout=300,
                                     headers={"Content-Type": "application/json"}))
        finally:
            done.set()

    sender = threading.Thread(target=post)
    sender.start()
    probes_in_flight = []
    while not done.is_set():
        probe = httpx.get(f"{server.base_url}/health", timeout=5)
        probes_in_flight.append(not done.is_set() and probe.status_code == 200)
    sender.join()
    assert answer[0].status_code == 400 and "more than can fit the model's context" in answer[0].text
    assert any(probes_in_flight)


@pytest.mark.parametrize("stops", [[f"s{i}" for i in range(17)], ["x" * 257]])
def test_stop_lists_past_the_bounds_are_400s_in_each_dialect(server, oai, stops: list[str]) -> None:
    with pytest.raises(openai.BadRequestError, match="over the limit of") as chat:
        oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stop=stops)
    assert chat.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError, match="over the limit of"):
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stop=stops)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="'stop_sequences.*over the limit of"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=HELLO, stop_sequences=stops)


def test_browser_pages_of_other_sites_and_rebound_names_are_refused(server) -> None:
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    url = f"{server.base_url}/v1/chat/completions"
    # DNS rebinding: the page's own name now resolves to 127.0.0.1, and its requests carry that name.
    rebound = httpx.get(f"{server.base_url}/v1/models", headers={"Host": f"attacker.example:{server.port}"})
    assert rebound.status_code == 403 and "serves only loopback host names" in rebound.json()["error"]["message"]
    # A page's "simple" request needs no preflight: text/plain, or another site's Origin.
    plain = httpx.post(url, content=json.dumps(chat), headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415 and "Content-Type: application/json" in plain.json()["error"]["message"]
    foreign = httpx.post(url, json=chat, headers={"Origin": "http://attacker.example"})
    assert foreign.status_code == 403 and "--allowed-origins" in foreign.json()["error"]["message"]
    preflight = httpx.options(url, headers={"Origin": "http://attacker.example",
                                            "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    # The names of this machine, and pages served from it (another port included), are served.
    assert httpx.get(f"http://localhost:{server.port}/v1/models").status_code == 200
    local = httpx.post(url, json=chat, headers={"Origin": "http://localhost:3000"})
    assert local.status_code == 200 and local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert httpx.post(url, json=chat, headers={"Origin": server.base_url}).status_code == 200


def raw_request(port: int, head: bytes) -> bytes:
    """One HTTP request written as bytes; the response's status line and headers as bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        return sock.recv(65536)


def test_an_authorization_header_that_is_not_utf8_is_a_401(keyed_server) -> None:
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 2}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer \xff\xfe" + TEST_API_KEY.encode() + b"\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reply = raw_request(keyed_server.port, head)
    assert reply.startswith(b"HTTP/1.1 401 ") and b"missing or wrong API key" in reply


@pytest.fixture(scope="module")
def small_frontend(core_dir):
    """A real frontend (before the scripted engine: no model is needed to hold connections) admitting two
    requests, reading bodies of up to 1 MiB within two seconds, and allowing one web origin."""
    from tests.support.scripted_engine import ScriptedStack

    stack = ScriptedStack(core_dir, "--capacity", str(SMALL_CAPACITY), "--body-limit", str(SMALL_BODY_LIMIT),
                          "--body-timeout", "2", "--allowed-origins", APP_ORIGIN)
    yield stack
    stack.stop()


def trickle(port: int) -> socket.socket:
    """A request whose body, announced at the largest size allowed, stops after its first bytes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(SMALL_BODY_LIMIT).encode() + b"\r\n\r\n{\"model\": ")
    return sock


def test_trickled_bodies_take_no_admission_slot_and_end_with_408(small_frontend) -> None:
    tricklers = [trickle(small_frontend.port) for _ in range(TRICKLERS)]
    try:
        with trickle(small_frontend.port) as one_more:  # past the bytes of bodies read at once
            assert one_more.recv(65536).startswith(b"HTTP/1.1 429 ")
        reply = httpx.post(f"{small_frontend.base_url}/v1/chat/completions", timeout=60,
                           json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
        assert reply.status_code == 200
        for sock in tricklers:
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in answer
    finally:
        for sock in tricklers:
            sock.close()


def test_an_allowed_origin_is_answered_with_cors_headers(small_frontend) -> None:
    url = f"{small_frontend.base_url}/v1/chat/completions"
    preflight = httpx.options(url, headers={"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    with httpx.stream("POST", url, headers={"Origin": APP_ORIGIN}, timeout=60,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "[DONE]" in stream.read().decode()
    other = httpx.post(url, headers={"Origin": "http://other.example"}, json={"model": MODEL, "messages": HELLO})
    assert other.status_code == 403
