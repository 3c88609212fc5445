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
    from tests.support.engine_harness import Harness

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


def test_qwen3_vl_8b_preset_is_qwen3_vl_8b_with_its_processor() -> None:
    """The preset's config, placeholder tokens and processor settings, and the tower's shapes (meta device: the
    8B weights are written only on a GPU, by `bench/lab/gpu/vision.py`)."""
    from ignition.families import normalised_config
    from ignition.qwen3_vl import image_processing, vision_shapes
    from ignition.synth import SynthSource

    source = SynthSource("qwen3-vl-8b", 1, "bfloat16", 0)
    family, config = normalised_config(source.config(), source.path, "bfloat16", source.checkpoint)
    settings = image_processing(source.preprocessor, config, source.preprocessor_file)
    assert family == "qwen3_vl" and config["text_config"]["num_hidden_layers"] == 1
    assert (settings.min_pixels, settings.max_pixels, settings.factor) == (65536, 16777216, 32)
    tokenizer = byte_level_bpe(151936, source.specials)
    assert tokenizer.token_to_id("<|image_pad|>") == settings.image_token_id
    assert tokenizer.token_to_id("<|vision_start|>") == settings.vision_start_token_id
    shapes = vision_shapes(config)
    assert shapes["visual.pos_embed.weight"] == (2304, 1152)
    assert shapes["visual.merger.linear_fc2.weight"] == (4096, 4608)
    assert sum(name.startswith("visual.deepstack_merger_list.") for name in shapes) == 3 * 6


def test_llama_3_1_70b_preset_has_llama_3_1_70bs_parameters() -> None:
    """Shapes only: the weights (70.6 billion) are written on a GPU machine (`ignition synth --preset llama-3.1-70b
    --quant fp8`)."""
    import math

    from ignition.synth import SynthSource

    shapes = SynthSource("llama-3.1-70b", None, "bfloat16", 0)._shapes()
    assert shapes["model.layers.79.mlp.down_proj.weight"] == (8192, 28672)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)
    assert round(sum(math.prod(shape) for shape in shapes.values()) / 1e9, 1) == 70.6
