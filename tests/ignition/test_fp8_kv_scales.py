"""KV cache scales of an FP8 checkpoint (compressed-tensors' and vLLM's `k_scale`, `v_scale` per attention layer):
ignition keeps them, one per KV head, each tensor-parallel rank reads its heads' scales, and the engine's FP8 KV
cache stores each key and value over its head's scale and reads it back times it (engine/model/kv_quant.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.executor.eager import kv_cache_shape
from engine.model.attention import AttentionMetadata, PagedAttention, PrefillSpan
from engine.model.loader import load_model
from engine.model.sharding import Shard, read_weights
from ignition.main import main as ignition
from tests.e2e.test_families import build_checkpoint
from tests.ignition.test_fp8 import LLAMA
from tests.support.engine_harness import tiny_model
from tests.support.fp8_checkpoints import TENSOR_STATIC, rewrite_as_fp8

PAGE = 16


def prefill_logits(model, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The logits of one prefill span over a fresh cache of `dtype`."""
    length = len(tokens)
    pages = -(-length // PAGE)
    cache = torch.zeros(kv_cache_shape(model, pages, PAGE), dtype=dtype)
    empty = torch.zeros(0, dtype=torch.int64)
    meta = AttentionMetadata(torch.arange(length), empty, empty[None], empty,
                             (PrefillSpan(0, length, length, torch.arange(pages)),), PAGE)
    with torch.no_grad():
        return model.logits(model(torch.tensor(tokens), torch.arange(length), cache, meta))


def test_kv_scales_reach_the_core_per_head_and_scale_the_fp8_cache(tmp_path: Path) -> None:
    hf_dir = build_checkpoint("llama", tmp_path, LLAMA)
    rewrite_as_fp8(hf_dir, TENSOR_STATIC)
    state = load_file(hf_dir / "model.safetensors")
    kv_heads = json.loads((hf_dir / "config.json").read_text())["num_key_value_heads"]
    per_head = torch.linspace(0.02, 0.05, kv_heads)
    # Layer 0 as llm-compressor writes a static per-tensor scale; layer 1 calibrated per head.
    state |= {"model.layers.0.self_attn.k_scale": torch.tensor(0.03), "model.layers.0.self_attn.v_scale":
              torch.tensor([0.01]), "model.layers.1.self_attn.k_scale": per_head,
              "model.layers.1.self_attn.v_scale": per_head.flip(0)}
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    core = tmp_path / "core"
    assert ignition(["export", str(hf_dir), str(core)]) == 0
    written = load_file(core / "model.safetensors")
    assert torch.equal(written["model.layers.0.self_attn.k_scale"], torch.full((kv_heads,), 0.03))
    assert torch.equal(written["model.layers.1.self_attn.v_scale"], per_head.flip(0))

    _, model = load_model(core, torch.device("cpu"), fp8_kv=True)
    attention = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert torch.equal(attention[1].kv_scale, torch.stack([per_head, per_head.flip(0)]))
    tokens = list(range(3, 40))
    got = prefill_logits(model, tokens, model.cache_dtype)

    def rounded(module: PagedAttention, args: tuple) -> tuple:  # e4m3 over the scales, by hand, into an fp32 cache
        q, k, v, *rest = args
        k_scale, v_scale = module.kv_scale[0][:, None], module.kv_scale[1][:, None]
        return (q, (k / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * k_scale,
                (v / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * v_scale, *rest)

    hooks = [m.register_forward_pre_hook(rounded) for m in attention]
    assert torch.equal(got, prefill_logits(model, tokens, torch.float32))
    for hook in hooks:
        hook.remove()
    # The scales matter: the same model reading its cache as if they were 1 (or an fp32 cache) computes otherwise.
    for module in attention:
        module.kv_scale = torch.ones_like(module.kv_scale)
    assert not torch.equal(got, prefill_logits(model, tokens, model.cache_dtype))


def test_each_rank_reads_its_kv_heads_scales(tmp_path: Path) -> None:
    """Under tensor parallelism a layer's KV scales split as its K and V heads do (engine/model/sharding.py)."""
    config = tiny_model().config  # 4 heads, 2 KV heads: one a rank over 2 ranks; over 4, each on two ranks
    scales = torch.tensor([0.5, 2.0])
    path = tmp_path / "model.safetensors"
    save_file({"model.layers.0.self_attn.k_scale": scales, "model.layers.0.self_attn.v_scale": scales * 3}, path)
    for world, expected in ((2, [[0.5], [2.0]]), (4, [[0.5], [0.5], [2.0], [2.0]])):
        for rank in range(world):
            state = read_weights(path, torch.device("cpu"), Shard.of(config, rank, world))
            assert state["model.layers.0.self_attn.k_scale"].tolist() == expected[rank]
            assert state["model.layers.0.self_attn.v_scale"].tolist() == [3 * s for s in expected[rank]]
