"""The Triton kernels on a GPU (fused MoE, extend and decode attention), printed as markdown tables:

    python -m bench.lab.gpu.kernels [--out FILE]
        [--only moe|moe-fp8|extend|decode|decode-splits|tiles|splits|moe-configs]

- Fused MoE (engine/kernels/triton/fused_moe.py) against its torch reference at batch 1, 16, 256, Qwen3-30B-A3B and
  Mixtral-8x7B expert shapes (one layer, random bf16 weights): time, the bandwidth on the weights of the experts the
  batch actually routes to (decode is bound by it), TFLOP/s, and the max abs difference from the reference.
- moe-fp8: the Qwen3-30B-A3B shape's experts in e4m3 (a scale per row) at 4-2,048 tokens: bf16 experts against e4m3
  widened in registers.
- Extend (prefill) attention (engine/kernels/triton/extend_attention.py), Llama-3.1-8B heads (32 query, 8 KV, head_dim
  128, pages of 64), at 1k/4k/16k/32k context: a prompt chunk of up to 2048 new tokens ending the context and 64 new
  tokens after a cached prefix; TFLOP/s of the causal work against a bf16 GEMM of the same token count
  ([M, 4096] x [4096, 14336]) and torch's scaled_dot_product_attention on contiguous K/V, and over the same cache in
  FP8; max abs difference from the float32 reference.
- Decode attention with and without a sliding window (Gemma 3's 1024): 8 rows at long contexts, 64 and 256 rows
  at about 1k; the same rows through the extend kernel, as a mixed step's decode rows run (its narrow launch), with
  the bandwidth on K and V (and with the decode kernel's two pipeline stages instead of three); and the decode
  kernel over the same cache in FP8 (`--kv-cache-dtype fp8`: half the bytes), against its float32 reference, with
  its 64-key tiles and with 128 (as many bytes a load as bf16's).
- Batch-1 decode attention at 256-4,096 keys with 1 to the default key splits (8B and SmolLM2 heads): what a decode
  graph for short contexts alone, with one split and no merge kernel, would save.
- Sweeps of the extend kernel's tile configurations at 16k context (bf16 and FP8 caches), of the programs its key
  splits aim for under 64 new tokens after a 16k or 32k cached prefix (the 8b-prefix16k row's step), and of the
  fused MoE's block configurations;
  the MoE's default also with its routing (route_in_one_program, the model's), in a launch of its own.

Timing: CUDA events around each call after warm-up calls, the median of the repeats; where a column says "graph",
CUDA events around 20 calls replayed from one captured graph, as the engine runs them (without the host's launch
cost, which dominates a call of a few tens of microseconds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from bench.lab.gpu.evidence import run_sections, say
from engine.kernels.triton import kv_store
from engine.kernels.triton.decode_attention import decode_attention, decode_attention_reference, num_splits
from engine.kernels.triton.extend_attention import (BLOCK_M, MAX_SPLITS, extend_attention, extend_attention_reference,
                                                    extend_blocks, tile_config)
from engine.kernels.triton.fused_moe import MoeConfig, fused_moe, fused_moe_reference
from engine.kernels.triton.moe_routing import route, route_in_one_program
from engine.model.kv_quant import quantize
from engine.kernels.triton.moe_rows import ExpertScales, RowsConfig
from engine.model.backends.triton_layers import multiprocessors

MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}  # H, I, E, K
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 64
CONTEXTS = [1024, 4096, 16384, 32768]
# (batch, context): a long-context batch, and the decode rows of a 256-wide mixed step (the 8b-1024x768 row)
DECODE_SHAPES = [(1, 512), (1, 4096), (8, 4096), (8, 32768), (64, 1024), (256, 1152)]
TILE_CONTEXT = 16384
DEVICE = "cuda"


def time_ms(fn: Callable[[], object], warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of one call, each timed by CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], replays: int = 20) -> float:
    """Milliseconds of one call replayed from a CUDA graph, as the engine runs it (no launch cost on the host):
    `replays` replays between two events, after a warm-up call and the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


def bench_moe() -> None:
    say("## Fused MoE vs torch reference (one layer, bf16)")
    say("| model | batch | fused ms | reference ms | speed-up | active experts | GB/s on their weights | "
        "TFLOP/s | max abs diff | ref max abs |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (hidden, inter, experts, top_k) in MOE_SHAPES.items():
        w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16, generator=g) * inter**-0.5
        for tokens in (1, 4, 16, 256):
            x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
            weights, ids = route(torch.randn(tokens, experts, device=DEVICE, generator=g), top_k, renormalize=True)
            fused = time_ms(lambda: fused_moe(x, w13, w2, weights, ids))
            reference = time_ms(lambda: fused_moe_reference(x, w13, w2, weights, ids), warmup=1, repeats=5)
            active = int(ids.unique().numel())
            weight_bytes = active * 3 * hidden * inter * 2
            flops = 2 * tokens * top_k * 3 * hidden * inter
            ref = fused_moe_reference(x, w13, w2, weights, ids)
            say(f"| {name} | {tokens} | {fused:.3f} | {reference:.3f} | {reference / fused:.1f}x | {active} | "
                f"{weight_bytes / fused / 1e6:.0f} | {flops / fused / 1e9:.1f} | "
                f"{max_diff(fused_moe(x, w13, w2, weights, ids), ref):.4f} | {float(ref.abs().max()):.2f} |")
        del w13, w2
        torch.cuda.empty_cache()


def bench_moe_fp8() -> None:
    say("## Fused MoE over e4m3 experts (a scale per row), ms a layer: bf16 experts; e4m3 widened to bf16 in "
        "registers")
    say("| model | batch | bf16 | e4m3 widened | max abs diff |")
    say("| --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(4)
    name, (hidden, inter, experts, top_k) = "qwen3-30b-a3b", MOE_SHAPES["qwen3-30b-a3b"]
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16, generator=g) * inter**-0.5
    quantized = []
    for weight in (w13, w2):
        scale = weight.float().abs().amax(dim=-1, keepdim=True) / 448.0
        quantized.append(((weight.float() / scale).to(torch.float8_e4m3fn), scale))
    (v13, s13), (v2, s2) = quantized
    scales = ExpertScales(s13, s2, None)
    for tokens in (4, 16, 64, 256, 2048):
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
        weights, ids = route(torch.randn(tokens, experts, device=DEVICE, generator=g), top_k, renormalize=True)
        bf16 = time_ms(lambda: fused_moe(x, w13, w2, weights, ids))
        ref = fused_moe(x, w13, w2, weights, ids)
        widened = time_ms(lambda: fused_moe(x, v13, v2, weights, ids, scales=scales))
        diff = max_diff(fused_moe(x, v13, v2, weights, ids, scales=scales), ref)
        say(f"| {name} | {tokens} | {bf16:.3f} | {widened:.3f} | {diff:.4f} |")


def extend_inputs(new: int, context: int, g: torch.Generator) -> tuple:
    """One sequence of `new` tokens ending a `context`-token context, pages shuffled, and its block list."""
    pages = -(-context // PAGE)
    table = torch.randperm(pages, device=DEVICE, generator=g).to(torch.int32)[None]
    cache = torch.randn(2, pages * PAGE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=g)
    q = torch.randn(new, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=g)
    ints = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    meta = (table, ints([0]), ints([0]), ints([new]), ints([context]))
    return q, cache[0], cache[1], meta, tuple(ints(v) for v in extend_blocks([new]))


def causal_flops(new: int, context: int) -> float:
    """QK^T and PV over the keys each new token sees (its position + 1), two flops a multiply-add."""
    first = context - new
    keys = new * first + new * (new + 1) / 2
    return 4 * HEADS * HEAD_DIM * keys


def bench_extend() -> None:
    say("## Extend attention (Llama-3.1-8B heads, bf16, paged cache) vs a bf16 GEMM and torch SDPA; the same over an "
        "FP8 cache")
    say("| context | new tokens | kernel ms | TFLOP/s | in a graph ms | TFLOP/s | SDPA ms (contiguous) | SDPA TFLOP/s | "
        f"GEMM [M,4096]x[4096,14336] TFLOP/s | max abs diff | fp8 cache in a graph ms | TFLOP/s | max abs diff | "
        "fp8 widened to float16 ms |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    scale = HEAD_DIM**-0.5
    for context in CONTEXTS:
        for new in sorted({min(context, 2048), 64}, reverse=True):
            q, k_cache, v_cache, meta, blocks = extend_inputs(new, context, g)
            out = torch.empty_like(q)
            kernel = time_ms(lambda: extend_attention(q, k_cache, v_cache, out, *meta, *blocks, PAGE, scale))
            replayed = graph_ms(lambda: extend_attention(q, k_cache, v_cache, out, *meta, *blocks, PAGE, scale))
            ref = extend_attention_reference(q, k_cache, v_cache, *meta, PAGE, scale)
            diff = max_diff(out, ref)
            del ref
            kv_scale = torch.full((2, KV_HEADS), 0.5, device=DEVICE)
            k8, v8 = quantize(k_cache, kv_scale[0]), quantize(v_cache, kv_scale[1])
            fp8 = graph_ms(lambda: extend_attention(q, k8, v8, out, *meta, *blocks, PAGE, scale, kv_scale=kv_scale))
            fp8_diff = max_diff(out, extend_attention_reference(q, k8, v8, *meta, PAGE, scale, kv_scale=kv_scale))
            kv_store.E4M3_TO_FLOAT16 = True  # e4m3 and the bfloat16 queries widened to float16
            as_fp16 = graph_ms(lambda: extend_attention(q, k8, v8, out, *meta, *blocks, PAGE, scale,
                                                        kv_scale=kv_scale))
            kv_store.E4M3_TO_FLOAT16 = False
            del k8, v8
            keys = k_cache[:context].transpose(0, 1)[None]  # contiguous K/V as a dense kernel would read them
            values = v_cache[:context].transpose(0, 1)[None]
            query = q.transpose(0, 1)[None]
            mask = torch.arange(context, device=DEVICE)[None, :] <= torch.arange(context - new, context,
                                                                                 device=DEVICE)[:, None]
            sdpa = time_ms(lambda: F.scaled_dot_product_attention(
                query, keys, values, attn_mask=None if new == context else mask, is_causal=new == context,
                scale=scale, enable_gqa=True))
            a = torch.randn(new, 4096, device=DEVICE, dtype=torch.bfloat16, generator=g)
            b = torch.randn(4096, 14336, device=DEVICE, dtype=torch.bfloat16, generator=g)
            gemm = time_ms(lambda: a @ b)
            flops = causal_flops(new, context)
            say(f"| {context} | {new} | {kernel:.3f} | {flops / kernel / 1e9:.0f} | {replayed:.3f} | "
                f"{flops / replayed / 1e9:.0f} | {sdpa:.3f} | "
                f"{flops / sdpa / 1e9:.0f} | {2 * new * 4096 * 14336 / gemm / 1e9:.0f} | {diff:.4f} | {fp8:.3f} | "
                f"{flops / fp8 / 1e9:.0f} | {fp8_diff:.4f} | {as_fp16:.3f} |")
            del q, k_cache, v_cache, keys, values
            torch.cuda.empty_cache()


def bench_tiles() -> None:
    say(f"## Extend attention tile configurations at {TILE_CONTEXT} context (TILE_M, BLOCK_N, warps, stages)")
    say(f"default: {tile_config(torch.bfloat16, HEAD_DIM, torch.device(DEVICE))}; BLOCK_M (host blocks) {BLOCK_M}")
    say("| cache | config | 2048 new ms | TFLOP/s | max abs diff | 64 new ms | TFLOP/s | max abs diff |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(2)
    kv_scale = torch.full((2, KV_HEADS), 0.5, device=DEVICE)
    for fp8 in (False, True):
        cases = []
        for new in (2048, 64):
            q, k_cache, v_cache, meta, blocks = extend_inputs(new, TILE_CONTEXT, g)
            if fp8:
                k_cache, v_cache = quantize(k_cache, kv_scale[0]), quantize(v_cache, kv_scale[1])
            scales = kv_scale if fp8 else None
            cases.append((new, (q, k_cache, v_cache, meta, blocks), scales,
                          extend_attention_reference(q, k_cache, v_cache, *meta, PAGE, HEAD_DIM**-0.5,
                                                     kv_scale=scales)))
        for config in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
                       (64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 4, 3)] + ([(128, 128, 8, 3), (64, 128, 4, 3)]
                                                                            if fp8 else []):
            cells = []
            for new, (q, k_cache, v_cache, meta, blocks), scales, ref in cases:
                out = torch.empty_like(q)
                try:
                    ms = time_ms(lambda: extend_attention(q, k_cache, v_cache, out, *meta, *blocks, PAGE,
                                                          HEAD_DIM**-0.5, config=config, kv_scale=scales))
                    cells += [f"{ms:.3f}", f"{causal_flops(new, TILE_CONTEXT) / ms / 1e9:.0f}",
                              f"{max_diff(out, ref):.4f}"]
                except Exception as error:  # a configuration that does not compile (shared memory) says so
                    cells += [type(error).__name__, "-", "-"]
            say(f"| {'fp8' if fp8 else 'bf16'} | {config} | " + " | ".join(cells) + " |")


def bench_splits() -> None:
    say("## A short chunk after a long cached prefix: the programs the extend kernel's key splits aim for, and the "
        f"most splits a block's keys take (the defaults: target_programs, 4 a multiprocessor, and {MAX_SPLITS})")
    say("| context | new tokens | programs | most splits | ms | TFLOP/s |")
    say("| --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=DEVICE).manual_seed(4)
    sms = multiprocessors(torch.device(DEVICE))
    for context in (16384, 32768):
        q, k_cache, v_cache, meta, blocks = extend_inputs(64, context, g)
        out = torch.empty_like(q)
        for programs, most in ((sms, 4), (2 * sms, 8), (4 * sms, MAX_SPLITS), (8 * sms, 32), (16 * sms, 64)):
            ms = graph_ms(lambda: extend_attention(q, k_cache, v_cache, out, *meta, *blocks, PAGE, HEAD_DIM**-0.5,
                                                  programs=programs, max_splits=most))
            say(f"| {context} | 64 | {programs} | {most} | {ms:.3f} | {causal_flops(64, context) / ms / 1e9:.0f} |")
        del q, k_cache, v_cache
        torch.cuda.empty_cache()


def bench_moe_configs() -> None:
    say("## Fused MoE block configurations, Qwen3-30B-A3B experts, ms: grouped (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, "
        "warps, stages) and rows (BLOCK_N weight rows per program, BLOCK_K, warps, stages)")
    hidden, inter, experts, top_k = MOE_SHAPES["qwen3-30b-a3b"]
    g = torch.Generator(device=DEVICE).manual_seed(4)
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16, generator=g) * inter**-0.5
    batches = (1, 2, 4, 8, 16, 256)
    inputs = []
    for tokens in batches:
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
        logits = torch.randn(tokens, experts, device=DEVICE, generator=g)
        weights, ids = route(logits, top_k, renormalize=True)
        inputs.append((x, logits, weights, ids, fused_moe_reference(x, w13, w2, weights, ids)))
    say("| config | " + " | ".join(f"batch {t}" for t in batches) + " |")
    say("| --- |" + " --- |" * len(batches))
    say("| default (moe_config), routing given | " + " | ".join(
        f"{time_ms(lambda: fused_moe(x, w13, w2, w, i)):.3f}" for x, _, w, i, _ in inputs) + " |")
    say("| default, route_in_one_program + fused_moe (the model's) | " + " | ".join(
        f"{time_ms(lambda: fused_moe(x, w13, w2, *route_in_one_program(logits, top_k, True))):.3f}"
        for x, logits, _, _, _ in inputs) + " |")
    for config in [MoeConfig(16, 16, 128, 1, 4, 3), MoeConfig(16, 16, 256, 1, 4, 3),
                   MoeConfig(16, 32, 64, 1, 4, 4), MoeConfig(16, 32, 128, 1, 4, 3), MoeConfig(16, 64, 128, 1, 4, 3),
                   MoeConfig(16, 128, 128, 1, 4, 3), MoeConfig(32, 64, 64, 4, 4, 3), MoeConfig(64, 64, 64, 8, 4, 3),
                   MoeConfig(64, 128, 64, 8, 8, 3), MoeConfig(128, 128, 64, 8, 8, 3),
                   RowsConfig(8, 256, 4, 3), RowsConfig(16, 128, 4, 3), RowsConfig(16, 256, 4, 3),
                   RowsConfig(16, 512, 8, 3), RowsConfig(32, 128, 4, 3), RowsConfig(32, 256, 8, 3),
                   RowsConfig(64, 128, 8, 3), RowsConfig(8, 512, 4, 4)]:
        cells = []
        for x, _, w, i, ref in inputs:
            try:
                ms = time_ms(lambda: fused_moe(x, w13, w2, w, i, config=config))
                bad = max_diff(fused_moe(x, w13, w2, w, i, config=config), ref) > 0.05 * float(ref.abs().max())
                cells.append(f"{ms:.3f}" + (" WRONG" if bad else ""))
            except Exception as error:
                cells.append(type(error).__name__)
        say(f"| {tuple(vars(config).values())} | " + " | ".join(cells) + " |")


def bench_decode() -> None:
    say("## Decode attention, Llama-3.1-8B heads, with and without a 1024-token sliding window; the same rows "
        "through the extend kernel (a mixed step's decode rows)")
    say("| batch | context | window | decode ms (graph) | K/V TB/s | max abs diff | "
        "extend kernel ms (graph) | K/V TB/s | max abs diff | extend, 2 stages ms | "
        "fp8 cache decode ms | K/V TB/s | max abs diff | fp8, 128 keys a tile ms | K/V TB/s | "
        "fp8 widened to float16 ms |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    two_stages = (*tile_config(torch.bfloat16, HEAD_DIM, torch.device(DEVICE))[:3], 2)  # the decode kernel's depth
    g = torch.Generator(device=DEVICE).manual_seed(3)
    for batch, context in DECODE_SHAPES:
        pages = -(-context // PAGE)
        tables = torch.randperm(batch * pages, device=DEVICE, generator=g).to(torch.int32).view(batch, pages)
        cache = torch.randn(2, batch * pages * PAGE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16,
                            generator=g)
        q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=g)
        args = (q, cache[0], cache[1], tables, torch.arange(batch, dtype=torch.int32, device=DEVICE),
                torch.full((batch,), context, dtype=torch.int32, device=DEVICE), PAGE, HEAD_DIM**-0.5)
        splits = num_splits(batch, KV_HEADS, multiprocessors(torch.device(DEVICE)))
        ints = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
        rows = (ints(list(range(batch))), ints([1] * batch))  # query start and length of each one-token sequence
        blocks = tuple(ints(v) for v in extend_blocks([1] * batch))
        out = torch.empty_like(q)
        kv_scale = torch.full((2, KV_HEADS), 0.5, device=DEVICE)
        fp8 = (quantize(cache[0], kv_scale[0]), quantize(cache[1], kv_scale[1]))
        fp8_args = (q, *fp8, *args[3:])
        for window in (0, 1024):
            ref = decode_attention_reference(*args, window=window)
            ms = graph_ms(lambda: decode_attention(*args, splits=splits, window=window))
            diff = max_diff(decode_attention(*args, splits=splits, window=window), ref)
            extend = graph_ms(lambda: extend_attention(q, cache[0], cache[1], out, tables, args[4], *rows, args[5],
                                                      *blocks, PAGE, HEAD_DIM**-0.5, window=window))
            extend_diff = max_diff(out, ref)
            shallow = graph_ms(lambda: extend_attention(q, cache[0], cache[1], out, tables, args[4], *rows, args[5],
                                                       *blocks, PAGE, HEAD_DIM**-0.5, window=window,
                                                       config=two_stages))
            fp8_ms = graph_ms(lambda: decode_attention(*fp8_args, splits=splits, window=window, kv_scale=kv_scale))
            fp8_diff = max_diff(decode_attention(*fp8_args, splits=splits, window=window, kv_scale=kv_scale),
                                decode_attention_reference(*fp8_args, window=window, kv_scale=kv_scale))
            wide = graph_ms(lambda: decode_attention(*fp8_args, splits=splits, window=window, kv_scale=kv_scale,
                                                     block_n=128))
            kv_store.E4M3_TO_FLOAT16 = True  # e4m3 and the bfloat16 queries widened to float16
            as_fp16 = graph_ms(lambda: decode_attention(*fp8_args, splits=splits, window=window, kv_scale=kv_scale))
            kv_store.E4M3_TO_FLOAT16 = False
            read = batch * min(context, window or context) * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
            say(f"| {batch} | {context} | {window or 'none'} | {ms:.3f} | {read / ms / 1e9:.2f} | {diff:.4f} | "
                f"{extend:.3f} | {read / extend / 1e9:.2f} | {extend_diff:.4f} | "
                f"{shallow:.3f} | {fp8_ms:.3f} | "
                f"{read / 2 / fp8_ms / 1e9:.2f} | {fp8_diff:.4f} | {wide:.3f} | {read / 2 / wide / 1e9:.2f} | "
                f"{as_fp16:.3f} |")


def bench_decode_splits() -> None:
    say("## Batch-1 decode attention against its key splits (graph ms: one split needs no merge kernel; a decode "
        "graph's split count follows its batch only, so short contexts pay the long ones' splits and merge)")
    shapes = {"Llama-3.1-8B (32 / 8 heads of 128)": (HEADS, KV_HEADS, HEAD_DIM),
              "SmolLM2-135M (9 / 3 of 64)": (9, 3, 64)}
    contexts = (256, 640, 1024, 2048, 4096)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    for name, (heads, kv_heads, head_dim) in shapes.items():
        default = num_splits(1, kv_heads, multiprocessors(torch.device(DEVICE)))
        counts = sorted({1, 2, 4, 8, default})
        say(f"{name}, default {default} splits")
        say("| context | " + " | ".join(f"{n} split{'s' if n > 1 else ''}" for n in counts) + " |")
        say("| --- |" + " --- |" * len(counts))
        for context in contexts:
            pages = -(-context // PAGE)
            cache = torch.randn(2, pages * PAGE, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=g)
            q = torch.randn(1, heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=g)
            args = (q, cache[0], cache[1], torch.arange(pages, dtype=torch.int32, device=DEVICE).view(1, pages),
                    torch.zeros(1, dtype=torch.int32, device=DEVICE),
                    torch.full((1,), context, dtype=torch.int32, device=DEVICE), PAGE, head_dim**-0.5)
            say(f"| {context} | " + " | ".join(f"{graph_ms(lambda: decode_attention(*args, splits=n)):.4f}"
                                               for n in counts) + " |")
    say()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--only", choices=["moe", "moe-fp8", "extend", "decode", "decode-splits", "tiles", "splits",
                                           "moe-configs"],
                        action="append")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.lab.gpu.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    say(f"# Kernels on {torch.cuda.get_device_name()}")
    sections = {"moe": bench_moe, "moe-fp8": bench_moe_fp8, "extend": bench_extend, "decode": bench_decode,
                "decode-splits": bench_decode_splits,
                "tiles": bench_tiles, "splits": bench_splits, "moe-configs": bench_moe_configs}
    run_sections({name: lambda run=run: (run(), say()) for name, run in sections.items()}, args.only or list(sections),
                 args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
