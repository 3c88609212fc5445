"""The Anthropic dialect against `flare run` on the default core, through the real anthropic client with strict
validation: messages (system blocks, stop reasons, prefill), the streaming event sequence and the stream helper,
count_tokens, and the model listing."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name the planets of the solar system."}]
GREEDY = {"temperature": 0}  # the SDK no longer types sampling fields; the API still takes them


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0,
                               _strict_response_validation=True)


@pytest.fixture(scope="module")
def model(claude: anthropic.Anthropic) -> str:
    return claude.models.list().data[0].id


def test_models_in_anthropic_shape(claude: anthropic.Anthropic, model: str) -> None:
    page = claude.models.list()
    assert page.first_id == page.last_id == model and page.has_more is False
    assert claude.models.retrieve(model).max_input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")


def test_stop_reasons(claude: anthropic.Anthropic, model: str) -> None:
    full = claude.messages.create(model=model, max_tokens=24, messages=QUESTION, extra_body=GREEDY,
                                  system=[{"type": "text", "text": "You are terse."}])
    assert full.stop_reason in ("end_turn", "max_tokens") and full.usage.output_tokens <= 24
    text = full.content[0].text
    stop = text.split()[2]
    cut = claude.messages.create(model=model, max_tokens=24, messages=QUESTION, extra_body=GREEDY,
                                 system=[{"type": "text", "text": "You are terse."}], stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    short = claude.messages.create(model=model, max_tokens=3, messages=QUESTION)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    ended = claude.messages.create(model=model, max_tokens=64, messages=[{"role": "user", "content": "Hi"}],
                                   extra_body=GREEDY)
    assert ended.stop_reason == "end_turn"


def test_the_stream_event_sequence_and_helper(claude: anthropic.Anthropic, model: str) -> None:
    # Every request compared below computes its whole prompt, under a cache salt of its own: how much of a prompt comes
    # from the cache depends on when the copies an earlier request's end left were made, and a prompt whose prefix
    # came from the cache rounds differently (other matrix shapes), which can part greedy near-ties.
    def alone(index: int) -> dict:
        return {**GREEDY, "cache_salt": f"stream-test-{uuid.uuid4().hex}-{index}"}

    whole = claude.messages.create(model=model, max_tokens=20, messages=QUESTION, extra_body=alone(0))
    events = list(claude.messages.create(model=model, max_tokens=20, messages=QUESTION, extra_body=alone(1),
                                         stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-2:] == ["message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"} and types[-3] == "content_block_stop"
    assert events[0].message.stop_reason is None and events[0].message.content == []
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    with claude.messages.stream(model=model, max_tokens=20, messages=QUESTION, extra_body=alone(2)) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_ping_is_sent(server, model: str) -> None:
    raw = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json={
        "model": model, "max_tokens": 2, "messages": QUESTION, "stream": True}).text
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]


def test_count_tokens_matches_the_input_of_a_message(claude: anthropic.Anthropic, model: str) -> None:
    conversation = {"system": "Be brief.", "messages": QUESTION + [
        {"role": "assistant", "content": [{"type": "text", "text": "Mercury, Venus"}]},
        {"role": "user", "content": [{"type": "text", "text": "And the rest?"}]}]}
    counted = claude.messages.count_tokens(model=model, **conversation).input_tokens
    used = claude.messages.create(model=model, max_tokens=2, **conversation).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens > 0


def test_a_final_assistant_message_is_continued(claude: anthropic.Anthropic, model: str) -> None:
    prefill = "The planets are Mercury,"
    reply = claude.messages.create(model=model, max_tokens=8, extra_body=GREEDY,
                                   messages=QUESTION + [{"role": "assistant", "content": prefill}])
    plain = claude.messages.create(model=model, max_tokens=8, messages=QUESTION, extra_body=GREEDY)
    assert reply.content[0].text and not reply.content[0].text.startswith(prefill)
    assert reply.content[0].text != plain.content[0].text
    counted = claude.messages.count_tokens(model=model, messages=QUESTION + [
        {"role": "assistant", "content": prefill}]).input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted


def test_bad_requests_are_anthropic_errors(claude: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=model, max_tokens=8, messages=[{"role": "system", "content": "x"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "role" in str(caught.value)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=8, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        claude.messages.create(model=model, max_tokens=8, messages=QUESTION,
                               extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(model=model, max_tokens=8, messages=QUESTION,
                               extra_body={"output_config": {"format": {"type": "xml"}}})
