"""A linear whose weight stays FP8 on the kernel path (docs/design.md, Models and kernels): e4m3 values and fp32
scales as the FP8 kernels read them (engine/kernels/triton/fp8_linear.py, gemv.py), each step on the kernel its
number of tokens calls for (GEMV_ROWS, DEQUANTIZED_ROWS below). A step of one token takes few_rows.py's fused GEMVs
where the model allows them.
The loader swaps it in for a core's FP8 linears on a GPU (engine/model/loader.py); on the CPU an FP8 core is
dequantized instead, and this module runs only under the Triton interpreter, in tests."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model.fp8 import BLOCK_SCALE, CHANNEL_SCALE, VALUES, rows_expanded

if TYPE_CHECKING:
    from engine.kernels.triton.fp8_linear import E4m3Rows

# Which kernel a step of T tokens takes (bench/lab/gpu/fp8.py's sweep on an H200): up to GEMV_ROWS, the GEMV; up to
# DEQUANTIZED_ROWS, the weight tiles dequantized onto the tensor cores (read once for every row, the activations as
# they are: up to 13% faster than bf16's cuBLAS there, and past 16 rows slower than the FP8 products); above, the
# activations quantized per token and e4m3 products: cuBLASLt's for a scale per output row (at 512-8,192 rows
# 1.2-1.4x the Triton GEMM's speed), the Triton GEMM for block scales.
GEMV_ROWS = 1
DEQUANTIZED_ROWS = 16


class Fp8Linear(nn.Module):
    def __init__(self, values: torch.Tensor, scale: torch.Tensor, scale_k: int | None,
                 bias: torch.Tensor | None = None) -> None:
        """values e4m3 [N, K]; scale fp32 [N, S], each covering `scale_k` columns (None: one scale per row)."""
        super().__init__()
        from engine.kernels.triton.fp8_linear import gemm_block_k

        self.out_features, self.in_features = values.shape
        self.scale_k = scale_k
        # Whether the GEMMs take it: their K tiles must lie inside its scale blocks (else every step takes the GEMV).
        self.tiled = gemm_block_k(scale_k or self.in_features, self.in_features) is not None
        self.register_buffer("values", values.contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of(cls, values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
           bias: torch.Tensor | None = None) -> Fp8Linear:
        """From a core's entries (engine/model/fp8.py): per-channel scales [N, 1], or block scales of `block`."""
        if block is None:
            return cls(values, scale, None, bias)
        return cls(values, rows_expanded(scale, values.shape[0], block[0]), block[1], bias)

    @classmethod
    def concat(cls, *parts: Fp8Linear) -> Fp8Linear | None:
        """One layer computing the parts' outputs side by side (fused q/k/v and gate/up), or None where they cannot
        share one product: other inputs, biases on some only, or blocks of other widths. A per-channel part beside
        block parts takes its scale in every block column (the same weight)."""
        first = parts[0]
        blocks = {p.scale_k for p in parts} - {None}
        if any(p.in_features != first.in_features for p in parts) or len({p.bias is None for p in parts}) > 1 or \
                len(blocks) > 1:
            return None
        scale_k = blocks.pop() if blocks else None
        columns = -(-first.in_features // scale_k) if scale_k else 1
        scales = [p.scale.expand(-1, columns) if p.scale_k is None else p.scale for p in parts]
        return cls(torch.cat([p.values for p in parts]), torch.cat(scales), scale_k,
                   None if first.bias is None else torch.cat([p.bias for p in parts]))

    def takes_e4m3(self, rows: int) -> bool:
        """Whether a step of `rows` tokens multiplies e4m3 activations here (forward then takes them already
        quantized: E4m3Rows)."""
        return rows > DEQUANTIZED_ROWS and self.tiled

    def forward(self, x: torch.Tensor | E4m3Rows) -> torch.Tensor:
        from engine.kernels.triton.fp8_linear import E4m3Rows, fp8_dequantized_gemm
        from engine.kernels.triton.gemv import fp8_config, gemv

        if isinstance(x, E4m3Rows):
            assert self.takes_e4m3(x.values.shape[0])
            return self._e4m3_product(x)
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if rows.shape[0] <= GEMV_ROWS or not self.tiled:
            # Under the CPU's interpreter (tests) a program costs far more than its rows: fewer, larger ones.
            out = gemv(rows, self.values, self.bias, scale=self.scale, scale_k=self.scale_k,
                       config=None if rows.is_cuda else replace(fp8_config(*self.values.shape), block_n=64))
        elif rows.shape[0] <= DEQUANTIZED_ROWS:
            out = fp8_dequantized_gemm(rows, self.values, self.scale, self.scale_k, self.bias)
        else:
            out = self._e4m3_product(rows)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _e4m3_product(self, rows: torch.Tensor | E4m3Rows) -> torch.Tensor:
        """Activations quantized per token (here, or by the kernel before) times the weight: cuBLASLt's product for
        a scale per output row, the Triton GEMM for block scales."""
        from engine.kernels.triton.fp8_linear import fp8_gemm, fp8_scaled_mm

        if self.scale_k is None and self.values.is_cuda:
            return fp8_scaled_mm(rows, self.values, self.scale, self.bias)
        return fp8_gemm(rows, self.values, self.scale, self.scale_k, self.bias)


def fp8_linears(model: nn.Module, state: dict[str, torch.Tensor], block: tuple[int, int] | None) -> None:
    """Replace every plain nn.Linear whose weight `state` holds in FP8 by an Fp8Linear, and keep a single rank's
    stacked experts FP8 (fp8_experts); their FP8 entries leave `state`. What else is FP8 (a tensor-parallel rank's
    experts, a row-split linear with its all-reduce) stays in `state` for the loader to dequantize."""
    fp8_experts(model, state, block)
    for path, module in list(model.named_modules()):
        weight = f"{path}.weight"
        if type(module) is not nn.Linear or weight + VALUES not in state:
            continue
        values = state.pop(weight + VALUES)
        scale = state.pop(weight + CHANNEL_SCALE, None)
        layer = Fp8Linear.of(values, scale, None, state.get(f"{path}.bias")) if scale is not None else \
            Fp8Linear.of(values, state.pop(weight + BLOCK_SCALE), block, state.get(f"{path}.bias"))
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)


def fp8_experts(model: nn.Module, state: dict[str, torch.Tensor], block: tuple[int, int] | None) -> None:
    """Each single-rank MoE layer whose experts `state` holds in FP8 keeps them so, with their scales as the fused
    MoE kernels read them (engine/kernels/triton/moe_rows.py, ExpertScales): one per row, or one per block column of
    a row; in a core of blocks an expert stack with a scale per row takes it in every block column."""
    from engine.kernels.triton.moe_rows import ExpertScales
    from engine.model.moe import SparseMoE

    for path, module in model.named_modules():
        if not isinstance(module, SparseMoE) or module.tp is not None or f"{path}.w13{VALUES}" not in state:
            continue
        parts = []
        for name in ("w13", "w2"):
            key = f"{path}.{name}"
            values = state.pop(key + VALUES)
            scale = state.pop(key + CHANNEL_SCALE, None)
            if scale is None:
                scale = rows_expanded(state.pop(key + BLOCK_SCALE), values.shape[-2], block[0])
            elif block is not None:
                scale = scale.expand(-1, -1, -(-values.shape[-1] // block[1]))
            parts.append((values, scale.float().contiguous()))
        (w13, s13), (w2, s2) = parts
        module.use_fp8(w13, w2, ExpertScales(s13, s2, None if block is None else block[1]))
