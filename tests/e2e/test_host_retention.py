"""Host retention: prefix checkpoints evicted from a small device KV cache come back from the host tier
(docs/design.md, Host retention)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.test_metrics import scrape, wait_for
from tests.support.servers import Server

pytestmark = pytest.mark.slow

PAGE_BYTES = 30 * 2 * 64 * 3 * 64 * 4  # the fp32 core's page: layers, K and V, tokens, kv heads, head size, bytes
TOPICS = ("rivers", "mountains", "harbours", "forests", "deserts", "glaciers", "islands")


def history(topic: str) -> list[dict[str, str]]:
    """A first turn of about four pages."""
    return [{"role": "user", "content": f"Here are some notes about {topic}. " +
             " ".join(f"Note {i} about {topic} says the {topic} are old and wide." for i in range(20))}]


@pytest.fixture(scope="module")
def retaining_server(fp32_core_dir):
    server = Server(fp32_core_dir, "--kv-cache-bytes", str(16 * PAGE_BYTES), "--host-cache-bytes",
                    str(96 * PAGE_BYTES), "--max-active", "2")
    yield server
    server.stop()


def turn(client: openai.OpenAI, name: str, messages: list[dict[str, str]]) -> tuple[list[int], int, str]:
    response = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=6,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    return (response.choices[0].model_extra["token_ids"], response.usage.prompt_tokens_details.cached_tokens,
            response.choices[0].message.content)


def test_a_second_turn_after_its_pages_were_evicted_is_restored_from_the_host_tier(retaining_server) -> None:
    client = openai.OpenAI(base_url=f"{retaining_server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    first = history(TOPICS[0])
    _, _, reply = turn(client, name, first)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
    tokens, cached, _ = turn(client, name, second)  # from the device's prefix cache: the first turn is there
    assert cached >= 3 * 64
    for topic in TOPICS[1:]:  # 6 conversations of 4 pages each, through a cache of 16 pages
        turn(client, name, history(topic))
    before = scrape(retaining_server.base_url)
    assert before["flare_engine_host_spills_total"] > 0
    again, restored, _ = turn(client, name, second)
    after = wait_for(retaining_server.base_url,
                     lambda m: m["flare_engine_completions_total"] > before["flare_engine_completions_total"])
    assert after["flare_engine_host_restores_total"] > before.get("flare_engine_host_restores_total", 0)
    assert after["flare_engine_host_hits_total"] == before.get("flare_engine_host_hits_total", 0) + 1
    assert restored >= cached
    assert again == tokens
