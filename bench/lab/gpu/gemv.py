"""Projections of a few rows (the batch-1 decode step), printed as markdown tables:

    python -m bench.lab.gpu.gemv [--out FILE] [--only sweep|layer|chain]

- sweep: each Llama-3.1-8B projection (q/k/v, o, gate/up, down; random bf16 weights) at 1 and 2 rows through
  engine/kernels/triton/gemv.py's kernel under each block configuration, against cuBLAS (F.linear): graph milliseconds and
  the bandwidth on the weight (the bytes a step must read; activations are noise beside them).
- layer: a decoder layer's projections with what sits between them, at 1 row: the unfused chain the
  kernel path ran before (add+RMSNorm, q/k/v, o, add+RMSNorm, gate/up, SiLU-and-mul, down: cuBLAS and Triton) against
  the four fused gemv calls (RMSNorm prologues, residual epilogues, SiLU-and-mul prologue), attention left out.
- chain: those four calls for each of CHAIN_LAYERS layers of their own weights (more than the L2 cache holds), one
  graph, bf16 and FP8 (a scale per output row) weights, each kernel launched plainly and as a dependent launch
  (engine/kernels/triton/dependent_launch.py: waiting first, or after its first weight slice): ms a layer, TB/s on
  the weights, and how far the residual stream ends from the plain launches' (nothing but the launch differs, so 0).

Timing is bench.lab.gpu.kernels.graph_ms: CUDA events around 20 calls replayed from one captured graph.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from bench.lab.gpu.evidence import say, sections_main
from bench.lab.gpu.kernels import graph_ms, max_diff
from engine.kernels.triton.activation import silu_and_mul
from engine.kernels.triton.dependent_launch import NONE, PREFETCH, PREFETCH_EARLY, WAIT_FIRST
from engine.kernels.triton.gemv import GemvConfig, gemv, gemv_reference
from engine.kernels.triton.rmsnorm import add_rms_norm

DEVICE = "cuda"
HIDDEN, INTER, QKV = 4096, 14336, 6144
PROJECTIONS = {"q/k/v": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate/up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
CHAIN_LAYERS = 16
SWEEP = [GemvConfig(*c) for c in [(4, 512, 2, 3), (8, 1024, 4, 3), (16, 512, 4, 3),
                                  (8, 256, 2, 3), (4, 512, 4, 3), (8, 512, 8, 3)]]


def random(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=g) * scale


def bench_sweep() -> None:
    say("## gemv block configurations (BLOCK_N, BLOCK_K, warps, stages): graph ms and TB/s on the weight")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    weights = {name: random(n, k, g=g, scale=k**-0.5) for name, (n, k) in PROJECTIONS.items()}
    for rows in (1, 2):
        inputs = {name: random(rows, k, g=g) for name, (_, k) in PROJECTIONS.items()}
        say(f"### {rows} row(s)")
        say("| config | " + " | ".join(PROJECTIONS) + " |")
        say("| --- |" + " --- |" * len(PROJECTIONS))

        def row(label: str, call) -> None:
            cells = []
            for name, w in weights.items():
                try:
                    ms = graph_ms(lambda: call(inputs[name], w))
                    bad = max_diff(call(inputs[name], w), gemv_reference(inputs[name], w)) > 0.05
                    cells.append(f"{ms * 1e3:.1f} us {w.numel() * 2 / ms / 1e9:.2f}" + (" WRONG" if bad else ""))
                except Exception as error:  # a configuration that does not compile is a cell, not the end of the run
                    cells.append(type(error).__name__)
            say(f"| {label} | " + " | ".join(cells) + " |")
        row("cuBLAS (F.linear)", lambda x, w: F.linear(x, w))
        row("DEFAULT_CONFIG (the model's)", lambda x, w: gemv(x, w))
        for config in SWEEP:
            row(str(tuple(vars(config).values())), lambda x, w, config=config: gemv(x, w, config=config))


def bench_layer() -> None:
    say("## A layer's projections and what sits between them (no attention): graph ms a layer, TB/s on its weights")
    say("| rows | unfused (cuBLAS + Triton norm/SiLU) | TB/s | fused gemv | TB/s | max abs diff of the residual |")
    say("| --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(2)
    w = {name: random(n, k, g=g, scale=k**-0.5) for name, (n, k) in PROJECTIONS.items()}
    norms = [1 + 0.1 * random(HIDDEN, g=g) for _ in range(2)]
    layer_bytes = sum(t.numel() * 2 for t in w.values())
    for rows in (1,):
        stream, attn = random(rows, HIDDEN, g=g), random(rows, HIDDEN, g=g)

        def unfused() -> torch.Tensor:
            h, residual = add_rms_norm(stream, None, norms[0], 1e-5)
            F.linear(h, w["q/k/v"])  # the attention that reads q/k/v is left out: `attn` stands for its output
            h, residual = add_rms_norm(F.linear(attn, w["o"]), residual, norms[1], 1e-5)
            return F.linear(silu_and_mul(F.linear(h, w["gate/up"])), w["down"]) + residual

        def fused() -> torch.Tensor:
            residual = stream.clone()
            gemv(residual, w["q/k/v"], norm=(norms[0], 1e-5))
            gemv(attn, w["o"], residual=residual)
            gate_up = gemv(residual, w["gate/up"], norm=(norms[1], 1e-5))
            return gemv(gate_up, w["down"], silu_mul=True, residual=residual)
        before, after = graph_ms(unfused), graph_ms(fused)
        say(f"| {rows} | {before:.4f} | {layer_bytes / before / 1e9:.2f} | {after:.4f} | "
            f"{layer_bytes / after / 1e9:.2f} | {max_diff(fused(), unfused()):.4f} |")


def bench_chain() -> None:
    say(f"## {CHAIN_LAYERS} layers' fused projections at 1 row, launched plainly and as dependent launches: graph ms "
        "a layer, TB/s on the weights")
    say("| weights | launch | ms a layer | TB/s | max abs diff from plain |")
    say("| --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(3)
    for fp8 in (False, True):
        layers = []
        for _ in range(CHAIN_LAYERS):
            weights = {}
            for name, (n, k) in PROJECTIONS.items():
                w = random(n, k, g=g, scale=k**-0.5)
                if fp8:
                    scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
                    weights[name] = {"weight": (w.float() / scale).to(torch.float8_e4m3fn), "scale": scale}
                else:
                    weights[name] = {"weight": w}
            layers.append((weights, [1 + 0.1 * random(HIDDEN, g=g) for _ in range(2)]))
        layer_bytes = sum(w["weight"].numel() * w["weight"].element_size() for w in layers[0][0].values())
        stream, attn = random(1, HIDDEN, g=g), random(1, HIDDEN, g=g)
        residual = torch.empty_like(stream)

        def chain(dependent: int) -> torch.Tensor:
            residual.copy_(stream)
            for w, norms in layers:
                gemv(residual, **w["q/k/v"], norm=(norms[0], 1e-5), dependent=dependent)
                gemv(attn, **w["o"], residual=residual, dependent=dependent)
                gate_up = gemv(residual, **w["gate/up"], norm=(norms[1], 1e-5), dependent=dependent)
                gemv(gate_up, **w["down"], silu_mul=True, residual=residual, dependent=dependent)
            return residual

        plain = chain(NONE).clone()
        for label, dependent in (("plain", NONE), ("dependent, waiting first", WAIT_FIRST),
                                 ("dependent, first weight slice before the wait", PREFETCH),
                                 ("the same, the next kernel released early", PREFETCH_EARLY)):
            try:
                ms = graph_ms(lambda: chain(dependent), replays=2) / CHAIN_LAYERS
                diff = max_diff(chain(dependent), plain)
                say(f"| {'fp8' if fp8 else 'bf16'} | {label} | {ms:.4f} | {layer_bytes / ms / 1e9:.2f} | {diff:.4f} |")
            except Exception as error:  # a launch the GPU or this Triton refuses is a row, not the end of the run
                say(f"| {'fp8' if fp8 else 'bf16'} | {label} | {type(error).__name__}: {str(error)[:80]} | | |")


if __name__ == "__main__":
    sys.exit(sections_main("bench.lab.gpu.gemv", "Projections of a few rows", {"sweep": bench_sweep,
                                                                              "layer": bench_layer,
                                                                              "chain": bench_chain}))
