"""FP8 products on the GPU, printed as markdown tables:

    python -m bench.lab.gpu.fp8 [--out FILE] [--only gemv|gemm|quantize]

Llama-3.1-8B's projections (q/k/v, o, gate/up, down) with random weights quantized to e4m3, one scale per output
channel (what `ignition export --quant fp8` writes):
- gemv: engine/kernels/triton/gemv.py over FP8 weights at 1-16 rows under each block configuration, against the
  same kernel over bf16 weights and cuBLAS bf16 (F.linear): microseconds and TB/s on the weight's bytes;
- gemm: at 2-8,192 rows, engine/kernels/triton/fp8_linear.py's dequantizing GEMM (weight tiles to bf16 in registers,
  the activations as they are; up to 512 rows) and its FP8 GEMM (the per-token activation quantization included;
  from 32 rows) under each tile configuration, with K split among programs too from 16 to 128 rows, against cuBLAS
  bf16, torch._scaled_mm (cuBLASLt's FP8 with row-wise scales, fed by the same activation quantization) and what
  Fp8Linear picks: microseconds and TFLOP/s; at 16-128 rows also in TB/s on the weight's bytes;
- quantize: the activations' per-token quantization apart from the RMSNorm and SiLU-and-mul kernels before the
  products, and inside them.

Timing is bench.lab.gpu.kernels.graph_ms (CUDA events around calls replayed from one graph); each call reads the
next of several copies of the weight, more bytes in all than the L2 cache holds, so every call reads its weight from
memory as a decode step does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import cycle

import torch
import torch.nn.functional as F

from bench.lab.gpu.evidence import say, sections_main
from bench.lab.gpu.kernels import graph_ms
from engine.kernels.triton.activation import silu_and_mul, silu_and_mul_e4m3
from engine.kernels.triton.fp8_linear import (DEQUANTIZED_CONFIG, GEMM_CONFIGS, DequantizedConfig, GemmConfig,
                                              fp8_dequantized_gemm, fp8_gemm, fp8_scaled_mm, gemm_config,
                                              quantize_rows)
from engine.kernels.triton.gemv import FP8_CONFIG, GemvConfig, gemv
from engine.kernels.triton.rmsnorm import add_rms_norm, add_rms_norm_e4m3
from engine.model.fp8_linear import Fp8Linear

DEVICE = "cuda"
HIDDEN, INTER, QKV = 4096, 14336, 6144
PROJECTIONS = {"q/k/v": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate/up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
GEMV_SWEEP = [GemvConfig(*c) for c in [(8, 512, 4, 3), (4, 1024, 4, 3), (8, 1024, 4, 4), (16, 1024, 8, 3),
                                       (8, 2048, 8, 3), (4, 2048, 4, 3), (16, 512, 4, 4)]]
GEMM_SWEEP = [GemmConfig(*c) for c in [(16, 64, 4, 5), (32, 64, 4, 5), (64, 64, 4, 4), (64, 128, 4, 4),
                                       (64, 128, 8, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
                                       (64, 256, 8, 4)]]
DEQUANTIZED_SWEEP = [DequantizedConfig(*c) for c in [(16, 32, 256, 4, 4), (32, 32, 256, 4, 4), (64, 64, 256, 4, 4),
                                                     (64, 32, 512, 4, 3), (64, 16, 512, 4, 4), (64, 64, 128, 4, 5),
                                                     (128, 64, 256, 8, 3), (64, 128, 128, 4, 4), (64, 32, 128, 4, 6)]]
# Split K for steps of 16-128 rows, whose output tiles are too few to keep every multiprocessor streaming the weight.
GEMM_SPLIT_SWEEP = [GemmConfig(*c) for c in [(16, 64, 4, 5, 8, 4), (32, 64, 4, 5, 8, 4), (64, 64, 4, 4, 8, 2),
                                             (64, 64, 4, 4, 8, 4), (64, 128, 4, 4, 8, 2), (64, 128, 8, 4, 8, 4),
                                             (128, 64, 8, 3, 8, 4)]]
DEQUANTIZED_SPLIT_SWEEP = [DequantizedConfig(*c) for c in [(16, 32, 256, 4, 4, 2), (16, 64, 256, 4, 4, 2),
                                                           (16, 64, 128, 4, 5, 4), (32, 64, 256, 4, 4, 2),
                                                           (64, 64, 128, 4, 4, 4)]]
LOADED_BYTES = 256 << 20  # the weights' copies in all: several times the L2 cache


Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Fp8Linear]


def copies(n: int, k: int, g: torch.Generator, count: int | None = None) -> list[Weight]:
    """(bf16 weight, e4m3 values, scale [N, 1], the Fp8Linear of both) of random weights: `count` of them, or as
    many as take LOADED_BYTES in FP8."""
    out = []
    for _ in range(count or max(2, LOADED_BYTES // (n * k))):
        dense = torch.randn(n, k, device=DEVICE, generator=g) * k**-0.5
        scale = dense.abs().amax(dim=1, keepdim=True) / 448.0
        values = (dense / scale).to(torch.float8_e4m3fn)
        out.append((dense.bfloat16(), values, scale, Fp8Linear(values, scale, None)))
    return out


def timed(call: Callable[[Weight], object], weights: list[Weight]) -> float:
    """Microseconds of one call, each on the next copy of the weight."""
    following = cycle(weights)
    return 1e3 * graph_ms(lambda: call(next(following)), replays=4 * len(weights))


def cell(label: str, run: Callable[[], float]) -> str:
    try:
        return label.format(run())
    except Exception as error:  # a configuration that does not compile is a cell, not the end of the run
        return type(error).__name__


def bench_gemv() -> None:
    say("## FP8 GEMV: microseconds and TB/s on the weight (bf16 rows: the same weights in bf16)")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    weights = {name: copies(n, k, g) for name, (n, k) in PROJECTIONS.items()}
    for rows in (1, 2, 4, 8, 16):
        x = {name: torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=g)
             for name, (_, k) in PROJECTIONS.items()}
        say(f"### {rows} row(s)")
        say("| kernel | " + " | ".join(PROJECTIONS) + " |")
        say("| --- |" + " --- |" * len(PROJECTIONS))

        def row(label: str, call, fp8: bool = True) -> None:
            cells = []
            for name, (n, k) in PROJECTIONS.items():
                size = n * k * (1 if fp8 else 2)
                cells.append(cell("{}", lambda: (lambda us: f"{us:.1f} us {size / us / 1e6:.2f}")(
                    timed(lambda w: call(x[name], w), weights[name]))))
            say(f"| {label} | " + " | ".join(cells) + " |")
        row("cuBLAS bf16", lambda x, w: F.linear(x, w[0]), fp8=False)
        row("gemv bf16 (DEFAULT_CONFIG)", lambda x, w: gemv(x, w[0]), fp8=False)
        row(f"gemv fp8 FP8_CONFIG {tuple(vars(FP8_CONFIG).values())}", lambda x, w: gemv(x, w[1], scale=w[2]))
        for config in GEMV_SWEEP:
            row(f"gemv fp8 {tuple(vars(config).values())}",
                lambda x, w, config=config: gemv(x, w[1], scale=w[2], config=config))


def bench_gemm() -> None:
    say("## FP8 products of many rows: microseconds and TFLOP/s (up to 128 rows, TB/s on the weight's bytes too)")
    say(f"GEMM_CONFIGS: {[(most, tuple(vars(c).values())) for most, c in GEMM_CONFIGS]}; DEQUANTIZED_CONFIG: "
        f"{tuple(vars(DEQUANTIZED_CONFIG).values())}")
    g = torch.Generator(device=DEVICE).manual_seed(2)
    weights = {name: copies(n, k, g, 4) for name, (n, k) in PROJECTIONS.items()}
    for rows in (2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192):
        x = {name: torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=g)
             for name, (_, k) in PROJECTIONS.items()}
        say(f"### {rows} rows")
        say("| kernel | " + " | ".join(PROJECTIONS) + " |")
        say("| --- |" + " --- |" * len(PROJECTIONS))

        def row(label: str, call, weight_bytes: int = 1) -> None:
            """weight_bytes: of a weight element, for the TB/s of steps that read the weight more than they compute."""
            cells = []
            for name, (n, k) in PROJECTIONS.items():
                flops, size = 2 * rows * n * k, weight_bytes * n * k
                bandwidth = (lambda us: f" {size / us / 1e6:.2f} TB/s") if rows <= 128 else (lambda us: "")
                cells.append(cell("{}", lambda: (lambda us: f"{us:.1f} us {flops / us / 1e6:.0f}{bandwidth(us)}")(
                    timed(lambda w: call(x[name], w), weights[name]))))
            say(f"| {label} | " + " | ".join(cells) + " |")
        row("cuBLAS bf16", lambda x, w: F.linear(x, w[0]), weight_bytes=2)
        row("Fp8Linear (the model's choice)", lambda x, w: w[3](x))
        row("torch._scaled_mm row-wise (+ quantize_rows)", lambda x, w: fp8_scaled_mm(x, w[1], w[2]))
        row("quantize_rows alone", lambda x, w: quantize_rows(x))
        if rows <= 512:
            for config in DEQUANTIZED_SWEEP + (DEQUANTIZED_SPLIT_SWEEP if rows <= 128 else []):
                row(f"dequantized {tuple(vars(config).values())}",
                    lambda x, w, config=config: fp8_dequantized_gemm(x, w[1], w[2], None, config=config))
        if 16 <= rows <= 128:
            for config in GEMM_SPLIT_SWEEP:
                row(f"fp8_gemm {tuple(vars(config).values())}",
                    lambda x, w, config=config: fp8_gemm(x, w[1], w[2], None, config=config))
        if rows >= 32:
            row(f"fp8_gemm gemm_config {tuple(vars(gemm_config(rows)).values())}",
                lambda x, w: fp8_gemm(x, w[1], w[2], None))
            for config in GEMM_SWEEP:
                row(f"fp8_gemm {tuple(vars(config).values())}",
                    lambda x, w, config=config: fp8_gemm(x, w[1], w[2], None, config=config))


def bench_quantize() -> None:
    say("## The activations' quantization: apart (the bf16 kernel, then quantize_rows) against in the kernel before "
        "the product (add_rms_norm_e4m3 before q/k/v and gate/up, silu_and_mul_e4m3 before down), microseconds")
    say("| rows | RMSNorm + quantize_rows | add_rms_norm_e4m3 | SiLU-and-mul + quantize_rows | silu_and_mul_e4m3 |")
    say("| --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(3)
    weight = torch.randn(HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=g)
    for rows in (17, 64, 256, 2048, 8192):
        x, residual = torch.randn(2, rows, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=g)
        gate_up = torch.randn(rows, 2 * INTER, device=DEVICE, dtype=torch.bfloat16, generator=g)
        cells = [cell("{:.1f}", lambda: 1e3 * graph_ms(lambda: quantize_rows(add_rms_norm(x, residual, weight,
                                                                                          1e-5)[0]))),
                 cell("{:.1f}", lambda: 1e3 * graph_ms(lambda: add_rms_norm_e4m3(x, residual, weight, 1e-5))),
                 cell("{:.1f}", lambda: 1e3 * graph_ms(lambda: quantize_rows(silu_and_mul(gate_up)))),
                 cell("{:.1f}", lambda: 1e3 * graph_ms(lambda: silu_and_mul_e4m3(gate_up)))]
        say(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(sections_main("bench.lab.gpu.fp8", "FP8 products", {"gemv": bench_gemv, "gemm": bench_gemm,
                                                                 "quantize": bench_quantize}))
