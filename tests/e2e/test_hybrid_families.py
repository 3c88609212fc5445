"""The hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet linear attention in three layers of four,
gated attention in the fourth) against transformers, end to end as tests/e2e/test_families.py tests the others: a
tiny random checkpoint built with transformers' own class, exported with `ignition export`, served with `flare run`;
greedy tokens over HTTP equal transformers' `generate` (fp32, CPU), with prompts of several prefill chunks, so that
the recurrent state carries from chunk to chunk, and several requests at once, each in its own state row (with
`--speculative ngram` asked for: drafting stays off, and the log says why); a second turn restores the first turn's
exact checkpoint, and a request restored then cancelled leaves it for the next; structured output holds; decisions
equal transformers' DecisionPipeline, the questions after the first restoring the state's snapshot. With a device
too small to keep a conversation's exact checkpoint while others run, a host tier keeps it, its snapshot included,
and the conversation's next turn continues from there with transformers' tokens, also after a restart, from the
disk tier.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.e2e.test_decisions import assert_same_answers
from tests.e2e.test_families import (CAPACITIES, NEW_TOKENS, chat, check_conversations_at_once, hf_generate,
                                     ids_of, served_checkpoint, text)
from tests.e2e.test_metrics import wait_for
from tests.support.servers import Server

# What each hybrid adds to test_families.BASE: 4 layers (3 linear, 1 full attention), 2 key heads serving 4 value
# heads in the linear layers, a quarter of each attention head rotated; MoE: 8 experts top-2 and a shared expert.
HYBRID = {"num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 16, "linear_value_head_dim": 16, "tie_word_embeddings": False,
          "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 32}
HYBRIDS = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**HYBRID, **MOE}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**HYBRID, **MOE}),
}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, a server of the exported core, transformers' model of the same checkpoint)."""
    server, reference = served_checkpoint(request.param, tmp_path_factory.mktemp(request.param), HYBRIDS,
                                          ("--speculative", "ngram"))
    yield request.param, server, reference
    server.stop()
    # Speculative decoding, though asked for, stays off, and `flare run`'s log says why.
    assert "speculative decoding off: " + request.param in server.process.stdout.read()


# The tiny Qwen3.5 core's sizes (fp32): a page (the attention layer's K and V, 16 tokens of 2 heads of 32) and a
# recurrent-state row (3 linear layers: the conv's last 3 inputs of 128 channels, and 4 heads of 16 x 16).
PAGE_BYTES, ROW_BYTES = 2 * 16 * 2 * 32 * 4, 3 * (128 * 3 + 4 * 16 * 16) * 4
# The device: 2 snapshot rows (a quarter of the budget at most), 2 slots' rows, and 16 pages of the rest; the host:
# 12 snapshot rows (a quarter of its budget), and 74 pages of the rest.
DEVICE_BYTES, HOST_BYTES = 4 * ROW_BYTES + 16 * PAGE_BYTES, 48 * ROW_BYTES


@pytest.fixture(scope="module")
def evicting(tmp_path_factory: pytest.TempPathFactory):
    """(a Qwen3.5 server whose device holds two snapshot rows and 16 pages, with a host tier, transformers' model,
    the core)."""
    root = tmp_path_factory.mktemp("evicting")
    server, reference = served_checkpoint("qwen3_5", root, HYBRIDS,
                                          ("--max-active", "2", "--kv-cache-bytes", str(DEVICE_BYTES),
                                           "--host-cache-bytes", str(HOST_BYTES)))
    yield server, reference, root / "core"
    server.stop()
    assert "host tier: 74 pages and 12 snapshot rows" in server.process.stdout.read()


def ids(length: int, offset: int) -> list[int]:
    """A prompt of token ids (below the special ones), different for each offset."""
    return [(offset * 37 + i * 11) % 500 + 1 for i in range(length)]


def test_a_turn_evicted_to_the_host_tier_continues_from_its_snapshot(evicting) -> None:
    """The first turn's exact checkpoints (its prompt end and its terminal endpoint) leave the device as three other
    conversations take its two snapshot rows and its pages: their pages and snapshots move to the host, and the next
    turn restores them, so its cached tokens cover the first turn and its tokens equal transformers'."""
    server, reference, _ = evicting
    first_prompt = ids(60, 0)
    first_tokens = complete(server, first_prompt, max_tokens=8).choices[0].model_extra["token_ids"]
    for offset in (1, 2, 3):
        complete(server, ids(60, offset), max_tokens=8)
    before = wait_for(server.base_url, lambda m: m.get("flare_engine_host_snapshot_spills_total", 0) >= 2)
    assert before["flare_engine_host_snapshot_spills_total"] >= 2 and before["flare_engine_host_snapshots"] >= 2
    prompt = first_prompt + first_tokens + ids(12, 4)
    second = complete(server, prompt)
    assert second.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + len(first_tokens) - 1
    assert second.choices[0].model_extra["token_ids"] == hf_generate(reference, prompt)
    after = wait_for(server.base_url, lambda m: m.get("flare_engine_host_snapshot_restores_total", 0) > 0)
    assert after["flare_engine_host_snapshot_restores_total"] == 1 and after["flare_engine_host_restores_total"] > 1


def test_a_turn_given_up_to_the_disk_tier_continues_from_its_snapshot_after_a_restart(evicting, tmp_path) -> None:
    """With a host tier of two snapshot rows and 12 pages, the first turn's blocks and exact checkpoints go on to the
    disk, the files of the latter holding their snapshots; after a restart of `flare run` the next turn reads them
    back (pages and snapshots) and continues from there with transformers' tokens. A file whose snapshot was cut
    short is skipped."""
    _, reference, core = evicting
    args = ("--max-active", "2", "--kv-cache-bytes", str(DEVICE_BYTES), "--host-cache-bytes", str(8 * ROW_BYTES),
            "--disk-cache", str(tmp_path))  # (on the host: 2 snapshot rows, a quarter, and 12 pages)
    server = Server(core, *args)
    try:
        first_prompt = ids(60, 5)
        first_tokens = complete(server, first_prompt, max_tokens=8).choices[0].model_extra["token_ids"]
        for offset in range(6, 12):  # the first turn's blocks leave the host's 12 pages too
            complete(server, ids(60, offset), max_tokens=8)
        written = wait_for(server.base_url, lambda m: m.get("flare_engine_disk_writes_total", 0) >= 10)
        assert written["flare_engine_disk_writes_total"] >= 10
    finally:
        server.stop()
    log = server.process.stdout.read()
    assert "host tier: 12 pages and 2 snapshot rows" in log, log
    server = Server(core, *args)  # the same core again: its files are reused
    try:
        prompt = first_prompt + first_tokens + ids(12, 9)
        second = complete(server, prompt)
        assert second.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + len(first_tokens) - 1
        assert second.choices[0].model_extra["token_ids"] == hf_generate(reference, prompt)
        metrics = wait_for(server.base_url, lambda m: m.get("flare_engine_host_snapshot_restores_total", 0) > 0)
        assert metrics["flare_engine_disk_reads_total"] >= 4  # three blocks and the terminal endpoint's page
    finally:
        server.stop()
    sizes = {path: path.stat().st_size for path in tmp_path.glob("*.kv")}
    for path, size in sizes.items():  # every file with a snapshot loses its last byte: none may be served now
        if size > max(sizes.values()) - ROW_BYTES // 2:
            path.write_bytes(path.read_bytes()[:-1])
    server = Server(core, *args)
    try:
        prompt = first_prompt + first_tokens + ids(12, 10)
        second = complete(server, prompt)
        assert second.usage.prompt_tokens_details.cached_tokens == 0
        assert second.choices[0].model_extra["token_ids"] == hf_generate(reference, prompt)
    finally:
        server.stop()


def test_greedy_tokens_equal_transformers_generate_under_concurrency(hybrid) -> None:
    """With `--speculative ngram` asked for: drafting stays off, and every token is the target's."""
    check_conversations_at_once(*hybrid)


def complete(server: Server, prompt: list[int], max_tokens: int = NEW_TOKENS, stream: bool = False):
    """A completion of token ids: a conversation's turns as ids, which a reply's text need not tokenize back to."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, temperature=0,
                                     max_tokens=max_tokens, stream=stream,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def test_a_second_turn_restores_the_first_turns_snapshot_and_keeps_the_tokens(hybrid) -> None:
    """The first turn's end is an exact checkpoint (its recurrent state snapshot and its partial page): the second
    turn, its prompt and reply and more, restores it, so its cached tokens cover the first turn's prompt and reply
    (but the reply's last token, which no step consumed), and its tokens still equal transformers'."""
    name, server, reference = hybrid
    first_prompt = ids_of(chat(server, [{"role": "user", "content": text(30, 7)}], max_tokens=1))[0]
    first = complete(server, first_prompt, max_tokens=8)
    first_tokens = first.choices[0].model_extra["token_ids"]
    assert first_tokens == hf_generate(reference, first_prompt, 8)
    prompt = first_prompt + first_tokens + first_prompt[-12:]  # the next turn's text, as ids
    second = complete(server, prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(first_prompt) + len(first_tokens) - 1
    assert second.choices[0].model_extra["token_ids"] == hf_generate(reference, prompt), name
    metrics = wait_for(server.base_url, lambda m: m.get("flare_engine_snapshot_restores_total", 0) > 0)
    assert metrics["flare_engine_snapshot_restores_total"] > 0
    assert metrics["flare_engine_snapshot_publications_total"] >= metrics["flare_engine_cached_snapshots"] > 0
    assert metrics["flare_engine_snapshot_bytes"] > 0


def test_a_request_restored_then_cancelled_leaves_the_snapshot_for_the_next(hybrid) -> None:
    """A restore copies the snapshot into the request's own state row: the request writes only there, so after it
    is cancelled mid-stream the snapshot still starts the next request, whose tokens equal transformers'."""
    name, server, reference = hybrid
    start = wait_for(server.base_url, lambda m: "flare_engine_completions_total" in m)
    base = ids_of(chat(server, [{"role": "system", "content": text(25, 4)}, {"role": "user", "content": "Hi"}],
                       max_tokens=1))[0]
    prompt = base + base[-9:]
    # The engine's counters once they count that request (they reach /metrics with its telemetry, a moment after the
    # reply): compared before, a restore of its own would count as the stream's.
    done = start["flare_engine_completions_total"]
    before = wait_for(server.base_url, lambda m: m["flare_engine_completions_total"] > done
                      and "flare_engine_snapshot_restores_total" in m)
    stream = complete(server, prompt, max_tokens=400, stream=True)
    next(iter(stream))  # restored, decoding: then gone
    stream.close()
    counts = ("flare_engine_cancellations_total", "flare_engine_snapshot_restores_total")
    after = wait_for(server.base_url, lambda m: all(m[c] > before[c] for c in counts))
    assert all(after[c] == before[c] + 1 for c in counts), (before, after)  # it restored, then was cancelled
    response = complete(server, prompt)
    assert response.usage.prompt_tokens_details.cached_tokens >= len(base) - 1
    assert response.choices[0].model_extra["token_ids"] == hf_generate(reference, prompt), name


def test_structured_output_holds_to_its_schema(hybrid) -> None:
    """Grammar masks reach a hybrid's sampling as any model's: the reply is the schema's JSON."""
    name, server, _ = hybrid
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
              "additionalProperties": False}
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": text(12)}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "unit", "schema": schema}})
    assert response.choices[0].finish_reason == "stop", name
    assert json.loads(response.choices[0].message.content)["unit"] in ("celsius", "fahrenheit")


def test_decisions_equal_the_decision_pipelines_on_transformers_model(hybrid) -> None:
    """Scored prefills carry the recurrent state as any prefill (from chunk to chunk, and restored from the state's
    snapshot for the questions after the first): the answers are transformers' DecisionPipeline's."""
    from transformers import AutoTokenizer
    from transformers.decision import DecisionConfig
    from transformers.pipelines import DecisionPipeline

    name, server, reference = hybrid
    pipeline = DecisionPipeline(model=reference, tokenizer=AutoTokenizer.from_pretrained(reference.name_or_path),
                                decision_config=DecisionConfig())
    state = text(60, 3)
    questions = {"tone": {"type": "choice", "instructions": "Pick one.", "criteria": {"calm": None, "angry": None,
                                                                                     "sad": "Low spirits"}},
                 "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Later", "Today", "Now"]}}
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    response = httpx.post(f"{server.base_url}/v1/systemone", timeout=300,
                          json={"model": model, "state": state, "questions": questions})
    assert response.status_code == 200, response.text
    assert_same_answers(response.json()["answers"], pipeline({"state": state, "questions": questions}))
    prompts = [inputs["input_ids"][0].tolist() for inputs, _ in
               pipeline.decision_config.prepare_inputs({"state": state, "questions": questions}, pipeline.tokenizer)]
    shared = len(os.path.commonprefix(prompts))
    assert shared > 2 * CAPACITIES.prefill_chunk_size  # the state spans several chunks
    # The second question continues from the snapshot at the end of the shared prefix.
    assert response.json()["usage"]["input_tokens_details"]["cached_tokens"] == shared, name
