"""Greedy tokens from a server of the fp32 core equal Hugging Face transformers' on the same weights.

transformers is a test dependency only: it renders the prompt (apply_chat_template) and runs its own LlamaForCausalLM
on the core's safetensors, so both the prompt tokens and the 48 generated tokens are checked independently.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from common.manifest import load_manifest

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Explain gravity to a child in two sentences."}],
    [{"role": "user", "content": "Count from one to ten in words, separated by commas."}],
    [{"role": "user", "content": "Translate 'good morning' into German and Spanish. Ünïcödé ✓"}],
]


@pytest.fixture(scope="module")
def reference(fp32_core_dir: Path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    core_dir = fp32_core_dir
    manifest = load_manifest(core_dir)
    model = LlamaForCausalLM(LlamaConfig(**manifest.config)).eval().float()
    state = {}
    for name in manifest.files:
        if name.endswith(".safetensors"):
            state.update(load_file(core_dir / name))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    template = re.sub(r"\{\{-? mark\(\) -?\}\}", "", (core_dir / "chat_template.jinja").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(core_dir / "tokenizer.json"))
    tokenizer.chat_template = template
    return model, tokenizer


def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    with torch.no_grad():
        result = model(ids, use_cache=True)
        for _ in range(NEW_TOKENS):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


def server_greedy(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    response = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=NEW_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    extra = response.model_extra
    return extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]


def test_greedy_matches_transformers_one_at_a_time_then_concurrently(fp32_server, reference) -> None:
    model, tokenizer = reference
    client = openai.OpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    expected = []
    for messages in CONVERSATIONS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected.append((prompt, hf_greedy(model, prompt)))
    for messages, want in zip(CONVERSATIONS, expected):
        assert server_greedy(client, name, messages) == want, messages
    with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        results = list(pool.map(lambda m: server_greedy(client, name, m), CONVERSATIONS))
    for messages, got, want in zip(CONVERSATIONS, results, expected):
        assert got == want, messages


def test_a_second_turn_reuses_the_first_turns_prefix_without_changing_its_output(fp32_server, reference) -> None:
    model, tokenizer = reference
    client = openai.OpenAI(base_url=f"{fp32_server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    first = [{"role": "user", "content": "Name a colour of the rainbow."}]
    reply = client.chat.completions.create(model=name, messages=first, temperature=0, max_tokens=6)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And another one?"}]
    # The first turn's last message end: its prompt without the generation prompt.
    message_end = len(tokenizer(tokenizer.apply_chat_template(first, tokenize=False), add_special_tokens=False)
                      ["input_ids"])
    assert message_end + 6 < 64, "keep the first turn inside one page, so only the message end can be reused"
    response = client.chat.completions.create(model=name, messages=second, temperature=0, max_tokens=NEW_TOKENS,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    assert response.usage.prompt_tokens_details.cached_tokens == message_end
    tokens = response.choices[0].model_extra["token_ids"]
    assert tokens == hf_greedy(model, response.model_extra["prompt_token_ids"])
