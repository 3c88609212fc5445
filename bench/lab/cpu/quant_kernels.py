"""µs per quantized product on the CPU: Flare's AVX2 kernel against PyTorch's int4 kernel and dense fp32.

    python -m bench.lab.cpu.quant_kernels [--threads 1] [--repeats 5]

docs/design.md, Models and kernels; docs/cpu.md, "Flare's kernels". SmolLM2-135M's shapes (M rows x K
inputs -> N outputs) with random 4-bit weights, weights hot in cache (the same product repeated), the median of
`--repeats` timings. Columns: `flare_cpu::quant_mm` alone; QuantLinear with Flare's kernel (what a quantized core
runs, the same kernel at every row count); `_weight_int4pack_mm_for_cpu` on a bfloat16
input (PyTorch's kernel alone); QuantLinear with PyTorch's kernel (with its bfloat16 conversions); dense fp32
`linear`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.kernels.cpu import extension
from engine.model import quant
from engine.model.quant import QuantLinear, dequantize, pack

SHAPES = ((1, 576, 1536), (1, 576, 192), (1, 1536, 576), (1, 576, 49152), (16, 576, 1536), (512, 576, 1536))


def timed(work: Callable[[], object], repeats: int, macs: int) -> float:
    """Median µs per call, each timing long enough (about 20 ms) to average out the clock."""
    calls = max(1, int(2e8 / macs))
    work()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            work()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if extension.quant_mm() is None:
        raise SystemExit("Flare's kernel does not run here")
    print(f"threads: {args.threads}, CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    print("| M x K -> N | flare quant_mm | QuantLinear (flare) | torch int4, bf16 in | QuantLinear (torch) | fp32 linear |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows, inputs, outputs in SHAPES:
        torch.manual_seed(0)
        codes = torch.randint(0, 16, (outputs, inputs), dtype=torch.int32)
        scale, minimum = torch.rand(outputs, inputs // 32) / 8, -torch.rand(outputs, inputs // 32)
        x, dense = torch.randn(rows, inputs), dequantize(codes, scale, minimum)
        packed = pack(codes, scale, minimum, 4)
        flare = QuantLinear(codes, 4, scale, minimum)
        original, quant.extension.quant_mm = quant.extension.quant_mm, lambda: None
        try:
            theirs = QuantLinear(codes, 4, scale, minimum)
        finally:
            quant.extension.quant_mm = original
        x16 = x.bfloat16()
        macs = rows * inputs * outputs
        with torch.inference_mode():
            cells = [timed(lambda: torch.ops.flare_cpu.quant_mm(x, *packed, 4), args.repeats, macs),
                     timed(lambda: flare(x), args.repeats, macs),
                     timed(lambda: quant._int4_mm(x16, theirs.packed, quant.GROUP, theirs.scales_and_zeros),
                           args.repeats, macs),
                     timed(lambda: theirs(x), args.repeats, macs),
                     timed(lambda: torch.nn.functional.linear(x, dense), args.repeats, macs)]
        print(f"| {rows} x {inputs} -> {outputs} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
