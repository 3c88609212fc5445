"""`flare run --kv-cache-dtype fp8` on the fp32 core: its greedy tokens are those of the engine's own eager torch
path over an fp32 cache with every new key and value rounded to e4m3 by hand (the core carries no KV scales, so
1.0) before it is stored, stepped as the server steps (one prefill span, then one decode row a step: no speculative
decoding, one request at a time); prefix reuse still serves cached tokens; and the same KV budget holds four times
the fp32 cache's pages (1 byte an element, not 4).

Why not transformers' tokens, as the fp32 parity test has it: a last-bit difference between two implementations
(transformers' own cached and uncached steps among them) can move a key across an e4m3 rounding boundary, which
changes it by a whole e4m3 step, so fp8 turns the last-bit differences that fp32 parity tolerates into token flips.
"""

from __future__ import annotations

import openai
import pytest
import torch

from engine.executor.eager import kv_cache_shape
from engine.model.attention import AttentionMetadata, PagedAttention, PrefillSpan
from engine.model.loader import load_model
from tests.e2e.test_metrics import scrape, wait_for
from tests.support.servers import Server

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PAGE = 64
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def fp8_server(fp32_core_dir):
    server = Server(fp32_core_dir, "--kv-cache-dtype", "fp8", "--speculative", "off")
    yield server
    server.stop()


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


class Reference:
    """The core on the engine's eager torch path with an fp32 cache; `rounding` on, each layer's new keys and
    values are rounded to e4m3 before its attention stores them."""

    def __init__(self, core) -> None:
        _, self.model = load_model(core, torch.device("cpu"))
        self.rounding = True
        for module in self.model.modules():
            if isinstance(module, PagedAttention):
                module.register_forward_pre_hook(self._round)
        self.cache = torch.zeros(0)

    def _round(self, module, args):  # noqa: ANN001, ANN202 (a torch hook)
        q, k, v, *rest = args
        return (q, e4m3(k), e4m3(v), *rest) if self.rounding else None

    def greedy(self, prompt: list[int], new: int, cached: int = 0) -> list[int]:
        """`prompt[cached:]` as one prefill span over the cache's first `cached` tokens, then `new` decode steps."""
        if not cached:
            self.cache = torch.zeros(kv_cache_shape(self.model, 4, PAGE))
        table = torch.arange(4)
        empty = torch.zeros(0, dtype=torch.int64)
        length = len(prompt)
        meta = AttentionMetadata(torch.arange(cached, length), empty, empty[None], empty,
                                 (PrefillSpan(0, length - cached, length, table),), PAGE)
        tokens = []
        with torch.no_grad():
            hidden = self.model(torch.tensor(prompt[cached:]), torch.arange(cached, length), self.cache, meta)
            for position in range(length, length + new):
                tokens.append(int(self.model.logits(hidden)[-1].argmax()))
                if len(tokens) == new:
                    break
                meta = AttentionMetadata(torch.tensor([position]), torch.tensor([0]), table[None],
                                         torch.tensor([position + 1]), (), PAGE)
                hidden = self.model(torch.tensor(tokens[-1:]), torch.tensor([position]), self.cache, meta)
        return tokens


def server_greedy(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    response = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=NEW_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return response.model_extra["prompt_token_ids"], response.choices[0].model_extra["token_ids"]


@pytest.fixture(scope="module")
def reference(fp32_core_dir) -> Reference:
    return Reference(fp32_core_dir)


def test_greedy_tokens_equal_the_eager_path_with_e4m3_keys_and_values(fp8_server, reference) -> None:
    client = openai.OpenAI(base_url=f"{fp8_server.base_url}/v1", api_key="none")
    prompt, tokens = server_greedy(client, client.models.list().data[0].id, MESSAGES)
    assert tokens == reference.greedy(prompt, NEW_TOKENS)
    reference.rounding = False
    try:  # the rounding matters here: an fp32 cache's tokens differ, so this test could fail
        assert tokens != reference.greedy(prompt, NEW_TOKENS)
    finally:
        reference.rounding = True


def test_a_second_turn_reuses_its_fp8_prefix(fp8_server, reference) -> None:
    client = openai.OpenAI(base_url=f"{fp8_server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    first = [{"role": "user", "content": "Name a planet of the solar system."}]
    reply = client.chat.completions.create(model=name, messages=first, temperature=0, max_tokens=6,
                                           extra_body={"return_token_ids": True})
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And another one?"}]
    response = client.chat.completions.create(model=name, messages=second, temperature=0, max_tokens=24,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    cached = response.usage.prompt_tokens_details.cached_tokens
    first_prompt, prompt = reply.model_extra["prompt_token_ids"], response.model_extra["prompt_token_ids"]
    # The first turn's last message end, before its generation prompt: an exact checkpoint inside the first page.
    assert 0 < cached < len(first_prompt) < PAGE and prompt[:cached] == first_prompt[:cached]
    reference.greedy(first_prompt, 1)  # the first turn's keys and values, as its prefill stored them
    assert response.choices[0].model_extra["token_ids"] == reference.greedy(prompt, 24, cached=cached)


def test_the_same_budget_holds_four_times_the_fp32_pages(fp8_server, fp32_server) -> None:
    """Both servers take the core's default KV budget: pages of 1-byte elements against 4-byte ones (the floor of
    four times the budget over the fp32 page, so the fp8 count is 4x the fp32 one plus at most 3)."""
    fp8 = wait_for(fp8_server.base_url, lambda m: "flare_engine_kv_pages" in m)
    fp32 = wait_for(fp32_server.base_url, lambda m: "flare_engine_kv_pages" in m)
    assert (fp8["flare_engine_kv_element_bytes"], fp32["flare_engine_kv_element_bytes"]) == (1, 4)
    assert fp8["flare_engine_kv_pages"] // 4 == fp32["flare_engine_kv_pages"] > 0
    assert scrape(fp8_server.base_url)["flare_engine_free_pages"] > fp32["flare_engine_kv_pages"]
