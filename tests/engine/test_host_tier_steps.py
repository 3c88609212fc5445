"""The host tier through the real scheduler and executor (tests/support/engine_harness.py): a conversation whose pages
were evicted to the host continues from its restored pages with the tokens a cache that never evicted it gives; on a
GPU through the graph executor, its spills and restores on the copy stream into pinned memory."""

from __future__ import annotations

import pytest
import torch

from engine.model.backends.select import use_backend
from engine.model.kv_quant import FP8
from tests.support.engine_harness import Harness, tiny_model

PAGE = 16


def prompt(length: int, seed: int) -> list[int]:
    torch.manual_seed(seed)
    return torch.randint(0, 300, (length,)).tolist()


def generate(harness: Harness, tokens: list[int], max_tokens: int = 6) -> tuple[int, list[int]]:
    request = harness.add(tokens, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    harness.run()
    return request.cached_tokens, request.tokens[len(tokens):]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_a_conversation_evicted_to_the_host_continues_as_if_never_evicted(device: str, kv_dtype: torch.dtype) -> None:
    """Also with an FP8 cache (engine/model/kv_quant.py), whose host slots hold its e4m3 bytes."""
    model = tiny_model().to(device)
    model.kv_dtype = kv_dtype
    if device == "cuda":  # the graph executor's steps run the kernel path
        use_backend(model, "triton", 256)
    first = prompt(100, seed=1)
    small = Harness(model, num_pages=16, page_size=PAGE, host_slots=32, graphs=True, device=device)
    assert small.executor.kv_cache.dtype == model.cache_dtype == small.executor.host_pages.slots.dtype
    _, reply = generate(small, first)
    for seed in range(2, 6):  # 7 pages each through a cache of 16: the first conversation's pages leave
        generate(small, prompt(100, seed))
    second = first + reply + prompt(20, seed=9)
    # On a GPU the tiny model computes these tokens faster than pages copy, and the policy rightly recomputes
    # (tests/engine/test_host_restore_policy.py); with no copy measured it restores, which is what this test checks.
    small.scheduler.prefix.tiers.page_copy_seconds.clear()
    cached, tokens = generate(small, second)
    counters = small.scheduler.counters
    small.close()
    fresh = Harness(model, num_pages=64, page_size=PAGE, device=device)
    expected_cached, expected = generate(fresh, second)
    fresh.close()
    assert counters["host_spills"] > 0 and counters["host_restores"] >= len(first) // PAGE
    assert expected_cached == 0 and cached >= len(first) // PAGE * PAGE
    assert tokens == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_hybrid_conversation_evicted_to_the_host_continues_from_its_restored_snapshot(device: str) -> None:
    """A hybrid model's exact checkpoint leaves the device with its snapshot (two snapshot rows there): its page and
    its snapshot row move to the host, and the next turn restores both (the snapshot through a snapshot row in
    transit) and continues with the tokens of a full computation; on a GPU through the graph executor, the snapshot
    rows pinned and copied on the copy stream, the transit row's copy into the slot's row in the step's frame."""
    model = tiny_model(family="qwen3_5").to(device)
    if device == "cuda":
        use_backend(model, "triton", 256)
    first = prompt(100, seed=1)
    small = Harness(model, num_pages=16, page_size=PAGE, max_active=2, snapshots=2, host_slots=32, host_snapshots=10,
                    graphs=True, device=device)
    _, reply = generate(small, first)
    for seed in range(2, 5):  # their snapshots and pages push the first conversation's out to the host
        generate(small, prompt(100, seed))
    second = first + reply + prompt(20, seed=9)
    small.scheduler.prefix.tiers.page_copy_seconds.clear()  # (as above: restore whatever the copies cost)
    cached, tokens = generate(small, second)
    counters = small.scheduler.counters
    small.close()
    fresh = Harness(model, num_pages=64, page_size=PAGE, snapshots=0, device=device)
    expected_cached, expected = generate(fresh, second)
    fresh.close()
    assert counters["host_snapshot_spills"] > 0 and counters["host_snapshot_restores"] == 1
    assert expected_cached == 0 and cached == len(first) + len(reply) - 1  # the first turn's terminal endpoint
    assert tokens == expected
