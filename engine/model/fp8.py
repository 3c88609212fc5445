"""FP8 weights in a core: e4m3 values with fp32 scales per output channel or per block (docs/design.md, Cores).

A core (ignition/fp8.py writes it) holds, for a weight `P.weight` of shape [..., N, K] (a linear's, or a stack of
experts'), its values `P.weight.fp8` (float8_e4m3fn, the same shape) and one of

- `P.weight.fp8_scale` [..., N, 1]: one scale per output channel, w[n, k] = fp8[n, k] * scale[n];
- `P.weight.fp8_block_scale` [..., ceil(N / bn), ceil(K / bk)]: one per block of bn x bk, the last blocks of a row
  or column partial; the manifest's scheme names the block (`fp8-block-128x128`).

The manifest's `quantization` lists the schemes a core holds (`fp8-channel`, `fp8-block-BNxBK`). On the CPU the
loader dequantizes every such weight at load, to fp32; on a GPU the linears stay FP8 (engine/model/fp8_linear.py)
and the rest (stacked experts, row-parallel linears) is dequantized to the core's dtype.
"""

from __future__ import annotations

import torch

VALUES = ".fp8"
CHANNEL_SCALE = ".fp8_scale"
BLOCK_SCALE = ".fp8_block_scale"
SUFFIXES = (VALUES, CHANNEL_SCALE, BLOCK_SCALE)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CHANNEL_SCHEME = "fp8-channel"
_BLOCK_PREFIX = "fp8-block-"


def block_scheme(block: tuple[int, int]) -> str:
    return f"{_BLOCK_PREFIX}{block[0]}x{block[1]}"


def scheme_block(quantization: str | None) -> tuple[int, int] | None:
    """The block (rows, columns) of a manifest's block-wise FP8 scheme, or None if it names none."""
    for scheme in (quantization or "").split(","):
        if scheme.startswith(_BLOCK_PREFIX):
            rows, _, cols = scheme.removeprefix(_BLOCK_PREFIX).partition("x")
            return int(rows), int(cols)
    return None


def is_fp8(quantization: str | None) -> bool:
    return any(scheme.startswith("fp8-") for scheme in (quantization or "").split(","))


def dequantize(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The fp32 weight of e4m3 `values` [..., N, K]: with `block` None, `scale` is per output channel [..., N, 1];
    otherwise per block [..., ceil(N / bn), ceil(K / bk)]."""
    scale = scale.float()
    if block is not None:
        rows, cols = values.shape[-2:]
        scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
        scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return values.float() * scale


def dequantize_all(state: dict[str, torch.Tensor], block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> None:
    """Replace every FP8 weight of `state` by its values in `dtype` (computed in fp32, then rounded: one weight at a
    time, so that a GPU never holds the whole model in fp32); `block` is the core's (its manifest's)."""
    for name in [n.removesuffix(VALUES) for n in state if n.endswith(VALUES)]:
        values = state.pop(name + VALUES)
        scale = state.pop(name + CHANNEL_SCALE, None)
        weight = dequantize(values, scale, None) if scale is not None else \
            dequantize(values, state.pop(name + BLOCK_SCALE), block)
        state[name] = weight.to(dtype)


def rows_expanded(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Block scales [..., ceil(N / bn), S] as one row of scales per weight row [..., N, S], as the FP8 kernels read
    them (engine/kernels/triton/fp8_linear.py): fused products then concatenate their parts' scales by rows."""
    return scale.float().repeat_interleave(block_rows, dim=-2)[..., :rows, :].contiguous()
