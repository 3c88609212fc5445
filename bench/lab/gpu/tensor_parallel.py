"""Tensor parallelism on several GPUs of one host: greedy parity with one GPU, and decode step times.

    python3 -m bench.lab.gpu.tensor_parallel [--layers 32] [--batches 1 16 64] [--steps 40]

Random Llama-3.1-8B-architecture weights, bf16, made on the GPUs from a seed per tensor (every rank makes the whole
tensor and keeps its slice, so R = 1 and R = 2 run the same logical model; nothing travels). R = 1 first records its
greedy generation's plans; the R = 2 ranks replay exactly those plans and compare tokens. Step times: eager and
captured graphs, with the all-reduces and with them replaced by nothing (the gap is the all-reduce's share).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.lab.gpu.steps import decode_plan, generate, replay, time_steps, weight_bytes
from engine.executor.eager import EagerExecutor
from engine.model.backends.select import use_backend
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
from engine.model.sharding import SPLITS, Shard
from engine.parallel.group import TensorParallel, join
from engine.scheduler.scheduler import RequestScheduler

LLAMA_31_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               "tie_word_embeddings": False}
PAGE, CONTEXT, CHUNK, MAX_ACTIVE = 64, 512, 512, 64
PROMPT_LENGTHS = [17, 200, 33, 90, 5, 60, 41, 66]
NEW_TOKENS = 32
PARITY_DTYPES = (torch.bfloat16, torch.float32)  # fp32 tells a sharding bug from bf16 rounding


def build(config: DecoderConfig, tp: TensorParallel | None, device: torch.device,
          dtype: torch.dtype = torch.bfloat16) -> CausalLM:
    shard = Shard.of(config, tp.rank, tp.world_size) if tp else None
    local = shard.local_config(config) if shard else config
    with torch.device("meta"):
        full_names = CausalLM(config).state_dict()
        model = CausalLM(local, tp)
    state = {}
    for name, meta in full_names.items():
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")
        generator = torch.Generator(device=device).manual_seed(seed)
        if name.endswith("norm.weight"):
            full = 1 + 0.1 * torch.randn(meta.shape, generator=generator, device=device)
        else:
            full = torch.randn(meta.shape, generator=generator, device=device) * meta.shape[-1] ** -0.5
        split = next((s for suffix, s in SPLITS.items() if name.endswith(suffix)), None)
        if shard is not None and split is not None:
            full = shard.read(full, *split)
        state[name] = full.to(dtype).contiguous()
    model.load_state_dict(state, strict=False, assign=True)
    model.set_rope(device)
    use_backend(model, "triton", 8192)
    return model.eval()


def executor(kind: str, model: CausalLM, device: torch.device, pages: int):
    if kind == "eager":
        return EagerExecutor(model, pages, PAGE, MAX_ACTIVE, device)
    from engine.executor.graph import GraphExecutor

    return GraphExecutor(model, pages, PAGE, MAX_ACTIVE, device, 8192, CHUNK)


def timings(model: CausalLM, device: torch.device, batches: list[int], steps: int) -> dict:
    pages = max(batches) * -(-CONTEXT // PAGE) + 8
    out = {}
    for kind in ("graph", "eager"):
        try:
            runner = executor(kind, model, device, pages)
        except Exception as exc:  # e.g. collectives that cannot be captured: report, keep the eager figures
            out[kind] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        runner.kv_cache.normal_()
        out[kind] = {b: 1000 * time_steps(runner, decode_plan(b, CONTEXT, PAGE), steps) for b in batches}
        runner.close()
        torch.cuda.empty_cache()
    return out


def rank_main(rank: int, world: int, address: str, args: argparse.Namespace, record: Path) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = join(rank, world, address, device) if world > 1 else None
    config = DecoderConfig.from_hf("llama", {**LLAMA_31_8B, "num_hidden_layers": args.layers})
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    result: dict = {"world": world, "parity": {}}
    for dtype in PARITY_DTYPES:
        model = build(config, tp, device, dtype)
        result["parity"][str(dtype)] = parity(model, device, world, prompts, record.with_suffix(f".{dtype}.pkl"))
        del model
        torch.cuda.empty_cache()
    model = build(config, tp, device)
    result["weight_bytes"] = weight_bytes(model)
    result["with_allreduce"] = timings(model, device, args.batches, args.steps)
    if tp is not None:
        TensorParallel.all_reduce = lambda self, x: x  # timing only: the step without its all-reduces
        result["without_allreduce"] = timings(model, device, args.batches, args.steps)
    if rank == 0:
        Path(args.out).with_suffix(f".tp{world}.pkl").write_bytes(pickle.dumps(result))


def parity(model: CausalLM, device: torch.device, world: int, prompts: list[list[int]],
           record: Path) -> tuple[int, int, int | None] | None:
    """R = 1 records its greedy run's plans and sampled tokens; R > 1 replays the plans and compares tokens:
    (equal tokens, tokens, first step that differs)."""
    runner = executor("eager", model, device, 256)
    if world == 1:
        scheduler = RequestScheduler(8, 64, runner.num_pages, PAGE, CHUNK)
        _, plans = generate(runner, scheduler, prompts, NEW_TOKENS)
        runner.close()
        runner = executor("eager", model, device, 256)
        record.write_bytes(pickle.dumps((plans, replay(runner, plans))))
        runner.close()
        return None
    plans, reference = pickle.loads(record.read_bytes())
    steps = replay(runner, plans)
    runner.close()
    pairs = [(a, b) for got, want in zip(steps, reference) for a, b in zip(got, want)]
    first = next((i for i, (got, want) in enumerate(zip(steps, reference)) if got != want), None)
    return sum(a == b for a, b in pairs), len(pairs), first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "gpu_tp"))
    args = parser.parse_args()
    record = Path(args.out).with_suffix(".plans.pkl")
    started = time.time()
    mp.spawn(rank_main, args=(1, "", args, record), nprocs=1)
    mp.spawn(rank_main, args=(2, "127.0.0.1:29517", args, record), nprocs=2)
    one = pickle.loads(Path(args.out).with_suffix(".tp1.pkl").read_bytes())
    two = pickle.loads(Path(args.out).with_suffix(".tp2.pkl").read_bytes())
    copy_bw = 4.26e12  # H200 device-to-device, measured in bench/lab/gpu/evidence.py (docs/gpu.md)
    for dtype, (equal, total, first) in two["parity"].items():
        print(f"## Greedy parity, {args.layers} layers, {dtype}: R=2 replaying R=1's plans: "
              f"{equal}/{total} tokens equal (first differing step: {first})")
    print(f"## Decode step ms ({args.layers}-layer Llama-3.1-8B architecture, bf16, context {CONTEXT})")
    print("| executor | batch | tp1 ms | tp2 ms | tp2 without all-reduce ms | all-reduce share | "
          "tp1 GB/s per GPU | tp2 GB/s per GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("eager", "graph"):
        a, b, c = one["with_allreduce"][kind], two["with_allreduce"][kind], two["without_allreduce"][kind]
        if not all(isinstance(x, dict) for x in (a, b, c)):
            print(f"| {kind} | - | {a if isinstance(a, str) else ''} | {b if isinstance(b, str) else ''} | "
                  f"{c if isinstance(c, str) else ''} | | | |")
            continue
        for batch in args.batches:
            share = 1 - c[batch] / b[batch]
            print(f"| {kind} | {batch} | {a[batch]:.2f} | {b[batch]:.2f} | {c[batch]:.2f} | {share:.0%} | "
                  f"{one['weight_bytes'] / a[batch] / 1e6:.0f} | {two['weight_bytes'] / b[batch] / 1e6:.0f} |")
    print(f"(copy bandwidth {copy_bw / 1e9:.0f} GB/s; {time.time() - started:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
