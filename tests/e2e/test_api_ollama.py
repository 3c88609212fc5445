"""The Ollama routes through the real ollama client against `flare run` on the default core: /api/tags, /api/show,
/api/ps and /api/version describe it; /api/chat and /api/generate stream and not, with options, formats, raw
prompts and Ollama's errors; greedy /api/chat text equals /v1/chat/completions'."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from common.manifest import load_manifest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name the planets of the solar system."}]
GREEDY = {"temperature": 0, "num_predict": 12}
PLANET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "moons": {"type": "integer"}},
          "required": ["name", "moons"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url)


@pytest.fixture(scope="module")
def model(core_dir) -> str:
    return load_manifest(core_dir).served_names[0]


def test_tags_lists_the_core(client: ollama.Client, core_dir) -> None:
    manifest = load_manifest(core_dir)
    (entry,) = client.list().models
    assert entry.model == manifest.served_names[0] and entry.size > 0 and len(entry.digest) == 64
    assert entry.details.family == manifest.architecture and entry.details.format == "safetensors"
    assert entry.details.parameter_size.endswith("M") and entry.modified_at is not None


def test_show_describes_the_core(client: ollama.Client, core_dir) -> None:
    manifest = load_manifest(core_dir)
    for name in [*manifest.served_names, f"{manifest.served_names[0]}:latest"]:
        shown = client.show(name)
        info = shown.modelinfo
        assert info["general.architecture"] == manifest.architecture
        assert info[f"{manifest.architecture}.context_length"] == manifest.context_limit
        assert info["general.parameter_count"] > 100_000_000
        assert "completion" in shown.capabilities and "mark()" not in shown.template
        assert "insert" not in shown.capabilities and "thinking" not in shown.capabilities
        assert shown.template.strip() and "temperature" in shown.parameters
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("no-such-model")
    assert caught.value.status_code == 404 and "no-such-model" in caught.value.error


def test_ps_and_version(client: ollama.Client, server, model: str, core_dir) -> None:
    (running,) = client.ps().models
    assert running.model == model and running.context_length == load_manifest(core_dir).context_limit
    assert running.expires_at.year == 9999 and running.size == client.list().models[0].size
    version = httpx.get(f"{server.base_url}/api/version", timeout=10).json()["version"]
    assert [int(part) for part in version.split(".")] >= [0, 12, 0]


def test_chat_streamed_and_not(client: ollama.Client, model: str) -> None:
    whole = client.chat(model=model, messages=QUESTION, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 10
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    parts = list(client.chat(model=model, messages=QUESTION, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason
    assert not any(p.message.thinking or p.message.tool_calls for p in parts)


def test_generate_templated_raw_and_loading(client: ollama.Client, model: str) -> None:
    templated = client.generate(model=model, prompt="The capital of France is", options=GREEDY)
    raw = client.generate(model=model, prompt="The capital of France is", options=GREEDY, raw=True)
    assert templated.response and raw.response and templated.done and raw.done
    assert raw.prompt_eval_count < templated.prompt_eval_count  # the template's tokens are not there
    streamed = list(client.generate(model=model, prompt="The capital of France is", options=GREEDY, raw=True,
                                    stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    # SmolLM2's template writes its own system prompt when none is given: a longer one shows in the count.
    system = client.generate(model=model, prompt="The capital of France is", system="Answer in one word. " * 20,
                             options=GREEDY)
    assert system.prompt_eval_count > templated.prompt_eval_count + 60
    loaded = client.generate(model=model)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.generate(model=model, keep_alive=0).done_reason == "unload"
    assert client.chat(model=model, messages=[], keep_alive="5m").done_reason == "load"


def test_options_reach_the_engine(client: ollama.Client, model: str) -> None:
    greedy = client.chat(model=model, messages=QUESTION, options={**GREEDY, "num_predict": 16}).message.content
    # A top_k of 1 samples exactly what greedy decoding picks, whatever the temperature and seed.
    narrow = client.chat(model=model, messages=QUESTION,
                         options={"temperature": 1.0, "top_k": 1, "seed": 3, "num_predict": 16}).message.content
    assert narrow == greedy
    penalised = client.chat(model=model, messages=QUESTION, options={**GREEDY, "num_predict": 16,
                                                                     "repeat_penalty": 2.0})
    assert penalised.message.content != greedy
    word = greedy.split()[2]
    cut = client.chat(model=model, messages=QUESTION, options={**GREEDY, "num_predict": 16, "stop": [word]})
    assert cut.done_reason == "stop" and cut.message.content == greedy[:greedy.index(word)]
    short = client.chat(model=model, messages=QUESTION, options={**GREEDY, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"


def test_format_json_and_schema(client: ollama.Client, model: str) -> None:
    ask = [{"role": "user", "content": "Describe Mars as JSON."}]
    planet = client.chat(model=model, messages=ask, format=PLANET, options={"temperature": 0, "num_predict": 64})
    assert planet.done_reason == "stop"
    value = json.loads(planet.message.content)
    assert set(value) == {"name", "moons"} and isinstance(value["moons"], int) and len(value["name"]) <= 12
    anything = client.generate(model=model, prompt="Describe Mars as JSON.", format="json",
                               options={"temperature": 0, "num_predict": 48})
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.response), dict)
    else:
        assert anything.response.startswith("{")


def test_greedy_chat_equals_openai_chat(fp32_server, fp32_core_dir) -> None:
    name = load_manifest(fp32_core_dir).served_names[0]
    openai_text = httpx.post(f"{fp32_server.base_url}/v1/chat/completions", timeout=120, json={
        "model": name, "messages": QUESTION, "max_tokens": 24, "temperature": 0}).json()
    reply = ollama.Client(host=fp32_server.base_url).chat(model=name, messages=QUESTION,
                                                          options={"temperature": 0, "num_predict": 24})
    assert reply.message.content == openai_text["choices"][0]["message"]["content"]
    assert reply.eval_count == openai_text["usage"]["completion_tokens"]
    assert reply.prompt_eval_count == openai_text["usage"]["prompt_tokens"]


@pytest.mark.parametrize("route, fields, status, phrase", [
    ("chat", {"model": "no-such-model", "messages": QUESTION}, 404, "no-such-model"),
    ("chat", {"messages": QUESTION, "options": {"num_ctx": 1 << 20}}, 400, "num_ctx"),
    ("chat", {"messages": QUESTION, "options": {"num_ctx": 8}}, 400, "requested context window is 8 tokens"),
    ("chat", {"messages": QUESTION, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("chat", {"messages": QUESTION, "think": True}, 400, "does not support thinking"),
    ("chat", {"messages": QUESTION, "format": "yaml"}, 400, "format"),
    ("chat", {"messages": QUESTION, "format": {"type": "object", "uniqueItems": True}}, 400, "format"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("chat", {"messages": QUESTION, "keep_alive": "soon"}, 400, "keep_alive"),
    ("generate", {"prompt": "def f():", "suffix": "    return x"}, 400, "does not support insert"),
    ("generate", {"prompt": "Hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ("generate", {"prompt": "Hi", "context": [1, 2, 3]}, 400, "/api/chat"),
    ("generate", {"prompt": "Hi", "images": ["aGVsbG8gd29ybGQgaGVsbG8="]}, 400, "not a PNG, JPEG or WebP"),
    ("generate", {"prompt": "Hi", "images": ["not base64!"]}, 400, "base64"),
])
def test_errors_in_ollamas_shape(server, model: str, route: str, fields: dict, status: int, phrase: str) -> None:
    for stream in (False, True):  # a streamed request is refused before its stream opens
        response = httpx.post(f"{server.base_url}/api/{route}", json={"model": model, "stream": stream, **fields},
                              timeout=30)
        assert response.status_code == status and set(response.json()) == {"error"}
        assert phrase in response.json()["error"]


def test_the_client_raises_ollamas_errors(client: ollama.Client, model: str) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=model, messages=QUESTION, think=True)
    assert caught.value.status_code == 400 and "does not support thinking" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.generate(model=model, prompt="Hi", options={"num_ctx": 1 << 20}, stream=True))
    assert caught.value.status_code == 400 and "num_ctx" in caught.value.error
