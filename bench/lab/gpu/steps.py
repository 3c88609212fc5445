"""Driving an executor directly, for the GPU evidence: synthetic decode plans, timed steps, and greedy generation
through the real scheduler (recording the plans, so another executor can replay exactly the same steps)."""

from __future__ import annotations

import select
import time

from common.protocol import SamplingParams
from engine.executor.base import Executor
from engine.scheduler.plan import Completion, Plan, Row
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every weight but the embedding table (of which it reads a row), unless tied. Each
    storage once: the kernel path's fused q/k/v and gate/up products keep their parts as views of the fused weight."""
    embed = model.model.embed_tokens.weight
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    if not model.config.tie_word_embeddings:
        storages.pop(embed.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def decode_plan(batch: int, context: int, page_size: int) -> Plan:
    """`batch` slots each decoding its token at position context-1 over its own pages."""
    pages = -(-context // page_size)
    greedy = SamplingParams(temperature=0.0)
    return Plan(tuple(Row(slot, 1, context - 1, 1, None, tuple(range(slot * pages, (slot + 1) * pages)), True, 0,
                          greedy, 0, context - 1) for slot in range(batch)))


def prompt_row(slot: int, new: int, cached: int, page_size: int, pages: int | None = None) -> Row:
    """`new` prompt tokens of slot's sequence after `cached` tokens already in its pages (a prompt that hits the
    prefix cache; 0: a prompt alone), sampling its first output token; the slot owns `pages` pages (by default those
    the tokens fill) from slot * pages on."""
    pages = pages or -(-(cached + new) // page_size)
    ids = tuple((slot * 7919 + i * 31) % 30000 + 1 for i in range(new))
    return Row(slot, 1, cached, new, ids, tuple(range(slot * pages, (slot + 1) * pages)), True, 0,
               SamplingParams(temperature=0.0), 0, cached + new)


def extend_plan(new: int, cached: int, page_size: int) -> Plan:
    """One sequence's prompt step (prompt_row of slot 0)."""
    return Plan((prompt_row(0, new, cached, page_size),))


def wait(executor: Executor) -> list[tuple[Plan, Completion]]:
    while not (done := executor.poll()):
        select.select([executor.wake_fd], [], [], 5)
    return done


def time_steps(executor: Executor, plan: Plan, steps: int, warmup: int = 3) -> float:
    """Seconds per step in steady state with two steps in flight, as the engine loop keeps them."""
    for _ in range(warmup):
        executor.submit(plan)
        wait(executor)
    started = time.perf_counter()
    submitted = done = 0
    while done < steps:
        while executor.can_submit() and submitted < steps:
            executor.submit(plan)
            submitted += 1
        results = wait(executor)
        assert all(c.error is None for _, c in results), results[0][1].error
        done += len(results)
    return (time.perf_counter() - started) / steps


def generate(executor: Executor, scheduler: RequestScheduler, prompts: list[list[int]],
             max_tokens: int) -> tuple[list[list[int]], list[Plan]]:
    """Greedy outputs of each prompt, and the plans in submission order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [Request(f"r{i}", b"bench", len(p), list(p), params, 0, frozenset(), max_tokens, float(i))
                for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    plans = []
    while scheduler.has_work():
        while executor.can_submit() and (plan := scheduler.plan()) is not None:
            scheduler.commit(plan, executor.next_fence())
            executor.submit(plan)
            plans.append(plan)
        for plan, completion in wait(executor):
            assert completion.error is None, completion.error
            scheduler.complete(completion, plan)
    while not executor.can_submit():
        wait(executor)
    return [r.tokens[r.prompt_len:] for r in requests], plans


def replay(executor: Executor, plans: list[Plan]) -> list[tuple[int, ...]]:
    """The sampled tokens of each plan, run in order with two in flight."""
    tokens: list[tuple[int, ...]] = []
    queue = list(plans)
    while len(tokens) < len(plans):
        while executor.can_submit() and queue:
            executor.submit(queue.pop(0))
        for _, completion in wait(executor):
            assert completion.error is None, completion.error
            tokens.append(completion.tokens)
    return tokens
