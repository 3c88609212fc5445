"""Speculative decoding in real servers (`flare run --speculative ngram|draft`): greedy tokens equal transformers'
for every proposer (SmolLM2 as its own draft, and a one-layer random draft exported with ignition), the per-request
opt-out, and stop strings and max_tokens landing inside an accepted burst (nothing extra emitted or counted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from common.manifest import load_manifest
from tests.support.servers import Server
from tests.e2e.test_parity import CONVERSATIONS, hf_greedy, reference, server_greedy  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

PASSAGE = ("The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed the "
           "narrow stairs, trimmed the wick, and polished the great lens until it shone. Ships passing in the dark "
           "counted on its beam to warn them of the rocks below.")
COPY = [{"role": "user", "content": f"Here is a passage:\n\n{PASSAGE}\n\nRepeat the passage above exactly, word for "
                                    f"word. Output only the passage."}]


@pytest.fixture(scope="module")
def tiny_draft(core_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random Llama with SmolLM2's vocabulary and tokenizer, exported with ignition."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("draft")
    source = root / "hf"
    vocab = int(load_manifest(core_dir).config["vocab_size"])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)).save_pretrained(source)
    shutil.copy(core_dir / "tokenizer.json", source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": (core_dir / "chat_template.jinja").read_text()}))
    out = root / "core"
    ignition = Path(sys.executable).with_name("ignition")
    subprocess.run([str(ignition), "export", str(source), str(out), "--dtype", "float32"], check=True,
                   capture_output=True)
    return out


def counters(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("flare_engine_")}


def settled_counters(server: Server) -> dict[str, float]:
    """The engine publishes telemetry twice a second: wait until two snapshots' counters agree."""
    previous = counters(server)
    while True:
        time.sleep(0.6)
        current = counters(server)
        if {k: v for k, v in current.items() if k.endswith("_total")} == \
                {k: v for k, v in previous.items() if k.endswith("_total")}:
            return current
        previous = current


def client_of(server: Server) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module", params=["ngram", "self-draft", "tiny-draft"])
def speculative_server(request: pytest.FixtureRequest, fp32_core_dir: Path):
    """On the fp32 core, whose greedy tokens are transformers' (the quantized core's int8-rounded inputs can flip a
    near tie: tests/engine/test_quant.py), so that any difference is speculation's."""
    if request.param == "ngram":
        args = ("--speculative", "ngram")
    else:
        draft = fp32_core_dir if request.param == "self-draft" else request.getfixturevalue("tiny_draft")
        args = ("--speculative", "draft", "--draft", str(draft))
    server = Server(fp32_core_dir, *args)
    yield request.param, server
    server.stop()


def test_greedy_tokens_equal_transformers_with_speculation(speculative_server, reference) -> None:
    kind, server = speculative_server
    model, tokenizer = reference
    client, name = client_of(server)
    proposer = "ngram" if kind == "ngram" else "draft"
    before = settled_counters(server)
    for messages in [COPY] + CONVERSATIONS[:2]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert server_greedy(client, name, messages) == (prompt, hf_greedy(model, prompt)), messages
    after = settled_counters(server)
    drafted = after[f"flare_engine_spec_drafted_tokens_{proposer}_total"] - \
        before[f"flare_engine_spec_drafted_tokens_{proposer}_total"]
    accepted = after[f"flare_engine_spec_accepted_tokens_{proposer}_total"] - \
        before[f"flare_engine_spec_accepted_tokens_{proposer}_total"]
    assert drafted > 0
    if kind != "tiny-draft":
        assert accepted > 0
    if kind == "self-draft":
        assert accepted == drafted  # the target as its own draft agrees with itself at greedy
    assert after["flare_engine_spec_mean_acceptance_length"] > 0 or kind == "tiny-draft"


@pytest.fixture(scope="module")
def ngram_server(core_dir: Path):
    server = Server(core_dir, "--speculative", "ngram")
    yield server
    server.stop()


def test_a_request_that_opts_out_never_drafts_and_gets_the_same_tokens(ngram_server) -> None:
    client, name = client_of(ngram_server)
    spoken = client.chat.completions.create(model=name, messages=COPY, temperature=0, max_tokens=40)
    before = settled_counters(ngram_server)
    plain = client.chat.completions.create(model=name, messages=COPY, temperature=0, max_tokens=40,
                                           extra_body={"speculative": False})
    after = settled_counters(ngram_server)
    assert after["flare_engine_draft_rounds_total"] == before["flare_engine_draft_rounds_total"]
    assert plain.choices[0].message.content == spoken.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="speculative"):
        client.chat.completions.create(model=name, messages=COPY, max_tokens=4, extra_body={"speculative": "yes"})


@pytest.mark.parametrize("limit", ["stop", "max_tokens"])
def test_a_limit_inside_an_accepted_burst_emits_and_counts_nothing_after_it(ngram_server, limit: str) -> None:
    client, name = client_of(ngram_server)
    options = {"stop": ["two hundred"]} if limit == "stop" else {"max_tokens": 11}
    results = []
    for speculative in (True, False):
        response = client.chat.completions.create(
            model=name, messages=COPY, temperature=0, **{"max_tokens": 60, **options},
            extra_body={"speculative": speculative, "return_token_ids": True})
        choice = response.choices[0]
        results.append((choice.message.content, choice.finish_reason, response.usage.completion_tokens,
                        choice.model_extra["token_ids"]))
    assert results[0] == results[1]
    content, reason, used, tokens = results[0]
    assert used == len(tokens)
    if limit == "stop":
        assert reason == "stop" and content.endswith("for ")
    else:
        assert reason == "length" and used == 11
