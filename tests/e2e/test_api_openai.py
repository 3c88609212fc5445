"""The OpenAI routes against `flare run` on the default core: model cards, logprobs (chat, completions with echo,
responses), every sampling field reaching the engine, n choices streamed, and the Responses event sequence."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from common.manifest import load_manifest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name the planets of the solar system."}]
ECHO = [{"role": "user", "content": "Repeat after me: ha ha ha ha ha ha ha ha ha ha ha ha"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, **fields: object) -> openai.types.chat.ChatCompletion:
    fields = {"messages": QUESTION, "max_tokens": 16, "temperature": 0, **fields}
    return client.chat.completions.create(model=model, **fields)


def test_the_model_card(client: openai.OpenAI, model: str, core_dir, server) -> None:
    manifest = load_manifest(core_dir)
    assert model == manifest.served_names[0]
    for name in manifest.served_names:  # every alias resolves, slashes included
        card = httpx.get(f"{server.base_url}/v1/models/{name}", timeout=10).json()
        assert card["id"] == model
    card = client.models.retrieve(model)
    extra = card.model_extra
    assert extra["max_model_len"] == manifest.context_limit and extra["root"] == manifest.checkpoint
    assert {"chat", "completion"} <= set(extra["capabilities"]) and card.created == manifest.created
    missing = httpx.get(f"{server.base_url}/v1/models/no/such-model", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_chat_logprobs_describe_the_greedy_tokens(client: openai.OpenAI, model: str) -> None:
    response = chat(client, model, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 16
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and bytes(entry.bytes).decode() == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        # Greedy decoding picks the most likely token: the first alternative is the token itself.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob <= 0
    stream = chat(client, model, logprobs=True, top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # The second request reads its prompt from the prefix cache: the same numbers up to float rounding.
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(client, model, top_logprobs=2)


def test_completions_echo_with_logprobs_scores_the_prompt(server, model: str) -> None:
    # openai-python types token_logprobs as list[float], but an echoed prompt's first token has no logprob
    # (null, as OpenAI sends it), so this shape is read as JSON.
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "logprobs": 2, "echo": True, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    choice, usage = response["choices"][0], response["usage"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "".join(logprobs["tokens"]) == choice["text"] and choice["text"].startswith(body["prompt"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(x <= 0 for x in logprobs["token_logprobs"][1:])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]
    generated = usage["completion_tokens"]
    for token, score, top in zip(logprobs["tokens"][-generated:], logprobs["token_logprobs"][-generated:],
                                 logprobs["top_logprobs"][-generated:]):
        assert max(top.values()) == score and top[token] == score  # greedy again
    frames = [json.loads(line[6:]) for line in httpx.post(f"{server.base_url}/v1/completions", timeout=60,
              json={**body, "stream": True}).text.splitlines() if line.startswith("data: {")]
    pieces = [f["choices"][0]["logprobs"] for f in frames if f["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in pieces), []) == logprobs["tokens"]
    assert sum((p["text_offset"] for p in pieces), []) == offsets


def text_of(response: openai.types.chat.ChatCompletion) -> str:
    return response.choices[0].message.content


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, model: str) -> None:
    greedy = chat(client, model, messages=ECHO, max_tokens=24, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
    base = text_of(greedy)
    # Penalties change greedy output on a repetitive prompt.
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert text_of(chat(client, model, messages=ECHO, max_tokens=24,
                            extra_body={"ignore_eos": True, **penalty})) != base, penalty
    # Truncations that leave only the most likely token sample exactly what greedy decoding picks.
    for narrow in ({"top_k": 1}, {"min_p": 1.0}):
        response = chat(client, model, messages=ECHO, max_tokens=24, temperature=1.0, seed=7,
                        extra_body={"ignore_eos": True, **narrow})
        assert text_of(response) == base, narrow
    assert text_of(chat(client, model, messages=ECHO, max_tokens=24, temperature=1.0, top_p=1e-9, seed=3,
                        extra_body={"ignore_eos": True})) == base
    # A stop token id ends the choice there, and is reported.
    ids = greedy.choices[0].model_extra["token_ids"]
    stop_id = ids[3]
    cut = chat(client, model, messages=ECHO, max_tokens=24, extra_body={"ignore_eos": True,
                                                                       "stop_token_ids": [stop_id]})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop_id
    assert cut.usage.completion_tokens == ids.index(stop_id) + 1
    # max_completion_tokens wins over the deprecated max_tokens.
    assert chat(client, model, max_tokens=20, max_completion_tokens=5, extra_body={"ignore_eos": True}
                ).usage.completion_tokens == 5


def test_min_tokens_outlasts_an_early_end(client: openai.OpenAI, model: str) -> None:
    greeting = [{"role": "user", "content": "Hi"}]
    short = chat(client, model, messages=greeting, max_tokens=64)
    assert short.choices[0].finish_reason == "stop"
    wanted = short.usage.completion_tokens + 6
    longer = chat(client, model, messages=greeting, max_tokens=64, extra_body={"min_tokens": wanted})
    assert longer.usage.completion_tokens >= wanted


def test_n_choices_stream_with_their_own_indices(client: openai.OpenAI, model: str) -> None:
    stream = chat(client, model, n=2, temperature=1.0, seed=11, stream=True, max_tokens=12)
    texts, finishes = ["", ""], [[], []]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes) and all(texts)
    whole = chat(client, model, n=2, temperature=1.0, seed=11, max_tokens=12)
    assert [c.message.content for c in whole.choices] == texts  # seeded: the same draws, streamed or not


def test_responses_events_and_logprobs(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "instructions": "Answer briefly.", "input": "Name a planet.", "temperature": 0,
              "max_output_tokens": 12, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens <= 12
    assert (whole.status == "incomplete") == (whole.incomplete_details is not None)
    part = whole.output[0].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text == whole.output_text
    assert all(lp.top_logprobs[0].token == lp.token for lp in part.logprobs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="Hi", previous_response_id="resp_123")


def test_continue_final_message_prefills_the_reply(client: openai.OpenAI, model: str, core_dir) -> None:
    from frontend.model import ServedModel

    prefill = "The planets are Mercury,"
    response = chat(client, model, messages=QUESTION + [{"role": "assistant", "content": prefill}],
                    extra_body={"continue_final_message": True, "return_token_ids": True})
    prompt = ServedModel(core_dir).tokenizer.decode(response.model_extra["prompt_token_ids"],
                                                    skip_special_tokens=False)
    assert prompt.endswith(prefill) and response.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        chat(client, model, logit_bias={"50": 5})
