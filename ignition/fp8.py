"""FP8 checkpoints and `--quant fp8`: e4m3 weights with their fp32 scales (docs/design.md, Cores).

Read: a checkpoint's `quantization_config` names its scheme (`checkpoint_scheme`), and each FP8 weight comes with
its scale beside it (the source pairs them into an `Fp8Weight`):

- block-wise (Qwen3 FP8, DeepSeek): `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk]}`,
  `P.weight_scale_inv` per block of bn x bk (fp32, or UE8M0 powers of two);
- per tensor (`quant_method: fp8` without a block, as AutoFP8 writes it): `P.weight_scale`, one value;
- compressed-tensors `float-quantized` (Llama, Mistral, Qwen "FP8" and "FP8-dynamic"): 8-bit float weights of
  strategy `tensor`, `channel` or `block` in `P.weight_scale`.

Activation settings (static `input_scale`, dynamic per-token) are dropped: Flare computes in fp32 on the CPU, and its
FP8 GEMM scales activations per token at run time (engine/kernels/triton/fp8_linear.py). KV-cache scales (vLLM's and
compressed-tensors' `k_scale` and `v_scale` of each attention layer, one per layer or per KV head) are kept, one per
KV head (`kv_scale`), for `--kv-cache-dtype fp8` (engine/model/kv_quant.py).
A per-tensor scale becomes one per output channel (the same value on every row: the same weight). Anything else
(another bit width, e5m2, groups, asymmetric or dynamic weights, another quant_method) is a one-line error naming
it.

Written: `--quant fp8` quantizes every linear of the decoder layers (not the LM head, nor the embeddings) to e4m3
with one scale per output channel, scale = max|w| / 448, values rounded to nearest. The core's layout is
engine/model/fp8.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import CoreError
from engine.model.fp8 import (BLOCK_SCALE, CHANNEL_SCALE, CHANNEL_SCHEME, E4M3_MAX, VALUES, block_scheme,
                              dequantize)

# A scale's name beside weight `P.weight`, by checkpoint format.
BLOCK_SCALE_NAME = "weight_scale_inv"
SCALE_NAME = "weight_scale"
# Tensors an FP8 checkpoint holds that a core does not need (see the module docstring).
DROPPED = (".input_scale", ".output_scale")
KV_SCALES = (".self_attn.k_scale", ".self_attn.v_scale")  # engine/model/kv_quant.py KV_SCALE_SUFFIXES
# The linears `--quant fp8` quantizes: a decoder layer's projections and stacked experts.
_LINEAR = re.compile(r"^model\.layers\.\d+\..*(_proj\.weight|\.mlp\.w13|\.mlp\.w2)$")


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's FP8 weights are scaled: `block` (rows, columns) or None for per channel or tensor."""

    block: tuple[int, int] | None
    scale_name: str  # the suffix that replaces `weight` in a weight's name to name its scale


@dataclass(frozen=True)
class Fp8Weight:
    values: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # fp32 [..., N, 1] per channel, or [..., ceil(N / bn), ceil(K / bk)] per block
    block: tuple[int, int] | None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def scheme(self) -> str:
        return CHANNEL_SCHEME if self.block is None else block_scheme(self.block)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.values, self.scale, self.block)

    def core_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The entries of a core's safetensors for weight `name` (engine/model/fp8.py)."""
        scale = name + (CHANNEL_SCALE if self.block is None else BLOCK_SCALE)
        return {name + VALUES: self.values.contiguous(), scale: self.scale.float().contiguous()}

    @classmethod
    def of(cls, values: torch.Tensor, scale: torch.Tensor, scheme: Scheme, where: str) -> Fp8Weight:
        """A checkpoint's weight and its scale, checked against the scheme's shapes."""
        if values.dtype != torch.float8_e4m3fn:
            raise CoreError(f"{where}: unsupported FP8 weight dtype {values.dtype} (Flare reads float8_e4m3fn)")
        rows, cols = values.shape[-2:]
        scale = scale.float()
        if scheme.block is not None:
            expected = (*values.shape[:-2], -(-rows // scheme.block[0]), -(-cols // scheme.block[1]))
        elif scale.numel() == 1:  # per tensor: the same scale on every output channel
            scale = scale.reshape(1).expand(rows).reshape(rows, 1)
            expected = (rows, 1)
        else:
            scale = scale.reshape(*scale.shape[:-1], -1, 1) if scale.dim() == values.dim() - 1 else scale
            expected = (*values.shape[:-1], 1)
        if tuple(scale.shape) != expected:
            raise CoreError(f"{where}: scale of shape {tuple(scale.shape)} for an FP8 weight of shape "
                            f"{tuple(values.shape)}; the scheme needs {expected}")
        return cls(values, scale.contiguous(), scheme.block)


def checkpoint_scheme(raw: dict[str, object], where: Path) -> Scheme | None:
    """The FP8 scheme of a checkpoint's config, None for a dense checkpoint; any other quantization is a CoreError."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise CoreError(f"{where}: quantization_config is not an object")
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise CoreError(f"{where}: unsupported FP8 scheme fmt={config['fmt']} (Flare reads e4m3)")
        block = config.get("weight_block_size")
        if block is None:
            return Scheme(None, SCALE_NAME)
        return Scheme(_block(block, where, "weight_block_size"), BLOCK_SCALE_NAME)
    if method == "compressed-tensors":
        return _compressed_tensors(config, where)
    raise CoreError(f"{where}: unsupported quantization {method} (Flare reads FP8: quant_method fp8 or "
                    "compressed-tensors float-quantized)")


def _compressed_tensors(config: dict, where: Path) -> Scheme:
    if config.get("format") != "float-quantized":
        raise CoreError(f"{where}: unsupported compressed-tensors format {config.get('format')} "
                        "(Flare reads float-quantized FP8)")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CoreError(f"{where}: compressed-tensors quantization_config without config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise CoreError(f"{where}: compressed-tensors group {name} has no weights scheme")
        wanted = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        for key, value in wanted.items():
            if weights.get(key, value) != value:
                raise CoreError(f"{where}: unsupported FP8 scheme in group {name}: weights {key}={weights[key]}")
        strategy = weights.get("strategy")
        if strategy in ("tensor", "channel"):
            blocks.add(None)
        elif strategy == "block":
            blocks.add(_block(weights.get("block_structure"), where, f"group {name} block_structure"))
        else:
            raise CoreError(f"{where}: unsupported FP8 scheme in group {name}: weights strategy={strategy}")
    if len(blocks) > 1:
        raise CoreError(f"{where}: unsupported FP8 scheme: groups of different weight strategies")
    return Scheme(blocks.pop(), SCALE_NAME)


def _block(value: object, where: Path, what: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise CoreError(f"{where}: unsupported FP8 scheme {what}={value} (two positive sizes)")
    return value[0], value[1]


def scale_name(name: str, scheme: Scheme) -> str | None:
    """The name of the scale of checkpoint weight `name`, or None for a tensor that is not a weight."""
    return name.removesuffix("weight") + scheme.scale_name if name.endswith(".weight") else None


def is_scale_or_dropped(name: str, scheme: Scheme) -> bool:
    return name.endswith(("." + scheme.scale_name, *DROPPED))


def kv_scale(name: str, tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """An attention layer's key or value cache scale as a core holds it: fp32, one per KV head (a per-layer scale on
    every head)."""
    scale = tensor.float().reshape(-1)
    if scale.numel() not in (1, kv_heads) or not bool((scale > 0).all()):
        raise CoreError(f"{name}: a KV cache scale of shape {tuple(tensor.shape)}; Flare reads one positive scale "
                        f"per layer or per KV head ({kv_heads})")
    return scale.expand(kv_heads).contiguous()


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """`--quant fp8` takes the decoder layers' linears (their projections and experts), nothing else."""
    return isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and _LINEAR.match(name) is not None


def quantize(weight: torch.Tensor) -> Fp8Weight:
    """e4m3 with one fp32 scale per output channel: scale = max|w| / 448, values w / scale rounded to nearest."""
    weight = weight.float()
    scale = weight.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    values = (weight / torch.where(scale > 0, scale, torch.ones_like(scale))).to(torch.float8_e4m3fn)
    return Fp8Weight(values, scale, None)


def cat(parts: list[torch.Tensor | Fp8Weight], dim: int) -> torch.Tensor | Fp8Weight:
    """torch.cat over weights that may be FP8 (an expert's gate and up rows); FP8 parts join their scales alike,
    block scales by whole blocks."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return torch.cat(parts, dim=dim)
    first = _alike(parts)
    if dim % len(first.shape) != len(first.shape) - 2:
        raise CoreError("FP8 weights join along their output rows only")
    if first.block is not None and any(p.shape[dim] % first.block[0] for p in parts[:-1]):
        raise CoreError(f"FP8 expert weights of {parts[0].shape[dim]} rows do not join by whole "
                        f"{first.block[0]}-row blocks")
    return Fp8Weight(torch.cat([p.values for p in parts], dim=dim), torch.cat([p.scale for p in parts], dim=dim),
                     first.block)


def stack(parts: list[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """torch.stack over weights that may be FP8 (a layer's experts)."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return torch.stack(parts)
    first = _alike(parts)
    return Fp8Weight(torch.stack([p.values for p in parts]), torch.stack([p.scale for p in parts]), first.block)


def _alike(parts: list[torch.Tensor | Fp8Weight]) -> Fp8Weight:
    first = parts[0]
    if not all(isinstance(p, Fp8Weight) and p.block == first.block for p in parts):
        raise CoreError("expert weights mix FP8 and dense tensors, or FP8 blocks of different sizes")
    return first
