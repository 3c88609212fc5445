"""The model families on a GPU, printed as tables: graph against eager tokens, MoE decode steps, cuBLAS padding.

    python -m bench.lab.gpu.families [--out FILE] [--only tokens moe gemm] [--dtype float32]

Models have the shapes of `ignition synth` presets (engine/model/config.py reads the preset's config as it would an
exported core's) and random bf16 weights made on the GPU, so nothing large travels or touches the disk:
- tokens: for each family, greedy tokens of the graph executor equal the eager executor's, through the scheduler and
  replaying the same steps (Gemma 3 with prompts longer than its 1024-token window, so its sliding layers slide).
- moe: the Qwen3-30B-A3B architecture (all 48 layers unless --moe-layers): decode step time at batch 1 to 256, eager
  and graph, and at batch 1 the bytes a step must read (attention, router, the 8 active experts of each layer, the LM
  head, the KV cache) as a share of the device's copy bandwidth.
- gemm: whether a cuBLAS product's rows depend on how many rows it has. A graph runs a step padded to its capacity
  (engine/executor/graph.py), the eager executor at the step's own size, so where cuBLAS picks another algorithm for
  the padded size the two differ in the last bits, which is why `tokens` can differ in bfloat16 without a fault in
  either executor.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import sys
from pathlib import Path

import torch

from bench.lab.gpu.evidence import BATCHES, CONTEXT, copy_bandwidth, make, run_sections, say, step_times
from bench.lab.gpu.steps import generate, replay
from common.manifest import Capacities, Manifest
from engine.executor.graph import decode_capacities, extend_capacities
from engine.model.backends.select import use_backend
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
from engine.scheduler.scheduler import RequestScheduler
from ignition.families import normalised_config
from ignition.synth import SynthSource

# Preset, decoder layers kept for the token comparison (Gemma 3: six, so that one is global).
FAMILIES = {"llama-3.1-8b": 2, "qwen2.5-7b": 2, "qwen3-8b": 2, "qwen3-30b-a3b": 2, "mixtral-8x7b": 2, "gemma-3-12b": 6}
PROMPT_LENGTHS = [17, 200, 1500, 33, 5, 1100, 60, 41]  # two past Gemma 3's 1024-token window
CAPACITIES = Capacities()
# The token comparison's cases: (preset, layers, prompt lengths, prompt tokens per step, slots). Every family at the
# default chunk, and Qwen3-30B-A3B's experts at a server's whole step budget (gpu_step_tokens: 8,192 prompt tokens,
# 65,536 token-expert pairs a step, padded to the graph's capacity).
CASES = [(preset, layers, PROMPT_LENGTHS, CAPACITIES.prefill_chunk_size, 8) for preset, layers in FAMILIES.items()]
CASES.append(("qwen3-30b-a3b", 2, [500 + 3 * i for i in range(16)], 8192, 16))
CONTEXT_LIMIT = 8192


def preset_model(preset: str, layers: int | None, dtype: str = "bfloat16",
                 context_limit: int = CONTEXT_LIMIT) -> tuple[Manifest, CausalLM]:
    """The preset's architecture with random weights made on the GPU, on the kernel path, its positions up to
    `context_limit`."""
    source = SynthSource(preset, layers, dtype, 0)
    family, config = normalised_config(source.config(), source.path, dtype, source.checkpoint)
    c = DecoderConfig.from_hf(family, config)
    device = torch.device("cuda")
    with torch.device("meta"):
        model = CausalLM(c)
    state = {}
    for name, meta in model.state_dict().items():
        generator = torch.Generator(device=device).manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:7],
                                                                              "little"))
        if name.endswith("norm.weight"):  # a scale near one (Gemma stores w for 1 + w)
            base = 0.0 if c.gemma_norms else 1.0
            weight = base + 0.1 * torch.randn(meta.shape, generator=generator, device=device)
        else:
            weight = torch.randn(meta.shape, generator=generator, device=device) * meta.shape[-1] ** -0.5
        state[name] = weight.to(getattr(torch, dtype))  # at once: the float32 draws of 48 MoE layers would not fit
    model.load_state_dict(state, strict=False, assign=True)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.set_rope(device)
    use_backend(model, "triton", context_limit)
    manifest = Manifest(1, family, config, dtype, [preset], source.checkpoint, context_limit, [], CAPACITIES,
                        source.generation, {})
    return manifest, model.eval()


def tokens(dtype: str) -> None:
    say(f"## Greedy tokens: graph executor vs eager executor per family ({dtype}, random weights, 32 new tokens each)")
    say("| preset (layers) | prompts (lengths) | tokens per step | through the scheduler: equal requests "
        "| replayed plans: equal steps | eager replayed twice: equal steps |")
    say("| --- | --- | --- | --- | --- | --- |")
    page_size = CAPACITIES.page_size
    for preset, layers, lengths, chunk, slots in CASES:
        _, model = preset_model(preset, layers, dtype)
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.config.vocab_size - 8, (n,), generator=generator).tolist() for n in lengths]
        outputs, plans, steps = {}, {}, {}
        for kind in ("eager", "graph"):
            executor = make(kind, model, 512, page_size, slots, CONTEXT_LIMIT, chunk)
            scheduler = RequestScheduler(slots, 64, executor.num_pages, page_size, chunk)
            outputs[kind], plans[kind] = generate(executor, scheduler, prompts, 32)
            executor.close()
        # The eager run's exact steps, through both executors, and through eager again (the kernels' own
        # run-to-run determinism, which bounds what graph-vs-eager can show).
        for run, kind in (("eager", "eager"), ("graph", "graph"), ("again", "eager")):
            executor = make(kind, model, 512, page_size, slots, CONTEXT_LIMIT, chunk)
            steps[run] = replay(executor, plans["eager"])
            executor.close()
        equal = sum(a == b for a, b in zip(outputs["eager"], outputs["graph"]))
        same = sum(a == b for a, b in zip(steps["eager"], steps["graph"]))
        again = sum(a == b for a, b in zip(steps["eager"], steps["again"]))
        largest = max(sum(row.length for row in plan.rows) for plan in plans["eager"])
        shown = ", ".join(map(str, lengths)) if len(lengths) <= 8 else f"{len(lengths)} of {min(lengths)}-{max(lengths)}"
        say(f"| {preset} ({layers}) | {shown} | up to {largest} | {equal}/{len(prompts)} | "
            f"{same}/{len(steps['eager'])} | {again}/{len(steps['eager'])} |")
        del model
        torch.cuda.empty_cache()
    say()


def bytes_per_decode_step(c: DecoderConfig, context: int, itemsize: int = 2, batch: int = 1) -> dict[str, float]:
    """What a decode step of `batch` sequences must read, by part: the weights it multiplies by and the KV cache it
    attends over (the embedding rows and the norms are negligible and left out). A mixture of experts reads each
    expert some token of the batch routes to: E * (1 - (1 - k / E) ** batch) of them expected where the router
    spreads tokens evenly over the E experts, as random weights' routers do."""
    hidden, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    parts = {"attention": 0.0, "router": 0.0, "active experts": 0.0, "dense MLP": 0.0}
    for layer in range(c.num_layers):
        parts["attention"] += (hidden * (q + 2 * kv) + q * hidden) * itemsize
        if c.is_moe(layer):
            experts = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
            parts["router"] += c.num_experts * hidden * itemsize
            parts["active experts"] += experts * 3 * c.moe_intermediate_size * hidden * itemsize
        else:
            parts["dense MLP"] += 3 * c.intermediate_size * hidden * itemsize
    parts["LM head"] = c.vocab_size * hidden * itemsize
    parts["KV cache"] = batch * c.num_layers * 2 * context * kv * itemsize
    return {name: size for name, size in parts.items() if size}


def moe(bandwidth: float, layers: int | None) -> None:
    manifest, model = preset_model("qwen3-30b-a3b", layers)
    c = model.config
    times = step_times(model, manifest, BATCHES, steps=30)
    seconds, graphs = times["capture"][0]
    say(f"## Qwen3-30B-A3B architecture ({c.num_layers} layers, {c.num_experts} experts, top {c.num_experts_per_tok}), "
        f"bf16: decode step time vs batch (context {CONTEXT} tokens per sequence; {graphs} graphs captured in "
        f"{seconds:.1f} s)")
    say("| batch | eager ms/step | graph ms/step (wall) | graph ms/step (GPU) | speedup | tokens/s (graph) | "
        "bytes a step reads (GB) | at copy bandwidth ms | share of copy bandwidth |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in BATCHES:
        eager, _ = times["eager"][batch]
        wall, gpu = times["graph"][batch]
        read = sum(bytes_per_decode_step(c, CONTEXT, batch=batch).values())
        say(f"| {batch} | {eager:.2f} | {wall:.2f} | {gpu:.2f} | {eager / wall:.2f}x | {batch / wall * 1000:.0f} | "
            f"{read / 1e9:.2f} | {read / bandwidth * 1000:.2f} | {read / (gpu / 1000) / bandwidth:.1%} |")
    parts = bytes_per_decode_step(c, CONTEXT)
    total = sum(parts.values())
    wall, gpu = times["graph"][1]
    say("\nBytes a batch-1 decode step reads:")
    say("| part | MB |")
    say("| --- | --- |")
    for name, size in parts.items():
        say(f"| {name} | {size / 1e6:.1f} |")
    say(f"| total | {total / 1e6:.1f} |")
    say(f"\nGraph step at batch 1: {gpu:.3f} ms on the GPU -> {total / gpu / 1e9:.2f} TB/s = "
        f"{total / (gpu / 1000) / bandwidth:.1%} of copy bandwidth ({bandwidth / 1e12:.2f} TB/s read + write); "
        f"{total / (wall / 1000) / bandwidth:.1%} by wall time. Target: 70%.")
    say()


GEMM_SHAPES = {"llama-3.1-8b qkv": (4096, 6144), "llama-3.1-8b o": (4096, 4096), "llama-3.1-8b gate_up": (4096, 28672),
               "llama-3.1-8b down": (14336, 4096), "llama-3.1-8b lm_head": (4096, 128256),
               "qwen3-8b gate_up": (4096, 24576), "qwen3-8b down": (12288, 4096),
               "qwen3-30b-a3b qkv": (2048, 5120), "qwen3-30b-a3b o": (4096, 2048)}
GEMM_ROWS = (1, 3, 17, 33, 60, 200, 250, 300, 500, 520)  # a step holds at most a chunk + a row per slot


def gemm_invariance(dtype: str) -> None:
    """Rows of F.linear(x[:m]) that differ bitwise from the same rows of F.linear(x) padded to a graph capacity."""
    caps = extend_capacities(CAPACITIES.prefill_chunk_size, 8)
    torch.manual_seed(0)
    say(f"## cuBLAS rows against padding ({dtype}): rows of m that differ when the product has the capacity's rows")
    say("| weight (in, out) | " + " | ".join(f"{m} in {padded(m, caps)}" for m in GEMM_ROWS) + " |")
    say("| --- |" + " --- |" * len(GEMM_ROWS))
    for name, (k, n) in GEMM_SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=getattr(torch, dtype)) * k ** -0.5
        cells = []
        for m in GEMM_ROWS:
            x = torch.randn(padded(m, caps), k, device="cuda", dtype=weight.dtype)
            differ = (torch.nn.functional.linear(x, weight)[:m] != torch.nn.functional.linear(x[:m], weight))
            cells.append(str(int(differ.any(dim=1).sum())))
        say(f"| {name} ({k}, {n}) | " + " | ".join(cells) + " |")
    say()


def padded(m: int, caps: list[int]) -> int:
    """The rows a graph step of m tokens runs: the smallest decode capacity for m <= 8, else the extend one."""
    return decode_capacities(8)[bisect.bisect_left(decode_capacities(8), m)] if m <= 8 else \
        caps[bisect.bisect_left(caps, m)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*", default=["tokens", "moe"], choices=("tokens", "moe", "gemm"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weights of the token comparison (float32: GEMM algorithms that differ with a step's "
                             "padded size no longer flip near-tied tokens)")
    parser.add_argument("--moe-layers", type=int, help="decoder layers of the Qwen3-30B-A3B sweep (default: 48)")
    args = parser.parse_args()
    say(f"# GPU evidence, model families: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bandwidth = copy_bandwidth()
    say(f"Device-to-device copy: {bandwidth / 1e12:.2f} TB/s (bytes read + written)\n")
    sections = {"tokens": lambda: tokens(args.dtype), "moe": lambda: moe(bandwidth, args.moe_layers),
                "gemm": lambda: gemm_invariance(args.dtype)}
    run_sections(sections, args.only, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
