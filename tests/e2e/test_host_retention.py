"""Host retention: prefix checkpoints evicted from a small device KV cache come back from the host tier
(docs/design.md, Host retention)."""

from __future__ import annotations

from pathlib import Path

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


def evict_first_turn(client: openai.OpenAI, name: str, topics: tuple[str, ...] = TOPICS
                     ) -> tuple[list[dict[str, str]], list[int], int]:
    """A conversation's second turn, its greedy tokens and cached tokens, then enough other conversations to push its
    pages out of the device (and a small host tier)."""
    first = history(topics[0])
    _, _, reply = turn(client, name, first)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
    tokens, cached, _ = turn(client, name, second)
    for topic in topics[1:]:
        turn(client, name, history(topic))
    return second, tokens, cached


def test_a_second_turn_after_its_pages_were_evicted_is_restored_from_the_host_tier(retaining_server) -> None:
    client = openai.OpenAI(base_url=f"{retaining_server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    second, tokens, cached = evict_first_turn(client, name)
    assert cached >= 3 * 64  # the first turn came from the device's prefix cache then
    before = scrape(retaining_server.base_url)
    assert before["flare_engine_host_spills_total"] > 0
    again, restored, _ = turn(client, name, second)
    after = wait_for(retaining_server.base_url,
                     lambda m: m["flare_engine_completions_total"] > before["flare_engine_completions_total"])
    # The restore is weighed against computing its tokens again by the learned costs: a host page copy (under a
    # millisecond here, the tier's memory being resident from the start) against a prefill step's share of a page
    # (about a tenth of a second). A decline fails too, with the copy time it was based on.
    declined = after.get("flare_engine_host_declined_total", 0) - before.get("flare_engine_host_declined_total", 0)
    assert not declined, f"restore declined at {after['flare_engine_host_page_copy_seconds']:.4f} s a page copy"
    assert after.get("flare_engine_host_restores_total", 0) > before.get("flare_engine_host_restores_total", 0)
    assert after["flare_engine_host_hits_total"] == before.get("flare_engine_host_hits_total", 0) + 1
    assert restored >= cached
    assert again == tokens


def test_a_request_restored_then_cancelled_gives_every_page_back(retaining_server) -> None:
    """Its restored pages are its own until its steps complete, then published or given back: once it is gone every
    page is free, retiring or cached, and the next request restores the same checkpoints again."""
    client = openai.OpenAI(base_url=f"{retaining_server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    second, tokens, _ = evict_first_turn(client, name, TOPICS[3:] + TOPICS[:3])
    before = scrape(retaining_server.base_url)
    stream = client.chat.completions.create(model=name, messages=second, temperature=0, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))  # restored, decoding: then gone
    stream.close()
    counts = ("flare_engine_cancellations_total", "flare_engine_host_restores_total")
    after = wait_for(retaining_server.base_url, lambda m: all(m[c] > before.get(c, 0) for c in counts)
                     and m["flare_engine_live_requests"] == 0 and m["flare_engine_retiring_pages"] == 0)
    assert after["flare_engine_cancellations_total"] == before["flare_engine_cancellations_total"] + 1
    assert after["flare_engine_free_pages"] + after["flare_engine_cached_pages"] == 16
    again, restored, _ = turn(client, name, second)
    assert again == tokens and restored > 0


def disk_server(core: Path, directory: Path) -> Server:
    return Server(core, "--kv-cache-bytes", str(16 * PAGE_BYTES), "--host-cache-bytes", str(8 * PAGE_BYTES),
                  "--disk-cache", str(directory), "--disk-cache-bytes", str(400 * PAGE_BYTES), "--max-active", "2")


def test_a_second_turn_is_restored_from_the_disk_tier_after_a_restart_and_corrupt_files_are_skipped(
        fp32_core_dir, tmp_path) -> None:
    server = disk_server(fp32_core_dir, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        name = client.models.list().data[0].id
        second, tokens, cached = evict_first_turn(client, name)
        assert wait_for(server.base_url, lambda m: m.get("flare_engine_disk_writes_total", 0) > 0)[
            "flare_engine_disk_writes_total"] > 0
    finally:
        server.stop()
    files = sorted(tmp_path.glob("*.kv"))
    assert files
    (tmp_path / ("00" * 16 + ".kv")).write_bytes(b"FLAREKV1\x10\x00\x00\x00{not a header}")  # unreadable, skipped

    server = disk_server(fp32_core_dir, tmp_path)  # the same core again: the files are reused
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        again, restored, _ = turn(client, name, second)
        metrics = wait_for(server.base_url, lambda m: m.get("flare_engine_completions_total", 0) >= 1)
        assert metrics["flare_engine_disk_reads_total"] >= cached // 64
        assert restored >= cached
        assert again == tokens
    finally:
        server.stop()

    for path in tmp_path.glob("*.kv"):  # every payload's last byte flipped: no file may be served now
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    server = disk_server(fp32_core_dir, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        again, restored, _ = turn(client, name, second)
        metrics = wait_for(server.base_url, lambda m: m.get("flare_engine_completions_total", 0) >= 1)
        assert metrics["flare_engine_disk_unreadable_total"] > 0
        assert metrics.get("flare_engine_disk_reads_total", 0) == 0
        assert restored == 0
        assert again == tokens
    finally:
        server.stop()


def test_a_clean_stop_writes_the_prefix_cache_to_disk_for_the_next_start(fp32_core_dir, tmp_path) -> None:
    """No eviction: the conversation's checkpoints are on the device when `flare run` stops, and the stop writes them
    (through the host tier) to the disk tier, so that the next start continues the conversation from there."""
    args = ("--host-cache-bytes", str(32 * PAGE_BYTES), "--disk-cache", str(tmp_path))
    server = Server(fp32_core_dir, *args)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        name = client.models.list().data[0].id
        first = history(TOPICS[0])
        _, _, reply = turn(client, name, first)
        second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
        tokens, cached, _ = turn(client, name, second)
        assert scrape(server.base_url).get("flare_engine_disk_writes_total", 0) == 0
    finally:
        server.stop()
    assert "prefix cache written to disk" in server.process.stdout.read()
    assert len(list(tmp_path.glob("*.kv"))) >= cached // 64
    server = Server(fp32_core_dir, *args)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        again, restored, _ = turn(client, name, second)
        assert restored >= cached >= 3 * 64 and again == tokens
    finally:
        server.stop()
