"""A model of the 8b-32k serving row: mean TTFT and TPOT against the chunk policy and the attention kernel's rate.

    python3 -m bench.lab.gpu.long_prompts [--prompts 8] [--prompt-len 32000] [--output-len 128]

N prompts arrive at once and load in arrival order, a chunk a step; every request whose prompt has loaded decodes one
token a step beside it. A step costs a read of the weights, its chunk's linear layers at a prompt-token rate, the
chunk's causal attention at a FLOP rate, and the decode rows' keys at a bandwidth: the rates of the 8B measured on
an H200 (docs/gpu.md: prefill steps, the extend kernel's sweeps, decode attention). It runs on a CPU in a second
and says which targets a chunk policy can reach at a given attention rate and which need a faster kernel: at the
measured rates it gives the row's measured figures (6.8 s / 53 ms against 6.78 s / 51.5 ms, 2026-12-05).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

# Llama-3.1-8B on one H200.
WEIGHTS_S = 0.004  # a step's read of the weights
LINEAR_TOKENS_PER_S = 40_000  # prompt tokens through the linear layers (8,192-token prefill steps, 60% MFU)
ATTENTION_FLOPS_PER_PAIR = 2 * 2 * 4096 * 32  # QK and PV, 32 heads x 128, 32 layers: per (query, key) pair
KV_BYTES_PER_TOKEN = 131_072  # 32 layers x 8 KV heads x 128 x (K, V) x bf16
DECODE_KV_BYTES_PER_S = 3.7e12  # decode attention over long contexts


@dataclass(frozen=True)
class Workload:
    prompts: int
    prompt_len: int
    output_len: int


def step_seconds(chunk: int, chunk_end: int, decode_contexts: list[int], attention_flops: float) -> float:
    seconds = WEIGHTS_S + sum(decode_contexts) * KV_BYTES_PER_TOKEN / DECODE_KV_BYTES_PER_S
    if chunk:
        mean_keys = chunk_end - chunk / 2
        seconds += chunk / LINEAR_TOKENS_PER_S + chunk * mean_keys * ATTENTION_FLOPS_PER_PAIR / attention_flops
    return seconds


def serve(work: Workload, chunk_for: Callable[[int], int], attention_flops: float) -> tuple[float, float]:
    """(mean TTFT s, mean TPOT ms) with `chunk_for(decoding requests)` prompt tokens a step."""
    now, loaded, generated = 0.0, [0] * work.prompts, [0] * work.prompts
    first: list[float | None] = [None] * work.prompts
    last: list[float | None] = [None] * work.prompts
    while any(t is None for t in last):
        decoding = [i for i in range(work.prompts) if first[i] is not None and last[i] is None]
        loading = next((i for i in range(work.prompts) if loaded[i] < work.prompt_len), None)
        chunk = min(chunk_for(len(decoding)), work.prompt_len - loaded[loading]) if loading is not None else 0
        chunk_end = loaded[loading] + chunk if loading is not None else 0
        now += step_seconds(chunk, chunk_end, [work.prompt_len + generated[i] for i in decoding], attention_flops)
        for i in decoding:
            generated[i] += 1
            if generated[i] == work.output_len:
                last[i] = now
        if loading is not None:
            loaded[loading] += chunk
            if loaded[loading] == work.prompt_len:
                first[loading], generated[loading] = now, 1
    ttft = sum(t for t in first if t is not None) / work.prompts
    tpot = sum(b - a for a, b in zip(first, last) if a is not None and b is not None) / work.prompts
    return ttft, tpot / (work.output_len - 1) * 1e3


POLICIES: dict[str, Callable[[int], int]] = {
    "8,192 a step (the H200's default)": lambda decoding: 8192,
    "4,096 a step": lambda decoding: 4096,
    "2,048 a step": lambda decoding: 2048,
    "8,192, 2,048 while requests decode": lambda decoding: 2048 if decoding else 8192,
    "8,192, 1,024 while requests decode": lambda decoding: 1024 if decoding else 8192,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32000)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    work = Workload(args.prompts, args.prompt_len, args.output_len)
    rates = (390e12, 550e12, 650e12)
    print("| prompt tokens a step | " + " | ".join(f"attention at {r / 1e12:.0f} TFLOP/s: TTFT s, TPOT ms"
                                                  for r in rates) + " |")
    print("| --- |" + " --- |" * len(rates))
    for name, policy in POLICIES.items():
        cells = (serve(work, policy, rate) for rate in rates)
        print(f"| {name} | " + " | ".join(f"{ttft:.2f}, {tpot:.1f}" for ttft, tpot in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
