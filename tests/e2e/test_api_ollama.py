"""Ollama's model routes through the real ollama client: /api/tags lists the core, /api/show describes it."""

from __future__ import annotations

import ollama
import pytest

from common.manifest import load_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url)


def test_tags_lists_the_core(client: ollama.Client, core_dir) -> None:
    manifest = load_manifest(core_dir)
    (entry,) = client.list().models
    assert entry.model == manifest.served_names[0] and entry.size > 0 and len(entry.digest) == 64
    assert entry.details.family == manifest.architecture and entry.details.format == "safetensors"
    assert entry.details.parameter_size.endswith("M") and entry.modified_at is not None


def test_show_describes_the_core(client: ollama.Client, core_dir) -> None:
    manifest = load_manifest(core_dir)
    for name in manifest.served_names:
        shown = client.show(name)
        info = shown.modelinfo
        assert info["general.architecture"] == manifest.architecture
        assert info[f"{manifest.architecture}.context_length"] == manifest.context_limit
        assert info["general.parameter_count"] > 100_000_000
        assert "completion" in shown.capabilities and "mark()" not in shown.template
        assert shown.template.strip() and "temperature" in shown.parameters
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("no-such-model")
    assert caught.value.status_code == 404 and "no-such-model" in caught.value.error
