"""Decode ms per step on the CPU, split into weight matmuls, attention and the rest (a torch.profiler profile).

    python -m bench.lab.cpu.decode_profile CORE [CORE ...] [--batch 1] [--context 128] [--steps 32] [--threads N] [--split]

Each core is loaded as the engine loads it (a quantized core keeps its int4 groups), `--batch` sequences get a
prompt of `--context` tokens in one prefill step (timed: the prefill ms), then `--steps` greedy decode steps run
and are timed (wall and CPU time: on a shared machine, CPU time with one thread is the steadier figure), then
profiled. Operators/step: aten operators called from Python per step. Shares of the profiled step: matmuls, the
self time of the matrix-product operators (dense and int4) outside attention; attention: everything under
PagedAttention (cache writes, page gathers, SDPA); rest: the remainder of the step (embedding, norms, rotary,
activations, logits' argmax, Python); C++ layers: a quantized core's decode layers run whole as
flare_cpu::decoder_layer calls (engine/kernels/cpu/decoder_layer.cpp), whose products and attention are theirs, not
the other columns' (`--split` calls the same ops one by one from Python instead, so that the columns see them).
The engine's own loop and the HTTP stack are not in these figures; `flare-bench` measures those.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.executor.eager import kv_cache_shape
from engine.model.attention import AttentionMetadata, PagedAttention, PrefillSpan
from engine.model.backends import cpu_ops
from engine.model.loader import load_model
from engine.threads import set_threads

MATMULS = ("aten::_weight_int4pack_mm_for_cpu", "flare_cpu::quant_mm", "flare_cpu::dequantize", "aten::mm", "aten::addmm",
           "aten::bmm")
LAYERS = "flare_cpu::decoder_layer"
PAGE = 64


def metadata(batch: int, context: int, new: int, pages_per_seq: int) -> AttentionMetadata:
    """`batch` sequences with `new` tokens each ending at `context`; sequence i owns a contiguous run of pages."""
    tables = torch.arange(batch * pages_per_seq).view(batch, pages_per_seq)
    slots = torch.cat([tables[i, 0] * PAGE + torch.arange(context - new, context) for i in range(batch)])
    if new == 1:
        return AttentionMetadata(slots, torch.arange(batch), tables, torch.full((batch,), context), (), PAGE)
    spans = tuple(PrefillSpan(i * new, new, context, tables[i]) for i in range(batch))
    return AttentionMetadata(slots, torch.empty(0, dtype=torch.int64), tables[:0], torch.empty(0, dtype=torch.int64),
                             spans, PAGE)


def run(core: Path, batch: int, context: int, steps: int, split: bool = False) -> dict[str, float]:
    _, model = load_model(core, torch.device("cpu"), verify=False)
    forward: Callable[..., torch.Tensor] = model
    if split and isinstance(model.backend, cpu_ops.CpuOps):
        # each layer's C++ ops called one by one from Python, so that the profile sees each
        layer_loop = replace(model.backend, whole_layers=(None,) * len(model.model.layers))
        forward = lambda *inputs: layer_loop.forward(model, *inputs, None)  # noqa: E731
    pages = (context + steps + PAGE) // PAGE + 1
    kv = torch.zeros(kv_cache_shape(model, batch * pages, PAGE))
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch * context,))
    with torch.inference_mode():
        started, cpu = time.perf_counter(), time.process_time()
        hidden = forward(prompt, torch.arange(context).repeat(batch), kv, metadata(batch, context, context, pages))
        tokens = model.logits(hidden[context - 1::context]).argmax(-1)
        prefill_ms = (time.perf_counter() - started) * 1e3
        prefill_cpu_ms = (time.process_time() - cpu) * 1e3

        def decode(position: int) -> None:
            nonlocal tokens
            hidden = forward(tokens, torch.full((batch,), position), kv, metadata(batch, position + 1, 1, pages))
            tokens = model.logits(hidden).argmax(-1)

        decode(context)  # warm-up
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            decode(context + 1 + i)
        step_ms = (time.perf_counter() - started) / steps * 1e3
        cpu_ms = (time.process_time() - cpu) / steps * 1e3
        split = profile(lambda: [decode(context + 1 + steps + i) for i in range(steps)], steps)
    return {"prefill_ms": prefill_ms, "prefill_cpu_ms": prefill_cpu_ms, "step_ms": step_ms, "cpu_ms": cpu_ms, **split}


def profile(work, steps: int) -> dict[str, float]:
    # Attention as the torch reference runs it (a dense core), or as the C++ ops backend does (a quantized one).
    originals = PagedAttention.forward, cpu_ops.paged_attention

    def labelled(original):  # noqa: ANN001, ANN202
        def call(*args):  # noqa: ANN002, ANN202
            with torch.profiler.record_function("flare::attention"):
                return original(*args)
        return call

    PagedAttention.forward, cpu_ops.paged_attention = (labelled(original) for original in originals)
    try:
        started = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            work()
        total = (time.perf_counter() - started) * 1e3
    finally:
        PagedAttention.forward, cpu_ops.paged_attention = originals
    events = prof.events()
    operators = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    attention = sum(e.cpu_time_total for e in events if e.name == "flare::attention") / 1e3
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == "flare::attention"]

    def inside(event) -> bool:  # noqa: ANN001
        return any(start <= event.time_range.start and event.time_range.end <= end for start, end in spans)

    matmul = sum(e.self_cpu_time_total for e in events if e.name in MATMULS and not inside(e)) / 1e3
    layers = sum(e.cpu_time_total for e in events if e.name == LAYERS) / 1e3
    # The profiler's own bookkeeping inflates the rest (it costs per operator): read the parts as shares.
    return {"matmul": matmul / total, "attention": attention / total, "layers": layers / total,
            "operators": operators / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cores", type=Path, nargs="+")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--split", action="store_true",
                        help="a quantized core's decode layers as their C++ ops called one by one (the same bits), so "
                             "that matmuls and attention are split out of the C++ layers column")
    args = parser.parse_args()
    print(f"threads: {set_threads(args.threads)}")
    print("| core | batch | prefill ms | prefill CPU ms | step ms | step CPU ms | tok/s | operators/step | matmuls | attention "
          "| C++ layers | rest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for core in args.cores:
        r = run(core, args.batch, args.context, args.steps, args.split)
        print(f"| {core.name} | {args.batch} | {r['prefill_ms']:.0f} | {r['prefill_cpu_ms']:.0f} | {r['step_ms']:.1f} | {r['cpu_ms']:.1f} | "
              f"{args.batch * 1e3 / r['step_ms']:.1f} | {r['operators']:.0f} | {r['matmul']:.0%} | "
              f"{r['attention']:.0%} | {r['layers']:.0%} | {1 - r['matmul'] - r['attention'] - r['layers']:.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
