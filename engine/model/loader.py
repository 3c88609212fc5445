"""Build a model from a core directory: manifest checked, weights hashed and loaded without a random init; the
family (engine/model/config.py) comes from the manifest's architecture."""

from __future__ import annotations

from pathlib import Path

import torch

from common.errors import CoreError
from common.manifest import Manifest, load_manifest
from engine.model import fp8
from engine.model.attention import PagedAttention
from engine.model.backends.select import backend_kind, use_backend
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
from engine.model.fp8_linear import fp8_linears
from engine.model.kv_quant import FP8, KV_SCALE_SUFFIXES
from engine.model.quant import (codes_of, dequantize, dequantize_all, is_quantized, output_layer, quantize_linears,
                                quantized_view)
from engine.model.qwen3_vl import VisionLanguageLM
from engine.model.qwen3_vl_vision import VisionConfig
from engine.model.sharding import Shard, read_weights
from engine.parallel.group import TensorParallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_files(core: Path, manifest: Manifest) -> list[Path]:
    return [core / name for name in sorted(manifest.files) if name.endswith(".safetensors")]


def load_model(core: Path, device: torch.device, dtype: torch.dtype | None = None,
               verify: bool = True, tp: TensorParallel | None = None,
               dequantized: bool = False, fp8_kernels: bool | None = None,
               fp8_kv: bool = False) -> tuple[Manifest, CausalLM]:
    """The model's backend is chosen here, once (engine/model/backends/select.py): on CUDA the kernel path
    (Triton, fused projections); on the CPU the torch reference, or Flare's C++ ops for a quantized fp32 core.
    A quantized core's linears stay quantized on the CPU (engine/model/quant.py); on a GPU, or with `dequantized`,
    they are dequantized to `dtype` at load. An FP8 core's linears stay FP8 on a GPU (engine/model/fp8_linear.py:
    `fp8_kernels`, None for a GPU unless `dequantized`), its other FP8 weights, and on the CPU all of them, are
    dequantized at load (engine/model/fp8.py); they split over ranks like dense ones. `fp8_kv`: the KV cache
    will be FP8 (engine/model/kv_quant.py), which Flare's C++ ops do not read; the attention layers' KV scales are
    the core's either way."""
    manifest = load_manifest(core, verify=verify)
    fp8_core = fp8.is_fp8(manifest.quantization)
    if manifest.quantization and not fp8_core and tp and tp.world_size > 1:
        raise CoreError(f"{core}: a quantized core runs on one rank; export it with --quant none for --tp")
    config = DecoderConfig.from_hf(manifest.architecture, manifest.config, str(core / "manifest.json"))
    shard = Shard.of(config, tp.rank, tp.world_size) if tp else None  # with a group, only this rank's part
    if shard:
        config = shard.local_config(config)
    # An FP8 core computes in fp32 on the CPU (its weights dequantized exactly), in its own dtype on a GPU.
    dtype = dtype or (torch.float32 if fp8_core and device.type == "cpu" else DTYPES[manifest.dtype])
    if manifest.vision is not None and tp:
        raise CoreError(f"{core}: tensor parallelism is not supported for vision models")
    with torch.device("meta"):
        model = VisionLanguageLM(config, VisionConfig.from_hf(manifest.config["vision_config"])) \
            if manifest.vision is not None else CausalLM(config, tp)
    state: dict[str, torch.Tensor] = {}
    block = fp8.scheme_block(manifest.quantization)
    for file in weight_files(core, manifest):
        state.update(read_weights(file, device, shard, block))
    if fp8_core and (fp8_kernels if fp8_kernels is not None else device.type == "cuda" and not dequantized):
        fp8_linears(model, state, block)
    fp8.dequantize_all(state, block, dtype)
    quantized = is_quantized(state)
    if quantized and (device.type != "cpu" or dequantized):
        dequantize_all(state)
        quantized = False
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        tied_head = quantized_view("model.embed_tokens.weight", state)
    head = codes_of(state, "lm_head.weight")
    head_parts = (head[0], state["lm_head.weight.scale"], state["lm_head.weight.min"]) if head else None
    kv_scales = {name: state.pop(name) for name in [n for n in state if n.endswith(KV_SCALE_SUFFIXES)]}
    quantize_linears(model, state, dtype)
    missing = set(model.state_dict()) - set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise CoreError(f"{core}: weights missing from the core: {sorted(missing)[:4]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        if tied_head is not None:
            model.lm_head = output_layer(tied_head, lambda: model.model.embed_tokens.weight)
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    elif head_parts is not None:
        model.lm_head = output_layer(model.lm_head, lambda: dequantize(*head_parts).to(dtype))
    model.set_rope(device)
    set_kv_scales(model, kv_scales, device)
    use_backend(model, backend_kind(device, quantized, dtype, config.hybrid, fp8_kv), manifest.context_limit)
    model.kv_dtype = FP8 if fp8_kv else None
    return manifest, model.eval()


def set_kv_scales(model: torch.nn.Module, scales: dict[str, torch.Tensor], device: torch.device) -> None:
    """Each attention layer's `kv_scale` [2, KVH] from the core's `<attention>.k_scale` and `v_scale` (this rank's
    KV heads: engine/model/sharding.py splits them), 1.0 where the core has none."""
    for name, module in model.named_modules():
        if isinstance(module, PagedAttention):
            owner = name.removesuffix(".attn")
            parts = [scales.get(f"{owner}.{part}") for part in ("k_scale", "v_scale")]
            value = torch.ones(2, module.num_kv_heads, device=device)
            for i, part in enumerate(parts):
                if part is not None:
                    value[i] = part.float().to(device).expand(module.num_kv_heads)
            module.register_buffer("kv_scale", value, persistent=False)
