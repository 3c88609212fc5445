"""FP8 in `ignition`: `--quant fp8` by its definition, FP8 checkpoints' experts stacked with their scales, the
one-line errors of schemes Flare does not read, `ignition synth --quant fp8`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from common.manifest import load_manifest
from engine.model.fp8 import dequantize
from engine.model.loader import load_model
from ignition.main import main as ignition
from tests.e2e.test_families import build_checkpoint
from tests.support.fp8_checkpoints import (BLOCK, CHANNEL_DYNAMIC, block_quantized, channel_quantized, is_linear,
                                           quantization_config, rewrite_as_fp8)

LLAMA = {"llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False})}
MOE = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                     {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": False})}


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint in bfloat16, as most checkpoints are published."""
    hf_dir = build_checkpoint("llama", tmp_path_factory.mktemp("bf16"), LLAMA)
    path = hf_dir / "model.safetensors"
    save_file({name: t.bfloat16() for name, t in load_file(path).items()}, path, metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text()) | {"dtype": "bfloat16"}
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


def test_quant_fp8_writes_each_decoder_linear_as_e4m3_with_a_scale_per_channel_in_half_the_bytes(
        bf16_dir: Path, tmp_path: Path) -> None:
    core = tmp_path / "core"
    assert ignition(["export", str(bf16_dir), str(core), "--quant", "fp8"]) == 0
    manifest = load_manifest(core, verify=True)
    assert manifest.quantization == "fp8-channel" and manifest.dtype == "bfloat16"
    assert "quantization_config" not in manifest.config
    source, written = load_file(bf16_dir / "model.safetensors"), load_file(core / "model.safetensors")
    linears = [name for name in source if is_linear(name)]
    assert len(linears) == 3 * 7
    for name in linears:
        values, scale = channel_quantized(source[name])
        assert written[name + ".fp8"].dtype == torch.float8_e4m3fn
        assert torch.equal(written[name + ".fp8"].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(written[name + ".fp8_scale"], scale), name
    for name in set(source) - set(linears):  # the LM head, embeddings and norms as they were
        assert torch.equal(written[name], source[name]), name
    fp8_bytes = sum(written[name + ".fp8"].nbytes for name in linears)
    assert 2 * fp8_bytes == sum(source[name].nbytes for name in linears)
    # the engine serves it in fp32 on the CPU, each weight its values times their scales
    _, model = load_model(core, torch.device("cpu"))
    weights = model.state_dict()
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    for name in linears:
        assert torch.equal(weights[name], written[name + ".fp8"].float() * written[name + ".fp8_scale"]), name


def test_quant_none_dequantizes_an_fp8_checkpoint(tmp_path: Path) -> None:
    hf_dir = build_checkpoint("llama", tmp_path, LLAMA)
    dense = rewrite_as_fp8(hf_dir, CHANNEL_DYNAMIC)
    core = tmp_path / "core"
    assert ignition(["export", str(hf_dir), str(core), "--quant", "none"]) == 0
    assert load_manifest(core).quantization is None
    written = load_file(core / "model.safetensors")
    assert all(torch.equal(written[name], weight) for name, weight in dense.items())


def test_moe_experts_of_a_block_checkpoint_stack_with_their_block_scales(tmp_path: Path) -> None:
    hf_dir = build_checkpoint("qwen3_moe", tmp_path, MOE)
    state = load_file(hf_dir / "model.safetensors")
    experts = [name for name in state if ".experts." in name or name.endswith(("gate_up_proj", "down_proj"))]
    assert experts, "the checkpoint holds its experts"
    dense = rewrite_as_fp8(hf_dir, BLOCK, (16, 32))
    core = tmp_path / "core"
    assert ignition(["export", str(hf_dir), str(core)]) == 0
    assert load_manifest(core).quantization == "fp8-block-16x32"
    written = load_file(core / "model.safetensors")
    w13, scales = written["model.layers.0.mlp.w13.fp8"], written["model.layers.0.mlp.w13.fp8_block_scale"]
    assert w13.dtype == torch.float8_e4m3fn and w13.shape == (4, 64, 64) and scales.shape == (4, 4, 2)
    _, model = load_model(core, torch.device("cpu"))
    weights = model.state_dict()
    expert = 2  # its gate rows, then its up rows; down_proj as w2
    gate, up, down = (dense[f"model.layers.0.mlp.experts.{expert}.{part}.weight"]
                      for part in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(weights["model.layers.0.mlp.w13"][expert], torch.cat([gate, up]))
    assert torch.equal(weights["model.layers.0.mlp.w2"][expert], down)
    assert torch.equal(weights["model.layers.1.mlp.gate_proj.weight"], dense["model.layers.1.mlp.gate_proj.weight"])


def test_block_dequantization_of_partial_blocks_equals_transformers() -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 300)
    values, scale = block_quantized(weight, (128, 128))
    assert scale.shape == (2, 3)
    expected = _dequantize_fp8_weight(values, scale, [128, 128], torch.float32)
    assert torch.equal(dequantize(values, scale, (128, 128)), expected)


@pytest.mark.parametrize("change, needle", [
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "unsupported FP8 scheme fmt=e5m2"),
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization gptq"),
    ({"format": "pack-quantized"}, "unsupported compressed-tensors format pack-quantized"),
    ({"weights": {"strategy": "group", "group_size": 128}}, "weights strategy=group"),
    ({"weights": {"num_bits": 4}}, "weights num_bits=4"),
    ({"weights": {"dynamic": True}}, "weights dynamic=True"),
])
def test_an_fp8_scheme_flare_does_not_read_is_a_one_line_error_naming_it(
        bf16_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, needle: str) -> None:
    source = tmp_path / "checkpoint"
    source.mkdir()
    for file in bf16_dir.iterdir():
        (source / file.name).symlink_to(file)
    config = json.loads((bf16_dir / "config.json").read_text())
    quantization = quantization_config(CHANNEL_DYNAMIC)
    if "weights" in change:
        quantization["config_groups"]["group_0"]["weights"].update(change["weights"])
    else:
        quantization = change if "quant_method" in change else quantization | change
    (source / "config.json").unlink()
    (source / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    assert ignition(["export", str(source), str(tmp_path / "core")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ignition: error: {source / 'config.json'}: ") and err.count("\n") == 1, err
    assert needle in err and not (tmp_path / "core").exists()


def test_fp8_weights_without_a_quantization_config_are_an_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    hf_dir = build_checkpoint("llama", tmp_path, LLAMA)
    rewrite_as_fp8(hf_dir, CHANNEL_DYNAMIC)
    config = json.loads((hf_dir / "config.json").read_text())
    del config["quantization_config"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # save_pretrained's progress bar
    assert ignition(["export", str(hf_dir), str(tmp_path / "core")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is torch.float8_e4m3fn, but config.json names no FP8 quantization_config" in err


def test_synth_quant_fp8_writes_an_fp8_core_that_loads(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    assert ignition(["synth", "--preset", "tiny", "--layers", "1", "--quant", "fp8", str(out)]) == 0
    manifest = load_manifest(out, verify=True)
    assert manifest.quantization == "fp8-channel" and manifest.dtype == "bfloat16"
    assert load_file(out / "model.safetensors")["model.layers.0.mlp.down_proj.weight.fp8"].dtype == \
        torch.float8_e4m3fn
    _, model = load_model(out, torch.device("cpu"))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
