"""Embeddings end to end (docs/design.md, Embeddings): a tiny random Qwen3 embedding checkpoint built with transformers'
Qwen3Model and saved in the sentence-transformers layout (modules.json, 1_Pooling/config.json pooling by the last
token, a Normalize module), exported with `ignition export --matryoshka`, served with `flare run`; its vectors over
HTTP, through the real openai and ollama clients, equal transformers' last-token, L2-normalised final hidden states
(fp32), each input alone and in batches. The same core under `flare run --pooling mean` gives the normalised mean, and
a generation core answers /v1/embeddings with a 400 naming its model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgspec
import numpy as np
import ollama
import openai
import pytest
import torch
import transformers

from common.manifest import load_manifest, write_manifest
from ignition.main import main as ignition
from ignition.synth import SPECIALS, byte_level_bpe
from tests.e2e.test_families import BASE, CAPACITIES, text
from tests.support.servers import Server

TEXTS = ["Hi", text(12, 3), text(45, 5), text(70, 2)]  # the longer ones span several 32-token chunks


def build_embedding_checkpoint(root: Path) -> Path:
    config = transformers.Qwen3Config(**{**BASE, "head_dim": 32})
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():  # as tests/e2e/test_families.py: weights that make each token's state differ
        for name, p in model.named_parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else p.add_(torch.randn_like(p), alpha=0.5)
    hf_dir = root / "tiny-qwen3-embedding"
    model.save_pretrained(hf_dir)  # a base model's tensor names, no head
    byte_level_bpe(BASE["vocab_size"]).save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIALS[2]}))  # no chat template
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (hf_dir / "modules.json").write_text(json.dumps(modules))
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": BASE["hidden_size"], "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True,
         "include_prompt": True}))
    return hf_dir


@pytest.fixture(scope="module")
def embedding(tmp_path_factory: pytest.TempPathFactory):
    """(a server of the exported core, the core, transformers' model of the same checkpoint)."""
    root = tmp_path_factory.mktemp("embedding")
    hf_dir = build_embedding_checkpoint(root)
    core = root / "core"
    assert ignition(["export", str(hf_dir), str(core), "--matryoshka"]) == 0
    manifest = load_manifest(core)
    assert (manifest.pooling.mode, manifest.pooling.normalize, manifest.pooling.matryoshka) == ("last", True, True)
    write_manifest(core, msgspec.structs.replace(manifest, capacities=CAPACITIES))
    server = Server(core)
    yield server, core, transformers.Qwen3Model.from_pretrained(hf_dir).eval()
    server.stop()


def reference(model: torch.nn.Module, ids: list[int], pooling: str = "last", dimensions: int | None = None
              ) -> np.ndarray:
    """transformers' final hidden states of `ids` alone, pooled, cut to `dimensions`, L2-normalised."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = (hidden[-1] if pooling == "last" else hidden.mean(dim=0))[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0).numpy()


def prompt_ids(core: Path, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(core / "tokenizer.json"))
    return [tokenizer.encode(t).ids for t in texts]


def assert_vectors(got: list, expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for vector, want in zip(got, expected):
        np.testing.assert_allclose(np.asarray(vector, dtype=np.float32), want, atol=1e-5, rtol=0)


def test_openai_client_embeddings_equal_transformers_alone_and_batched(embedding) -> None:
    server, core, model = embedding
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    ids = prompt_ids(core, TEXTS)
    expected = [reference(model, i) for i in ids]
    batched = client.embeddings.create(model=name, input=TEXTS)  # the client asks for base64 and decodes it
    assert_vectors([d.embedding for d in sorted(batched.data, key=lambda d: d.index)], expected)
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == sum(map(len, ids))
    alone = client.embeddings.create(model=name, input=TEXTS[2], encoding_format="float")
    assert_vectors([alone.data[0].embedding], expected[2:3])
    as_ids = client.embeddings.create(model=name, input=ids[1:3], encoding_format="float")
    assert_vectors([d.embedding for d in as_ids.data], expected[1:3])
    short = client.embeddings.create(model=name, input=TEXTS[3], dimensions=16, encoding_format="float")
    assert_vectors([short.data[0].embedding], [reference(model, ids[3], dimensions=16)])


def test_ollama_client_embed_and_the_older_embeddings_route(embedding) -> None:
    server, core, model = embedding
    client = ollama.Client(host=server.base_url)
    name = load_manifest(core).served_names[0]
    ids = prompt_ids(core, TEXTS)
    response = client.embed(model=name, input=TEXTS)
    assert_vectors(response.embeddings, [reference(model, i) for i in ids])
    assert response.prompt_eval_count == sum(map(len, ids))
    assert_vectors(client.embed(model=name, input=TEXTS[0]).embeddings, [reference(model, ids[0])])
    assert_vectors([client.embeddings(model=name, prompt=TEXTS[1]).embedding], [reference(model, ids[1])])


def test_bad_embedding_requests_are_400s_naming_the_field(embedding) -> None:
    server, core, _ = embedding
    name = load_manifest(core).served_names[0]
    cases = [("/v1/embeddings", {"model": name, "input": []}, "input"),
             ("/v1/embeddings", {"model": name, "input": ["a", 3]}, "input"),
             ("/v1/embeddings", {"model": name, "input": "a", "encoding_format": "int8"}, "encoding_format"),
             ("/v1/embeddings", {"model": name, "input": "a", "dimensions": BASE["hidden_size"] + 1}, "dimensions"),
             ("/v1/embeddings", {"model": name, "input": [[5] * (BASE["max_position_embeddings"] + 1)]}, "input"),
             ("/api/embed", {"model": name, "input": [1, 2]}, "input")]
    for path, body, field in cases:
        response = httpx.post(server.base_url + path, json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        message = response.json()["error"]["message"] if path.startswith("/v1") else response.json()["error"]
        assert field in message, (body, message)
    ollama_error = httpx.post(f"{server.base_url}/api/embed", json={"model": "nobody", "input": "a"}, timeout=30)
    assert ollama_error.status_code == 404 and "nobody" in ollama_error.json()["error"]


def test_pooling_flag_serves_the_mean_of_any_decoder_core(embedding) -> None:
    _, core, model = embedding
    server = Server(core, "--pooling", "mean")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        name = client.models.list().data[0].id
        response = client.embeddings.create(model=name, input=TEXTS[1:3])
        assert_vectors([d.embedding for d in response.data],
                       [reference(model, i, "mean") for i in prompt_ids(core, TEXTS[1:3])])
    finally:
        server.stop()


def test_a_generation_core_refuses_embeddings_naming_the_model(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    name = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match=f"'{name}' does not serve embeddings"):
        client.embeddings.create(model=name, input="hello")
    with pytest.raises(ollama.ResponseError, match="does not serve embeddings") as caught:
        ollama.Client(host=server.base_url).embed(model=name, input="hello")
    assert caught.value.status_code == 400
