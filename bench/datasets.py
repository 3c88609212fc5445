"""Workloads: the prompts a benchmark sends and the output length each asks for.

- `random`: input and output lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)].
- `sharegpt-synthetic`: log-normal lengths, the long-tailed shape of ShareGPT conversations, with the requested
  lengths as their means (nothing is downloaded: the shape is synthetic, the seed makes it repeatable).
- `shared-prefix`: `num_groups` long system prompts of `prefix_len` tokens; each request takes one of them and a
  random question, so a server with a prefix cache prefills each system prompt once.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.tokens import Tokens

DATASETS = ("random", "sharegpt-synthetic", "shared-prefix")

# Spreads of log(length): ShareGPT prompts vary more than its answers. Lengths are clipped to LONGEST_FACTOR x the
# mean so that one draw from the tail cannot exceed a small model's context.
SHAREGPT_SIGMA_INPUT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.8
LONGEST_FACTOR = 8


@dataclass(frozen=True)
class Prompt:
    system: str | None
    user: str
    input_len: int   # tokens the prompt text was built to have, system prompt included
    output_len: int  # max_tokens of the request


@dataclass(frozen=True)
class Workload:
    dataset: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    seed: int
    prefix_len: int
    num_groups: int


def uniform_lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    low, high = max(round(mean * (1 - ratio)), 1), max(round(mean * (1 + ratio)), 1)
    return [rng.randint(low, high) for _ in range(n)]


def lognormal_lengths(rng: random.Random, n: int, mean: int, sigma: float) -> list[int]:
    mu = math.log(mean) - sigma * sigma / 2  # so that the distribution's mean is `mean`
    return [min(max(round(rng.lognormvariate(mu, sigma)), 1), mean * LONGEST_FACTOR) for _ in range(n)]


def build_prompts(workload: Workload, tokens: Tokens) -> list[Prompt]:
    rng = random.Random(workload.seed)
    n = workload.num_prompts
    if workload.dataset == "sharegpt-synthetic":
        inputs = lognormal_lengths(rng, n, workload.input_len, SHAREGPT_SIGMA_INPUT)
        outputs = lognormal_lengths(rng, n, workload.output_len, SHAREGPT_SIGMA_OUTPUT)
    else:
        inputs = uniform_lengths(rng, n, workload.input_len, workload.range_ratio)
        outputs = uniform_lengths(rng, n, workload.output_len, workload.range_ratio)
    if workload.dataset != "shared-prefix":
        return [Prompt(None, tokens.text(rng, i), i, o) for i, o in zip(inputs, outputs, strict=True)]
    systems = [tokens.text(rng, workload.prefix_len) for _ in range(workload.num_groups)]
    groups = [i % workload.num_groups for i in range(n)]
    rng.shuffle(groups)  # groups interleave in arrival order, as users of one application would
    return [Prompt(systems[g], tokens.text(rng, i), workload.prefix_len + i, o)
            for g, i, o in zip(groups, inputs, outputs, strict=True)]
