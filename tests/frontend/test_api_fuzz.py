"""Property-based fuzzing of request bodies against a running frontend (in front of the scripted engine, so valid
requests finish in milliseconds): whatever arrives, the answer is never a 5xx, an error is the dialect's JSON,
a stream ends the dialect's way (Ollama's newline-delimited JSON included), and the process stays up."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.scripted_engine import ScriptedStack

MODEL = "smollm2-135m-instruct"

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10 ** 30), 10 ** 30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


def either(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """Plausible values most of the time, anything at all otherwise."""
    return st.one_of(*strategies, ANY_JSON)


TEXT = st.text(max_size=40)
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image", "tool_use", "tool_result",
                                                        "thinking", "image_url", "bogus"]),
                               "text": either(TEXT)},
                              optional={"id": either(TEXT), "name": either(st.just("get_weather")),
                                        "input": ANY_JSON, "tool_use_id": either(TEXT), "content": either(TEXT)})
MESSAGE = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["user", "assistant", "system", "developer", "tool", "wizard"]))},
    optional={"content": either(TEXT, st.lists(BLOCK, max_size=3)),
              "tool_calls": either(st.lists(st.fixed_dictionaries({"id": TEXT, "type": st.just("function"),
                                                                   "function": st.fixed_dictionaries({
                                                                       "name": either(TEXT),
                                                                       "arguments": either(TEXT)})}),
                                            max_size=2)),
              "tool_call_id": either(TEXT), "type": either(st.sampled_from(["message", "function_call",
                                                                            "function_call_output", "reasoning"]))})
TOOL = either(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": either(st.just("get_weather"), TEXT)}, optional={"parameters": ANY_JSON, "description": TEXT})}),
    st.fixed_dictionaries({"name": either(st.just("get_weather")), "input_schema": either(st.just({}))}))
SMALL = st.integers(-2, 40)
FIELDS = {
    "model": either(st.just(MODEL), TEXT), "stream": either(st.booleans()), "n": either(st.integers(1, 3)),
    "temperature": either(st.floats(0, 2)), "top_p": either(st.floats(0.01, 1)), "top_k": either(SMALL),
    "min_p": either(st.floats(0, 1)), "max_tokens": either(st.integers(1, 48), st.integers(-5, 10 ** 6)),
    "max_completion_tokens": either(SMALL), "max_output_tokens": either(SMALL), "seed": either(st.integers()),
    "stop": either(TEXT, st.lists(TEXT, max_size=3)), "stop_sequences": either(st.lists(TEXT, max_size=3)),
    "presence_penalty": either(st.floats(-2, 2)), "frequency_penalty": either(st.floats(-2, 2)),
    "repetition_penalty": either(st.floats(0.5, 2)), "logprobs": either(st.booleans(), st.integers(0, 5)),
    "top_logprobs": either(st.integers(0, 5)), "ignore_eos": either(st.booleans()),
    "min_tokens": either(st.integers(0, 8)), "stop_token_ids": either(st.lists(st.integers(0, 49151), max_size=3)),
    "echo": either(st.booleans()), "tools": either(st.lists(TOOL, max_size=2)),
    "tool_choice": either(st.sampled_from(["auto", "none", "required"])),
    "stream_options": either(st.fixed_dictionaries({"include_usage": either(st.booleans())})),
    "response_format": either(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    "include": either(st.just(["message.output_text.logprobs"])), "system": either(TEXT, st.lists(BLOCK, max_size=2)),
    "instructions": either(TEXT), "chat_template_kwargs": ANY_JSON, "thinking": ANY_JSON, "metadata": ANY_JSON,
    "messages": either(st.lists(MESSAGE, max_size=3)), "input": either(TEXT, st.lists(MESSAGE, max_size=3)),
    "prompt": either(TEXT, st.lists(TEXT, max_size=2), st.lists(st.integers(-3, 60000), max_size=4)),
    "suffix": either(TEXT), "best_of": either(SMALL), "previous_response_id": either(st.none(), TEXT),
    "options": either(st.fixed_dictionaries({}, optional={
        "temperature": either(st.floats(0, 2)), "num_predict": either(st.integers(-3, 48)),
        "num_ctx": either(st.integers(0, 10 ** 6)), "stop": either(st.lists(TEXT, max_size=2)),
        "repeat_penalty": either(st.floats(0.5, 2)), "top_k": either(SMALL)})),
    "format": either(st.sampled_from(["", "json", "yaml"]), st.just({"type": "object"})),
    "think": either(st.booleans(), st.sampled_from(["low", "high"])), "raw": either(st.booleans()),
    "images": either(st.lists(st.sampled_from(["", "aGk=", "iVBORw0KGgoAAAAN"]), max_size=2)),
    "keep_alive": either(st.sampled_from([0, -1, "5m", "0s", "soon"])), "tokens": either(st.lists(SMALL, max_size=4)),
    "add_special_tokens": either(st.booleans()), "return_token_strs": either(st.booleans()),
}
HELLO = [{"role": "user", "content": "hi"}]
VALID = {"/v1/chat/completions": {"model": MODEL, "messages": HELLO},
         "/v1/completions": {"model": MODEL, "prompt": "hi"},
         "/v1/responses": {"model": MODEL, "input": "hi"},
         "/v1/messages": {"model": MODEL, "max_tokens": 16, "messages": HELLO},
         "/v1/messages/count_tokens": {"model": MODEL, "messages": HELLO},
         "/api/show": {"model": MODEL},
         "/api/chat": {"model": MODEL, "messages": HELLO},
         "/api/generate": {"model": MODEL, "prompt": "hi"},
         "/tokenize": {"prompt": "hi"},
         "/detokenize": {"tokens": [1, 2]},
         "/v1/embeddings": {"model": MODEL, "input": "hi"},
         "/api/embed": {"model": MODEL, "input": "hi"}}
ROUTES = list(VALID)
OVERRIDES = st.lists(st.sampled_from(sorted(FIELDS)).flatmap(lambda key: FIELDS[key].map(lambda v: (key, v))),
                     max_size=5).map(dict)


def bodies(route: str) -> st.SearchStrategy[bytes]:
    """Mostly a valid body with a few fields set (plausibly or not), sometimes any JSON, sometimes any bytes."""
    return st.one_of(OVERRIDES.map(lambda o: json.dumps({**VALID[route], **o}).encode()),
                     ANY_JSON.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64))


REQUESTS = st.sampled_from(ROUTES).flatmap(lambda route: st.tuples(st.just(route), bodies(route)))


@pytest.fixture(scope="module")
def stack(core_dir):
    stack = ScriptedStack(core_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def http(stack) -> httpx.Client:
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        yield client


def check_error(route: str, payload: dict) -> None:
    if route.startswith("/api/"):
        assert isinstance(payload["error"], str)
    elif route.startswith("/v1/messages"):
        assert payload["type"] == "error" and isinstance(payload["error"]["message"], str)
    else:
        assert set(payload["error"]) == {"message", "type", "param", "code"}


def check_stream(route: str, text: str) -> None:
    """The stream ended as its dialect ends one: [DONE], message_stop, or a terminal response event; an error
    event counts as an ending too."""
    frames = [f for f in text.split("\n\n") if f.strip()]
    last = frames[-1]
    if route == "/v1/messages":
        assert last.startswith(("event: message_stop", "event: error")), last
    elif route == "/v1/responses":
        assert last.split("\n")[0] in ("event: response.completed", "event: response.incomplete",
                                       "event: response.failed"), last
    else:
        assert last == "data: [DONE]", last


@given(request=REQUESTS)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
def test_no_body_gets_a_5xx(http: httpx.Client, request: tuple[str, bytes]) -> None:
    route, body = request
    with http.stream("POST", route, content=body, headers={"Content-Type": "application/json"}) as response:
        text = response.read().decode()
    assert response.status_code < 500, (route, body[:300], text[:300])
    if response.status_code >= 400:
        check_error(route, json.loads(text))
    elif response.headers["Content-Type"].startswith("text/event-stream"):
        check_stream(route, text)
    elif response.headers["Content-Type"].startswith("application/x-ndjson"):
        # Ollama's stream: JSON lines, the last one done or an error.
        lines = [json.loads(line) for line in text.splitlines()]
        assert lines[-1].get("done") is True or isinstance(lines[-1].get("error"), str), lines[-1]
        assert all(line.get("done") is False for line in lines[:-1]), lines
    else:
        json.loads(text)


def test_the_frontend_is_still_up(stack, http: httpx.Client) -> None:
    assert stack.process.poll() is None and http.get("/health").status_code == 200
