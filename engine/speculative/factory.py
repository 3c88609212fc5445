"""`--speculative` and `--draft` as the engine reads them: which proposer the scheduler gets."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from common.errors import CoreError
from common.manifest import Manifest
from engine.executor.eager import pages_for_budget
from engine.model.loader import load_model
from engine.scheduler.speculation import NgramProposer, Proposer

log = logging.getLogger("flare.engine")

DRAFT_KV_FRACTION = 0.25  # of the target's KV budget, for the draft model's pages


def default_mode(draft: Path | None, device: torch.device) -> str:
    """What measured best (docs/speculative.md, Evidence): on the CPU the draft model when one is given, else copy
    proposals. On a GPU, off: verify steps run in the decode graphs and pay at high acceptance, but what they cost
    on unpredictable traffic, where each request's learning must fall back to plain decoding, is not measured yet."""
    if device.type == "cuda":
        return "off"
    return "draft" if draft is not None else "ngram"


def target_share(budget: int, mode: str, draft: Path | None) -> int:
    """Of a device's KV budget, what the target keeps when a draft model will load beside it: its weights (their
    files' size) first, then DRAFT_KV_FRACTION of the target's pages for the draft's."""
    if draft is None or mode not in ("auto", "draft"):
        return budget
    weights = sum(path.stat().st_size for path in draft.glob("*.safetensors"))
    return max(int((budget - weights) / (1 + DRAFT_KV_FRACTION)), 0)


def make_proposer(mode: str, draft: Path | None, target: Manifest, device: torch.device, page_size: int,
                  kv_budget: int, max_active: int, prefill_chunk: int, graphs: bool) -> Proposer | None:
    """`graphs` (CUDA): the draft's rounds replay graphs captured now, at batch capacities up to `max_active` and
    catch-up capacities up to `prefill_chunk` tokens plus a row per slot (engine/speculative/draft_steps.py)."""
    if mode == "auto":
        mode = default_mode(draft, device)
    if mode == "off":
        return None
    if mode == "ngram":
        return NgramProposer()
    if draft is None:
        raise CoreError("--speculative draft needs --draft DRAFT_CORE")
    from engine.speculative.draft import DraftProposer

    manifest, model = load_model(draft, device, torch.float32 if device.type == "cpu" else None)
    if manifest.files.get("tokenizer.json") != target.files.get("tokenizer.json"):
        raise CoreError(f"{draft}: the draft core's tokenizer differs from the target's; a draft must share it")
    if model.config.vocab_size != int(target.config["vocab_size"]):
        raise CoreError(f"{draft}: the draft's vocabulary ({model.config.vocab_size}) differs from the target's "
                        f"({target.config['vocab_size']})")
    dtype = model.model.embed_tokens.weight.dtype
    pages = pages_for_budget(model, page_size, int(kv_budget * DRAFT_KV_FRACTION), dtype)
    # Its positions never pass the target's context, nor its own (its rotary tables end there).
    proposer = DraftProposer(model, pages, page_size, device, min(manifest.context_limit, target.context_limit))
    if graphs and device.type == "cuda":
        from engine.speculative.draft_steps import DraftGraphs

        started = time.monotonic()
        proposer.use_steps(DraftGraphs, max_active, prefill_chunk)
        log.info("captured %d CUDA graphs of the draft model in %.1fs", proposer.steps.graph_count,
                 time.monotonic() - started)
    return proposer
