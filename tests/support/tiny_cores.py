"""Tiny random cores of every family, written as ignition writes them (a manifest beside one safetensors file): the
engine's multi-process and kernel-path tests serve them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from common.manifest import FORMAT_VERSION, Capacities, GenerationDefaults, Manifest, sha256_file, write_manifest
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
from tests.support.engine_harness import FAMILY_CONFIGS

# 6 heads over 3 KV heads: 2 ranks split the KV groups 2 + 1, 3 ranks 1 + 1 + 1; 320 vocabulary rows and 160 MLP
# columns do not split evenly over 3 ranks.
TINY = {"vocab_size": 320, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def write_tiny_core(core: Path, family: str) -> Path:
    """A random core of the family at TINY's sizes (with the family's features, tests/support/engine_harness.py)."""
    config = {**TINY, **FAMILY_CONFIGS[family]}
    torch.manual_seed(0)
    model = CausalLM(DecoderConfig.from_hf(family, config))
    with torch.no_grad():  # larger weights than the default init, so outputs vary from token to token
        for p in model.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, core / "model.safetensors")
    write_manifest(core, Manifest(
        format_version=FORMAT_VERSION, architecture=family, config=config, dtype="float32", served_names=["tiny"],
        checkpoint="random", context_limit=1024, eos_token_ids=[], generation=GenerationDefaults(),
        capacities=Capacities(max_active=8, page_size=16, prefill_chunk_size=48, kv_cache_bytes=1 << 22),
        files={"model.safetensors": sha256_file(core / "model.safetensors")}))
    return core
