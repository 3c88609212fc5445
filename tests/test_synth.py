"""`ignition synth`: a core of random weights that loads and serves like an exported one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from common.manifest import load_manifest
from engine.model.loader import load_model
from ignition.main import main as ignition
from ignition.synth import PRESETS, byte_level_bpe


def test_synth_writes_a_core_that_loads_and_generates(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    assert ignition(["synth", "--preset", "tiny", "--layers", "1", "--dtype", "float32", str(out)]) == 0
    manifest = load_manifest(out, verify=True)
    assert manifest.config["num_hidden_layers"] == 1 and manifest.dtype == "float32"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == PRESETS["tiny"]["vocab_size"]
    assert manifest.eos_token_ids and max(manifest.eos_token_ids) < tokenizer.get_vocab_size()
    assert "mark()" in (out / "chat_template.jinja").read_text()
    _, model = load_model(out, torch.device("cpu"))
    from tests.engine_harness import Harness

    harness = Harness(model)
    request = harness.add(tokenizer.encode("Hello there").ids, temperature=0.0, max_tokens=5)
    harness.run()
    harness.close()
    assert len(request.tokens) == request.prompt_len + 5
    assert ignition(["synth", "--preset", "tiny", str(out)]) == 1  # exists, and no --force


@pytest.mark.parametrize("size", [300, 49152])
def test_byte_level_bpe_has_the_exact_size_and_round_trips(size: int) -> None:
    tokenizer = byte_level_bpe(size)
    assert tokenizer.get_vocab_size() == size
    text = "Grüße, world!\n<|im_start|>user"
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
