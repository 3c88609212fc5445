"""`flare run` on the default core, driven by the real openai client, as a user drives it."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.support.servers import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name the planets of the solar system."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_core(client: openai.OpenAI, model: str, core_dir) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_streaming(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0 and 0 < response.usage.completion_tokens <= 20


def test_chat_streaming_equals_non_streaming(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_a_string_and_token_ids(client: openai.OpenAI, model: str) -> None:
    text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens <= 8
    ids = client.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3
    # The SDK types every choice's finish_reason as non-null, so no intermediate chunk of a legacy completions
    # stream (OpenAI's own included) passes strict validation: read the stream with a lenient client.
    lenient = client.with_options()
    lenient._strict_response_validation = False
    streamed = lenient.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                          temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model: str) -> None:
    def draw(seed: int) -> str:
        response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=1.0,
                                                  top_p=0.9, seed=seed)
        return response.choices[0].message.content

    assert draw(1234) == draw(1234)
    assert len({draw(seed) for seed in range(4)}) > 1


def test_sixteen_concurrent_streams_complete(client: openai.OpenAI, model: str) -> None:
    def one(i: int) -> tuple[str, str]:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}],
            max_tokens=24, temperature=0.7, seed=i, stream=True)
        text, finish = "", None
        for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(text and finish in ("stop", "length") for text, finish in results)


def test_stop_string_cuts_the_text_and_is_never_streamed(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    words = full.split()
    assert len(words) > 4, full
    stop = words[3]
    expected = full[: full.index(stop)]
    cut = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == expected
    assert not any(stop in piece for piece in pieces)


def test_too_long_prompt_is_a_400_naming_the_counts(client: openai.OpenAI, model: str, core_dir) -> None:
    from common.manifest import load_manifest

    limit = load_manifest(core_dir).context_limit
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello " * limit}],
                                       max_tokens=10)
    message = str(caught.value)
    assert str(limit) in message and "10 in the completion" in message


def test_bad_input_is_a_400_never_a_500(client: openai.OpenAI, model: str, server) -> None:
    import urllib.request

    for body in (b"{not json", b"\xff\xfe", b"[]", b'{"model": "%s", "messages": []}' % model.encode(),
                 b'{"model": "%s", "messages": [{"role": "wizard", "content": "x"}]}' % model.encode(),
                 b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'
                 % model.encode(),
                 b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e300}'
                 % model.encode()):
        request = urllib.request.Request(f"{server.base_url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 400, body
        import json
        assert json.loads(caught.value.read())["error"]["message"]


def test_sigterm_lets_an_open_stream_finish_and_exits_zero(core_dir) -> None:
    server = Server(core_dir)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        stream = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=32, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        threading.Timer(0.1, server.process.send_signal, (signal.SIGTERM,)).start()
        finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
    finally:
        code = server.stop(timeout=60)
    assert code == 0, server.process.stdout.read()
