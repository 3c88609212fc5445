"""The engine's flags, defined once (docs/design.md, The supervisor): `flare-engine` reads them, and `flare run` takes
the same ones and forwards each it was given to every engine rank. Only argparse and plain values here: `common/`
never imports torch or the engine."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # engine/model/loader.py DTYPES maps each to torch's
SPECULATIVE_MODES = ("auto", "ngram", "draft", "off")
KV_CACHE_DTYPES = ("auto", "fp8")  # engine/model/kv_quant.py

# (flag, add_argument's keywords); the defaults are the engine's, so forwarding skips a flag left at its default.
ENGINE_FLAGS: tuple[tuple[str, dict[str, object]], ...] = (
    ("--device", {"default": "auto", "help": "auto (default: the GPU when CuPy and torch both see one, else the "
                                             "CPU), cpu or cuda"}),
    ("--max-active", {"type": int, "help": "live request slots per engine (default: the core's capacities)"}),
    ("--max-batched-tokens", {"type": int, "help": "prompt tokens one step may carry (default: the core's prefill "
                                                   "chunk on the CPU, 2048 to 8192 by its memory on a GPU)"}),
    ("--kv-cache-bytes", {"type": int, "help": "KV cache budget in bytes (default: the core's capacities on the "
                                               "CPU, the free memory on a GPU)"}),
    ("--kv-cache-fraction", {"type": float, "help": "on a GPU: the share of its memory that weights, KV cache and "
                                                    "graphs may fill (default 0.92)"}),
    ("--host-cache-bytes", {"type": int, "help": "host memory that prefix checkpoints evicted from the KV cache move "
                                                 "to (default: a quarter of the available memory on a GPU machine, "
                                                 "0 on the CPU; at most 90% of it)"}),
    ("--disk-cache", {"type": Path, "metavar": "DIR", "help": "a directory that pages the host tier gives up move "
                                                              "to, reused after a restart with the same core (needs "
                                                              "a host tier)"}),
    ("--disk-cache-bytes", {"type": int, "help": "the disk tier's budget (default: half the free space of "
                                                 "--disk-cache)"}),
    ("--dtype", {"choices": DTYPE_NAMES, "help": "override the core's dtype"}),
    ("--kv-cache-dtype", {"choices": KV_CACHE_DTYPES, "default": "auto",
                          "help": "the KV cache's element type: auto (default: the model's dtype) or fp8 (e4m3 "
                                  "with a scale per layer and KV head, the core's or 1.0: twice a bfloat16 "
                                  "cache's pages in the same bytes)"}),
    ("--eager", {"action": "store_true", "help": "on a GPU, run eagerly instead of replaying captured graphs"}),
    ("--speculative", {"choices": SPECULATIVE_MODES, "default": "auto",
                       "help": "draft proposals verified in one wider step: ngram (copies from the prompt and "
                               "output), draft (the --draft model), off; auto (default): off on a GPU, else draft "
                               "with --draft, else ngram"}),
    ("--draft", {"type": Path, "metavar": "DRAFT_CORE", "help": "a smaller core with the same tokenizer that "
                                                                "proposes drafts"}),
)


def add_engine_flags(parser: argparse.ArgumentParser, title: str) -> None:
    """The engine's flags, as one group of `parser`'s help titled `title`."""
    group = parser.add_argument_group(title)
    for flag, keywords in ENGINE_FLAGS:
        group.add_argument(flag, **keywords)


def forwarded_engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags `args` holds other than at their defaults, as `flare-engine` arguments."""
    forwarded = []
    for flag, keywords in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if keywords.get("action") == "store_true":
            forwarded += [flag] if value else []
        elif value != keywords.get("default"):
            forwarded.append(f"{flag}={value}")
    return forwarded
