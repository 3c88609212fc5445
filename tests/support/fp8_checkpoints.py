"""FP8 checkpoints written by hand from a dense one, by each format's definition (ignition/fp8.py lists them), and
the dense weights they stand for: the e4m3 values times their scales, in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from common.manifest import load_manifest, sha256_file, write_manifest

E4M3_MAX = 448.0
# Format -> its quantization_config (the block formats take their block as an argument).
BLOCK = "block"
CHANNEL_DYNAMIC = "compressed-tensors-channel"
TENSOR_STATIC = "compressed-tensors-tensor"


def e4m3(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values rounded to nearest, as `tensor.to(torch.float8_e4m3fn)` rounds them."""
    return (weight / torch.where(scale > 0, scale, torch.ones_like(scale))).to(torch.float8_e4m3fn)


def channel_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ignition export --quant fp8`'s definition: one scale per output channel, max|w| / 448."""
    scale = weight.float().abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    return e4m3(weight.float(), scale), scale


def block_expanded(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [..., ceil(N / bn), ceil(K / bk)] as one per element of a weight of `shape` [..., N, K]."""
    rows, cols = shape[-2:]
    scale = scale.repeat_interleave(block[0], -2)[..., :rows, :]
    return scale.repeat_interleave(block[1], -1)[..., :cols]


def block_quantized(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A scale per block of rows x columns (the last ones partial), max|w| of the block / 448; weights [..., N, K]."""
    rows, cols = weight.shape[-2:]
    padded = torch.nn.functional.pad(weight.float().abs(), (0, -cols % block[1], 0, -rows % block[0]))
    blocks = padded.unflatten(-2, (-1, block[0])).unflatten(-1, (-1, block[1]))  # [..., N/bn, bn, K/bk, bk]
    scale = blocks.amax(dim=(-3, -1)) / E4M3_MAX
    return e4m3(weight.float(), block_expanded(scale, weight.shape, block)), scale


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def rewrite_as_fp8(hf_dir: Path, fmt: str, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Rewrite `hf_dir`'s single model.safetensors with every decoder linear in FP8 format `fmt`, its scales beside
    it, and the config's quantization_config; return the dense weights the checkpoint now stands for (fp32)."""
    path = hf_dir / "model.safetensors"
    state = load_file(path)
    dense: dict[str, torch.Tensor] = {}
    for name in [n for n in state if is_linear(n)]:
        weight = state.pop(name)
        base = name.removesuffix("weight")
        if fmt == BLOCK:
            values, scale = block_quantized(weight, block)
            state[base + "weight_scale_inv"] = scale
            dense[name] = values.float() * block_expanded(scale, weight.shape, block)
        elif fmt == CHANNEL_DYNAMIC:
            values, scale = channel_quantized(weight)
            state[base + "weight_scale"] = scale
            dense[name] = values.float() * scale
        else:  # one scale for the tensor, and a static activation scale the engine does not need
            scale = weight.float().abs().amax().reshape(1) / E4M3_MAX
            values = e4m3(weight.float(), scale)
            state[base + "weight_scale"] = scale
            state[base + "input_scale"] = torch.tensor([0.05])
            dense[name] = values.float() * scale
        state[name] = values
    save_file(state, path, metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, block)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return dense


def quantization_config(fmt: str, block: tuple[int, int] = (128, 128)) -> dict:
    if fmt == BLOCK:  # as Qwen3-8B-FP8 and DeepSeek-V3 write it
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    static = fmt == TENSOR_STATIC
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                   "strategy": "tensor" if static else "token", "group_size": None, "block_structure": None,
                   "actorder": None, "observer": None if not static else "minmax", "observer_kwargs": {}}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor" if static else "channel", "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    # as llm-compressor writes FP8 (static) and FP8_DYNAMIC models
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"weights": weights, "input_activations": activations,
                                          "output_activations": None, "targets": ["Linear"]}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None}


def as_fp8(core: Path, block: tuple[int, int]) -> Path:
    """A core (its one model.safetensors) with its attention projections in FP8 with per-channel scales and its
    MLPs and experts with block scales, as ignition writes them (engine/model/fp8.py)."""
    state = load_file(core / "model.safetensors")
    for name in [n for n in state if n.startswith("model.layers.") and n.endswith(("_proj.weight", ".w13", ".w2"))]:
        weight = state.pop(name)
        if ".self_attn." in name:
            values, scale = channel_quantized(weight)
            state.update({name + ".fp8": values, name + ".fp8_scale": scale})
        else:
            values, scale = block_quantized(weight, block)
            state.update({name + ".fp8": values, name + ".fp8_block_scale": scale})
    save_file(state, core / "model.safetensors")
    manifest = load_manifest(core)
    write_manifest(core, msgspec.structs.replace(
        manifest, quantization=f"fp8-block-{block[0]}x{block[1]},fp8-channel",
        files={"model.safetensors": sha256_file(core / "model.safetensors")}))
    return core
