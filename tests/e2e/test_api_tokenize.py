"""vLLM's /tokenize and /detokenize against `flare run` on the default core: a prompt's ids are the tokenizer's, a
chat's are the ones /v1/chat/completions generates from, ids come back as text, and bad input is a 400."""

from __future__ import annotations

import httpx
import pytest

from common.manifest import load_manifest
from frontend.model import ServedModel

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_a_prompt_and_its_token_strings(server, core_dir) -> None:
    tokenizer = ServedModel(core_dir).tokenizer
    text = "Tokenize me, please: naïve café."
    got = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer.encode(text, add_special_tokens=True).ids and got["count"] == len(got["tokens"])
    assert got["token_strs"] == [tokenizer.id_to_token(i) for i in got["tokens"]]
    assert got["max_model_len"] == load_manifest(core_dir).context_limit
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids and plain["token_strs"] is None
    back = post(server, "/detokenize", {"tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"], skip_special_tokens=False)} and text in back["prompt"]


def test_a_chat_counts_as_chat_completions_renders_it(server, core_dir) -> None:
    model = load_manifest(core_dir).served_names[0]
    completion = post(server, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 1,
                                                       "return_token_ids": True}).json()
    got = post(server, "/tokenize", {"model": model, "messages": MESSAGES}).json()
    assert got["tokens"] == completion["prompt_token_ids"] and got["count"] == completion["usage"]["prompt_tokens"]
    without = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < got["count"] and got["tokens"][:without["count"]] == without["tokens"]


@pytest.mark.parametrize("path, body, status, phrase", [
    ("/tokenize", {}, 400, "'prompt' is required"),
    ("/tokenize", {"prompt": "Hi", "model": "no-such-model"}, 404, "no-such-model"),
    ("/tokenize", {"prompt": "word " * 9000}, 400, "maximum context length"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "role"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "'tokens' must be a list of integers"),
    ("/detokenize", {"tokens": [1 << 40]}, 400, "'tokens' must be a list of integers"),
    ("/detokenize", {}, 400, "'tokens' is required"),
])
def test_bad_input_is_a_400(server, path: str, body: dict, status: int, phrase: str) -> None:
    response = post(server, path, body)
    assert response.status_code == status and phrase in response.json()["error"]["message"]
