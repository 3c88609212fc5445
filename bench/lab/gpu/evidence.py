"""What the graph executor does on a GPU, printed as markdown tables: greedy tokens against the eager executor,
decode step times against batch, the engine loop's GPU busy fraction, sampling extras in graphs, prefill MFU.

    python -m bench.lab.gpu.evidence [--cores DIR] [--out FILE] [--only SECTION ...]

Sections: correctness, decode, smollm (the default three), extras (penalties and logprobs in the sampling graphs:
batch-64 decode steps with some rows asking), prefill (prefill steps of 1024-token prompts at 512 to 8192 tokens
a step, and their MFU) and dependent (batch-1 decode steps of the 8B, SmolLM2 and Qwen3-30B-A3B cut to 24 layers
with their kernels launched plainly and as dependent launches, and with the rotary and cache store inside decode
attention's kernel: GPU ms a step, and the same steps' greedy tokens against the plain launches').
docs/gpu.md has the current tables.

Cores are made here with `ignition synth` (random weights of the real architectures, bf16): SmolLM2-135M,
Llama-3.1-8B with 4 layers (correctness) and with all 32 (speed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from bench.lab.gpu.loop import engine_loop_busy
from bench.lab.gpu.steps import decode_plan, generate, prompt_row, replay, time_steps, weight_bytes
from engine.executor.eager import EagerExecutor
from engine.executor.graph import GraphExecutor
from engine.kernels.triton import dependent_launch
from engine.model.backends import few_rows, triton_layers
from engine.model.loader import load_model
from engine.scheduler.plan import Plan
from engine.scheduler.scheduler import RequestScheduler
from ignition.main import main as ignition

CORES = {"smollm2-135m": ("smollm2-135m", None), "llama-3.1-8b-4l": ("llama-3.1-8b", 4),
         "llama-3.1-8b": ("llama-3.1-8b", None), "qwen3-30b-a3b-24l": ("qwen3-30b-a3b", 24)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXT = 512  # tokens each decoding sequence attends over in the step-time sweep
H200_BF16_TFLOPS = 989.4  # NVIDIA's dense bf16 peak for the H200 SXM (the MFU's denominator)
PROMPT = 1024  # the 1024-token workload's prompts (bench.lab.gpu.serving row 8b-1024x768)
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def run_sections(sections: dict[str, Callable[[], None]], names: list[str], out: Path | None) -> None:
    """The named sections in turn (a broken one prints its traceback and must not hide the others' tables), the
    elapsed time, then every line printed so far into `out`."""
    started = time.monotonic()
    for name in names:
        try:
            sections[name]()
        except Exception:
            say(f"{name} failed:\n```\n{traceback.format_exc()}```")
        torch.cuda.empty_cache()
    say(f"({time.monotonic() - started:.0f} s)")
    if out:
        out.write_text("\n".join(LINES) + "\n")


def sections_main(script: str, title: str, sections: dict[str, Callable[[], None]]) -> int:
    """A kernel bench's command line: `--only SECTION` (repeatable; all by default) and `--out FILE`; each section's
    tables under `title`, a blank line after each."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--only", choices=list(sections), action="append")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return 2
    say(f"# {title} on {torch.cuda.get_device_name()}")
    run_sections({name: lambda run=run: (run(), say()) for name, run in sections.items()}, args.only or list(sections),
                 args.out)
    return 0


def core(cores: Path, name: str) -> Path:
    out = cores / name
    if not (out / "manifest.json").is_file():
        preset, layers = CORES[name]
        args = ["synth", "--preset", preset, "--dtype", "bfloat16", str(out)] + (["--layers", str(layers)]
                                                                                 if layers else [])
        if ignition(args) != 0:
            raise RuntimeError(f"ignition synth {name} failed")
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read plus bytes written per second, over 4 GiB."""
    src = torch.randn(1 << 31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * src.element_size() * 10 / (start.elapsed_time(end) / 1000)


def correctness(cores: Path) -> None:
    say("## Greedy tokens: graph executor vs eager executor (bf16, random weights, 32 new tokens each)")
    say("| model | prompts (lengths) | through the scheduler: equal requests | replayed plans: equal steps |")
    say("| --- | --- | --- | --- |")
    cases = {"aligned": [17, 200, 33, 90, 5, 60, 41, 66], "unaligned": [7, 100, 33, 250, 61]}
    for name in ("smollm2-135m", "llama-3.1-8b-4l"):
        manifest, model = load_model(core(cores, name), torch.device("cuda"), verify=False)
        caps = manifest.capacities
        for label, lengths in cases.items():
            generator = torch.Generator().manual_seed(len(lengths))
            prompts = [torch.randint(0, model.config.vocab_size - 8, (n,), generator=generator).tolist()
                       for n in lengths]
            outputs, plans = {}, {}
            for kind in ("eager", "graph"):
                executor = make(kind, model, 256, caps.page_size, 8, manifest.context_limit, caps.prefill_chunk_size)
                scheduler = RequestScheduler(8, 64, executor.num_pages, caps.page_size, caps.prefill_chunk_size)
                outputs[kind], plans[kind] = generate(executor, scheduler, prompts, 32)
                executor.close()
            equal = sum(a == b for a, b in zip(outputs["eager"], outputs["graph"]))
            steps = {}
            for kind in ("eager", "graph"):  # the eager run's exact steps, through both executors
                executor = make(kind, model, 256, caps.page_size, 8, manifest.context_limit, caps.prefill_chunk_size)
                steps[kind] = replay(executor, plans["eager"])
                executor.close()
            same = sum(a == b for a, b in zip(steps["eager"], steps["graph"]))
            say(f"| {name} | {label} ({', '.join(map(str, lengths))}) | {equal}/{len(lengths)} | "
                f"{same}/{len(steps['eager'])} |")
        del model
        torch.cuda.empty_cache()


def make(kind: str, model, num_pages: int, page_size: int, max_active: int, context_limit: int, chunk: int):
    if kind == "eager":
        return EagerExecutor(model, num_pages, page_size, max_active, torch.device("cuda"))
    return GraphExecutor(model, num_pages, page_size, max_active, torch.device("cuda"), context_limit, chunk)


def step_times(model, manifest, batches: list[int], steps: int) -> dict[str, dict[int, tuple[float, float]]]:
    """(wall ms per step, GPU ms per step) for each executor and batch; eager has no GPU figure (nan)."""
    caps = manifest.capacities
    pages = max(batches) * -(-CONTEXT // caps.page_size)
    results: dict[str, dict[int, tuple[float, float]]] = {}
    for kind in ("graph", "eager"):
        executor = make(kind, model, pages, caps.page_size, max(batches), manifest.context_limit,
                        caps.prefill_chunk_size)
        executor.kv_cache.normal_()  # attention over random keys, not zeros
        results[kind] = {}
        for batch in batches:
            plan = decode_plan(batch, CONTEXT, caps.page_size)
            wall = time_steps(executor, plan, steps)
            gpu = float("nan")
            if kind == "graph":
                gpu = statistics.median(end - start for start, end, _, _ in list(executor.spans)[-steps:])
            results[kind][batch] = (wall * 1000, gpu)
        if kind == "graph":
            results["capture"] = {0: (executor.capture_seconds, executor.graph_count)}
        executor.close()
        torch.cuda.empty_cache()
    return results


def decode_sweep(cores: Path, bandwidth: float) -> None:
    manifest, model = load_model(core(cores, "llama-3.1-8b"), torch.device("cuda"), verify=False)
    times = step_times(model, manifest, BATCHES, steps=30)
    seconds, graphs = times["capture"][0]
    say(f"## Llama-3.1-8B architecture, bf16: decode step time vs batch (context {CONTEXT} tokens per sequence; "
        f"{graphs} graphs captured in {seconds:.1f} s)")
    say("| batch | eager ms/step | graph ms/step (wall) | graph ms/step (GPU) | speedup | tokens/s (graph) |")
    say("| --- | --- | --- | --- | --- | --- |")
    for batch in BATCHES:
        eager, _ = times["eager"][batch]
        wall, gpu = times["graph"][batch]
        say(f"| {batch} | {eager:.2f} | {wall:.2f} | {gpu:.2f} | {eager / wall:.2f}x | {batch / wall * 1000:.0f} |")
    weights = weight_bytes(model)
    wall, gpu = times["graph"][1]
    say(f"\nBatch 1: {weights / 1e9:.2f} GB of weights per step; D2D copy bandwidth {bandwidth / 1e12:.2f} TB/s "
        f"(read + write). Graph step {gpu:.3f} ms on the GPU -> {weights / gpu / 1e9:.2f} TB/s = "
        f"{weights / (gpu / 1000) / bandwidth:.1%} of copy bandwidth ({weights / (wall / 1000) / bandwidth:.1%} "
        f"by wall time). Target: 85%.")
    say()
    busy, per_step, steps = engine_loop_busy(model, manifest, graph_for_loop(model, manifest, 64), 64, 64, 128, 320)
    say(f"## Steady decode at batch 64 through the engine loop (Llama-3.1-8B architecture, bf16)")
    say(f"GPU busy {busy:.2%} of wall time over {steps} consecutive batch-64 decode steps ({per_step:.2f} ms per step). "
        "Target: 97%.")
    say()


def graph_for_loop(model, manifest, max_active: int) -> GraphExecutor:
    caps = manifest.capacities
    pages = max_active * -(-(128 + 320 + 64) // caps.page_size) + 16
    return GraphExecutor(model, pages, caps.page_size, max_active, torch.device("cuda"), manifest.context_limit,
                         caps.prefill_chunk_size)


def smollm(cores: Path) -> None:
    manifest, model = load_model(core(cores, "smollm2-135m"), torch.device("cuda"), verify=False)
    times = step_times(model, manifest, [1, 64], steps=200)
    say("## SmolLM2-135M architecture, bf16: graph replay vs eager (launch-bound)")
    say("| batch | eager ms/step | graph ms/step (wall) | graph ms/step (GPU) | speedup |")
    say("| --- | --- | --- | --- | --- |")
    for batch in (1, 64):
        eager, _ = times["eager"][batch]
        wall, gpu = times["graph"][batch]
        say(f"| {batch} | {eager:.3f} | {wall:.3f} | {gpu:.3f} | {eager / wall:.1f}x |")
    say()
    for batch in (64, 256):  # the host's work per step must hide behind the device's at both
        busy, per_step, steps = engine_loop_busy(model, manifest, graph_for_loop(model, manifest, batch), batch,
                                                 batch, 128, 320)
        say(f"Engine loop at batch {batch}: GPU busy {busy:.2%} over {steps} decode steps ({per_step:.3f} ms per "
            "step). Target: 97%.")
    say()


def dependent(cores: Path, bandwidth: float) -> None:
    say(f"## Batch-1 decode steps, the kernels launched plainly and as dependent launches (graphs; context "
        f"{CONTEXT})")
    say("| model | launch | GPU ms a step | of copy bandwidth on the weights | tokens as plain |")
    say("| --- | --- | --- | --- | --- |")
    defaults = (few_rows.LAUNCH, triton_layers.ROTARY_IN_DECODE)
    prefetch, early = dependent_launch.PREFETCH, dependent_launch.PREFETCH_EARLY
    # (label, launch, rotary and cache store inside the decode kernel)
    variants = (("plain", dependent_launch.NONE, False), ("first weight slice before the wait", prefetch, False),
                ("the same, the next kernel released early", early, False),
                ("first slice before the wait, rotary in the decode kernel", prefetch, True),
                ("released early, rotary in the decode kernel", early, True))
    for name in ("llama-3.1-8b", "smollm2-135m", "qwen3-30b-a3b-24l"):
        manifest, model = load_model(core(cores, name), torch.device("cuda"), verify=False)
        caps, weights, plain = manifest.capacities, weight_bytes(model), None
        plan = decode_plan(1, CONTEXT, caps.page_size)
        for label, launch, rotary in variants:
            few_rows.LAUNCH = launch  # read when the graphs are captured, as the rotary's place is
            triton_layers.ROTARY_IN_DECODE = rotary
            try:
                executor = make("graph", model, -(-CONTEXT // caps.page_size), caps.page_size, 1,
                                manifest.context_limit, caps.prefill_chunk_size)
                torch.manual_seed(0)
                executor.kv_cache.normal_()
                time_steps(executor, plan, 200)
                gpu = statistics.median(end - start for start, end, _, _ in list(executor.spans)[-200:])
                tokens = replay(executor, [plan] * 8)
                plain = plain or tokens
                say(f"| {name} | {label} | {gpu:.3f} | {weights / (gpu / 1000) / bandwidth:.1%} | "
                    f"{'same' if tokens == plain else 'DIFFERENT'} |")
                executor.close()
            except Exception as error:  # a launch this GPU or Triton refuses is a row, not the end of the run
                say(f"| {name} | {label} | {type(error).__name__}: {str(error)[:100]} | | |")
            torch.cuda.empty_cache()
        few_rows.LAUNCH, triton_layers.ROTARY_IN_DECODE = defaults
        del model
        torch.cuda.empty_cache()
    say()


def extras(cores: Path) -> None:
    """Batch-64 decode steps (8B, context 512) where every 10th row asks for logprobs or a penalty, in the extras
    graphs and, as before, through the eager step, against the same batch without."""
    manifest, model = load_model(core(cores, "llama-3.1-8b"), torch.device("cuda"), verify=False)
    executor = graph_for_loop(model, manifest, 64)
    executor.kv_cache.normal_()
    plain = decode_plan(64, CONTEXT, manifest.capacities.page_size)

    def asking(every: int, **sampling: object) -> Plan:
        return Plan(tuple(row._replace(sampling=msgspec.structs.replace(row.sampling, **sampling))
                          if row.slot % every == 0 else row for row in plain.rows))

    plans = {"none": plain, "logprobs=5, every 10th row": asking(10, logprobs=5),
             "repetition_penalty=1.1, every 10th row": asking(10, repetition_penalty=1.1),
             "logprobs=20 and presence_penalty=0.5, every row": asking(1, logprobs=20, presence_penalty=0.5)}
    say(f"## Sampling extras in graphs: batch-64 decode steps, Llama-3.1-8B architecture, bf16 ({executor.graph_count} "
        "graphs). Target: >= 90% of the plain batch's throughput")
    say("| rows asking | graph ms/step (wall) | graph ms/step (GPU) | throughput vs none | eager step ms/step "
        "(before) |")
    say("| --- | --- | --- | --- | --- |")
    base = 0.0
    layout_for = executor._layout_for
    for name, plan in plans.items():
        executor._layout_for = layout_for
        wall = time_steps(executor, plan, 100)
        gpu = statistics.median(end - start for start, end, _, _ in list(executor.spans)[-100:])
        base = base or wall
        executor._layout_for = lambda _: None  # every step through EagerExecutor's: how such steps ran before the extras graphs
        eager = time_steps(executor, plan, 20) if plan is not plain else float("nan")
        say(f"| {name} | {wall * 1000:.3f} | {gpu:.3f} | {base / wall:.1%} | {eager * 1000:.3f} |")
    executor.close()
    say()


def prefill_plan(tokens: int, page_size: int) -> Plan:
    """A prefill step of `tokens` prompt tokens: whole 1024-token prompts from position 0 (each sampling its first
    token), or the first `tokens` of one prompt."""
    pages = -(-PROMPT // page_size)
    return Plan(tuple(prompt_row(slot, min(tokens, PROMPT), 0, page_size, pages)
                      for slot in range(max(tokens // PROMPT, 1))))


def prefill_flops(model, plan: Plan) -> float:
    """Two flops a multiply-add: a dense decoder layer's projections once per token (from the config: the model's
    parameters also hold the kernel path's fused views of them), the LM head once per sampling row, and causal
    attention's QK^T and PV."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token = c.num_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)
    tokens = sum(row.length for row in plan.rows)
    attention = sum(4 * q * (row.length * row.start + row.length * (row.length + 1) / 2) for row in plan.rows)
    return 2 * per_token * tokens + 2 * c.hidden_size * c.vocab_size * len(plan.rows) + attention * c.num_layers


def prefill(cores: Path) -> None:
    """Prefill steps of the 8B in graphs at the token budgets the engine runs (512 tokens up to 8,192, an H200's
    default step budget: engine/executor/factory.py)."""
    manifest, model = load_model(core(cores, "llama-3.1-8b"), torch.device("cuda"), verify=False)
    page_size = manifest.capacities.page_size
    executor = GraphExecutor(model, 8 * -(-PROMPT // page_size) + 16, page_size, 16, torch.device("cuda"),
                             manifest.context_limit, 8192)
    gemm_a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    gemm_b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        gemm_a @ gemm_b
    start.record()
    for _ in range(20):
        gemm_a @ gemm_b
    end.record()
    end.synchronize()
    gemm = 2 * 8192 * 4096 * 14336 * 20 / (start.elapsed_time(end) / 1000) / 1e12
    say(f"## Prefill steps of {PROMPT}-token prompts, Llama-3.1-8B architecture, bf16, graphs "
        f"({executor.graph_count} graphs). MFU against {H200_BF16_TFLOPS} TFLOP/s (NVIDIA's dense bf16 peak); "
        f"a [8192,4096]x[4096,14336] GEMM here: {gemm:.0f} TFLOP/s. Target: MFU >= 60%")
    say("| tokens a step | prompts | GPU ms/step | prompt tok/s | TFLOP/s | MFU | share of the GEMM's |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    for tokens in (512, 1024, 2048, 4096, 8192):
        plan = prefill_plan(tokens, page_size)
        time_steps(executor, plan, 10)
        ms = statistics.median(end - start for start, end, _, _ in list(executor.spans)[-10:])
        tflops = prefill_flops(model, plan) / (ms / 1000) / 1e12
        say(f"| {tokens} | {len(plan.rows)} | {ms:.2f} | {tokens / ms * 1000:,.0f} | {tflops:.0f} | "
            f"{tflops / H200_BF16_TFLOPS:.1%} | {tflops / gemm:.1%} |")
    executor.close()
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cores", type=Path, default=Path("cores"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*", default=["correctness", "decode", "smollm"])
    args = parser.parse_args()
    say(f"# GPU evidence: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bandwidth = copy_bandwidth()
    say(f"Device-to-device copy: {bandwidth / 1e12:.2f} TB/s (bytes read + written)\n")
    sections = {"correctness": lambda: correctness(args.cores), "decode": lambda: decode_sweep(args.cores, bandwidth),
                "smollm": lambda: smollm(args.cores), "extras": lambda: extras(args.cores),
                "prefill": lambda: prefill(args.cores), "dependent": lambda: dependent(args.cores, bandwidth)}
    run_sections(sections, args.only, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
