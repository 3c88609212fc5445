"""Every failure in the dialect's own shape and status: bad input (400, naming the field), auth (401), unknown
model (404), body limit (413), admission (429), engine refusals (503), failures mid-stream (the dialect's error
event, then the end of the stream), and draining on SIGTERM; and a paused reader, which is no failure. Driven
against a real frontend process in front of the scripted engine, which fails and refuses on demand."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

from tests.support.scripted_engine import ScriptedStack

MODEL = "smollm2-135m-instruct"
KEY = "sesame"
CAPACITY = 3
BODY_LIMIT = 64 << 10


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str
    body: Callable[[str], dict]  # a valid body around one user text
    headers: dict[str, str]
    conversation: str | None  # the field holding the conversation, where there is one
    max_field: str = "max_tokens"

    def error(self, payload: dict) -> tuple[str, str]:
        """(error type, message) out of this dialect's error shape; fails if the shape is wrong."""
        if self.name == "anthropic":
            assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
            return payload["error"]["type"], payload["error"]["message"]
        if self.name == "ollama":
            assert set(payload) == {"error"} and isinstance(payload["error"], str), payload
            return "", payload["error"]
        assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
        return payload["error"]["type"], payload["error"]["message"]


BEARER = {"Authorization": f"Bearer {KEY}"}
DIALECTS = [
    Dialect("chat", "/v1/chat/completions", lambda text: {"model": MODEL, "messages": [
        {"role": "user", "content": text}]}, BEARER, "messages"),
    Dialect("completions", "/v1/completions", lambda text: {"model": MODEL, "prompt": text}, BEARER, None),
    Dialect("responses", "/v1/responses", lambda text: {"model": MODEL, "input": [
        {"role": "user", "content": text}]}, BEARER, "input", "max_output_tokens"),
    Dialect("anthropic", "/v1/messages", lambda text: {"model": MODEL, "max_tokens": 50, "messages": [
        {"role": "user", "content": text}]}, {"x-api-key": KEY, "anthropic-version": "2023-06-01"}, "messages"),
    Dialect("ollama", "/api/show", lambda text: {"model": MODEL, "options": {"note": text}}, BEARER, None),
]
GENERATING = [d for d in DIALECTS if d.name != "ollama"] + [
    Dialect("ollama", "/api/chat", lambda text: {"model": MODEL, "messages": [{"role": "user", "content": text}]},
            BEARER, "messages")]


@pytest.fixture(scope="module")
def stack(core_dir):
    stack = ScriptedStack(core_dir, "--api-key", KEY, "--capacity", str(CAPACITY), "--body-limit", str(BODY_LIMIT))
    yield stack
    stack.stop()


def post(stack: ScriptedStack, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(f"{stack.base_url}{path}", data=data,
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def bad_bodies(dialect: Dialect) -> list[tuple[bytes, str]]:
    """(body, a word the error message must contain)."""
    valid = dialect.body("hello")
    cases = [(b"{not json", "JSON"), (b'{"model": "\xff\xfe"}', "UTF-8"), (b"[1, 2]", "object"),
             (json.dumps({**valid, "model": 5}).encode(), "model"),
             (b'{"model": "%s", "n": %s}' % (MODEL.encode(), b"9" * 5000), "number"),
             (b'[' * 30000 + b']' * 30000, "nested")]
    if dialect.conversation:
        field = dialect.conversation
        cases += [(json.dumps({**valid, field: []}).encode(), field),
                  (json.dumps({**valid, field: [{"role": "wizard", "content": "hi"}]}).encode(), "role"),
                  (json.dumps({**valid, field: "hi" if field == "messages" else 42}).encode(), field)]
    if dialect.name != "ollama":
        cases += [(json.dumps({**valid, "temperature": "hot"}).encode(), "temperature"),
                  (json.dumps({**valid, dialect.max_field: 1e400}).replace("Infinity", "1e400").encode(),
                   dialect.max_field),
                  (json.dumps({**valid, dialect.max_field: 0}).encode(), dialect.max_field),
                  (json.dumps({**valid, "stop_token_ids": [-1]}).encode(), "stop_token_ids"),
                  (json.dumps({**valid, "top_p": 7}).encode(), "top_p")]
    return cases


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_bad_input_is_a_400_naming_the_field(stack, dialect: Dialect) -> None:
    for body, word in bad_bodies(dialect):
        status, payload = post(stack, dialect.path, body, dialect.headers)
        kind, message = dialect.error(payload)
        assert status == 400, (body[:80], payload)
        assert word.lower() in message.lower(), (body[:80], message)
        assert "Traceback" not in message


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_auth_unknown_model_and_body_limit(stack, dialect: Dialect) -> None:
    data = json.dumps(dialect.body("hello")).encode()
    # x-api-key marks a request as Anthropic's, so only the Anthropic dialect is asked with it.
    wrong = [{}, {"Authorization": "Bearer wrong"}] + ([{"x-api-key": "wrong"}] if dialect.name == "anthropic" else [])
    for headers in wrong:
        extra = {"anthropic-version": "2023-06-01"} if dialect.name == "anthropic" else {}
        status, payload = post(stack, dialect.path, data, {**headers, **extra})
        assert status == 401 and "API key" in dialect.error(payload)[1]
    status, payload = post(stack, dialect.path, json.dumps({**dialect.body("hello"), "model": "nope"}).encode(),
                           dialect.headers)
    assert status == 404 and "nope" in dialect.error(payload)[1]
    huge = json.dumps(dialect.body("x" * BODY_LIMIT)).encode()
    status, payload = post(stack, dialect.path, huge, dialect.headers)
    assert status == 413 and "body_limit" in dialect.error(payload)[1]


def test_health_needs_no_key_and_models_listing_follows_the_headers(stack) -> None:
    with urllib.request.urlopen(f"{stack.base_url}/health", timeout=10) as response:
        assert response.status == 200
    claude = anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0,
                                 _strict_response_validation=True)
    assert claude.models.list().data[0].id == MODEL
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.models.retrieve("nope")
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=stack.base_url, api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("dialect", GENERATING, ids=lambda d: d.name)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_engine_refusal_keeps_its_status(stack, dialect: Dialect, stream: bool) -> None:
    marker = stack.engine.script(f"full-{uuid.uuid4().hex[:8]}", "", reject=(
        503, "the engine's queue is full (8 waiting)", "capacity_hint: raise capacities.queue_capacity"))
    status, payload = post(stack, dialect.path, json.dumps({**dialect.body(marker), "stream": stream}).encode(),
                           dialect.headers)
    kind, message = dialect.error(payload)
    assert status == 503 and "queue is full" in message and "capacity_hint" in message
    assert kind == ("" if dialect.name == "ollama" else "overloaded_error")


def test_failures_mid_stream_end_each_dialect_with_its_error_event(stack) -> None:
    marker = stack.engine.script(f"boom-{uuid.uuid4().hex[:8]}", "one two three four five six", fail_after=3)
    oai = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0,
                        _strict_response_validation=True)
    chunks = []
    with pytest.raises(openai.APIError, match="scripted failure"):
        for chunk in oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": marker}],
                                                 stream=True):
            chunks.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "one two three"

    events = list(oai.responses.create(model=MODEL, input=marker, stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "scripted failure" in events[-2].message and events[-1].response.status == "failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))

    claude = anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0,
                                 _strict_response_validation=True)
    with pytest.raises(anthropic.APIStatusError, match="scripted failure"):
        with claude.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": marker}]) as s:
            for _ in s:
                pass
    raw = httpx.post(f"{stack.base_url}/v1/completions", headers=BEARER, timeout=30,
                     json={"model": MODEL, "prompt": marker, "stream": True, "max_tokens": 50})
    frames = [f for f in raw.text.split("\n\n") if f]
    assert json.loads(frames[-2].removeprefix("data: "))["error"]["type"] == "server_error"
    assert frames[-1] == "data: [DONE]"


def open_endless_streams(stack: ScriptedStack, count: int) -> tuple[list[object], httpx.Client]:
    """`count` streams that stay open until closed; each is (response, its line iterator), since dropping the
    iterator would close the response."""
    marker = stack.engine.script(f"endless-{uuid.uuid4().hex[:8]}", "la", endless=True)
    client = httpx.Client(base_url=stack.base_url, headers=BEARER, timeout=30)
    streams = []
    for _ in range(count):
        response = client.send(client.build_request("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": marker}], "stream": True,
            "max_tokens": 8000}), stream=True)
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        next(lines)  # generation has started
        streams.append((response, lines))
    return streams, client


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_full_frontend_answers_429_and_a_disconnect_aborts_the_engine_request(stack, dialect: Dialect) -> None:
    engine = stack.engine
    streams, client = open_endless_streams(stack, CAPACITY)
    try:
        status, payload = post(stack, dialect.path, json.dumps(dialect.body("hello")).encode(), dialect.headers)
        kind, message = dialect.error(payload)
        assert status == 429 and "capacity_hint" in message
        assert kind in ("rate_limit_error", "")
    finally:
        running = set(engine.running)
        for response, _ in streams:
            response.close()
        client.close()
    # The closed connections cancel their engine requests (aiohttp cancels the handler; it sends Abort).
    assert wait_for(lambda: running <= set(engine.aborted) and not running & set(engine.running), 1.0)


def test_a_paused_reader_keeps_its_whole_response(stack) -> None:
    tokens = 1500  # a few hundred kilobytes of events: more than the socket buffers hold while nobody reads
    marker = stack.engine.script(f"paused-{uuid.uuid4().hex[:8]}", "la", endless=True)
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", headers=BEARER, timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": marker}], "stream": True,
            "max_tokens": tokens}) as response:
        lines = response.iter_lines()
        next(lines)
        assert wait_for(lambda: not stack.engine.running, 30)  # the engine is done; the reader has not read
        frames = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(f["choices"][0]["delta"].get("content", "") for f in frames) == "la" * tokens
    assert frames[-1]["choices"][0]["finish_reason"] == "length"


def test_sigterm_refuses_new_requests_lets_open_ones_finish_and_exits_zero(core_dir) -> None:
    stack = ScriptedStack(core_dir)
    try:
        marker = stack.engine.script(f"long-{uuid.uuid4().hex[:8]}", "la", endless=True)
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": marker}], "stream": True,
                "max_tokens": 1000}) as response:
            lines = response.iter_lines()
            next(lines)
            stack.process.send_signal(signal.SIGTERM)
            refused = threading.Event()

            def probe() -> None:
                status, payload = post(stack, "/v1/messages", json.dumps(DIALECTS[3].body("hi")).encode(), {})
                if status == 503 and payload["error"]["type"] == "overloaded_error":
                    refused.set()
            assert wait_for(lambda: probe() or refused.is_set(), 2.0)
            rest = [line for line in lines if line.startswith("data: {")]
        assert json.loads(rest[-1].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert stack.process.wait(30) == 0
    finally:
        stack.stop()
