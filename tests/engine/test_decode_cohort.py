"""Steady decode steps planned as columns (engine/scheduler/cohort.py) against the same steps planned row by row: a
scheduler whose steady path is switched off runs the same random workload beside one whose path is on, and every
plan, reservation and step result must agree (requests arriving and ending, stop tokens, min_tokens, pages running
out, two steps in flight)."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from common.protocol import SamplingParams
from engine.scheduler.plan import GENERATION, SLOT, Completion, DecodeRows, Plan, Row, fields
from engine.scheduler.request import Phase, Request
from engine.scheduler.scheduler import RequestScheduler

SLOTS, PAGE = 8, 4


class RowByRow(RequestScheduler):
    def _plan_steady(self) -> Plan | None:
        return None


def twin_requests(rng: random.Random, count: int) -> list[tuple[Request, Request]]:
    pairs = []
    for i in range(count):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 14))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), min_tokens=rng.choice((0, 0, 3)),
                                logprobs=rng.choice((None, None, 2)))
        stops = frozenset({0}) if rng.random() < 0.7 else frozenset()
        ends = [len(prompt) - 1] if rng.random() < 0.2 else []
        pairs.append(tuple(Request(f"r{i}", b"t", len(prompt), list(prompt), params, i, stops, params.max_tokens,
                                   float(i), message_ends=list(ends)) for _ in range(2)))
    return pairs


def result_of(result) -> tuple:
    return ([r.request_id for r in result.requests], result.token_ids, result.logprobs,
            [(f.request.request_id, f.reason) for f in result.finished])


@pytest.mark.parametrize("seed", range(12))
def test_columns_plan_what_rows_plan(seed: int) -> None:
    rng = random.Random(seed)
    pages, arrivals = rng.choice((12, 20, 64)), rng.choice((0.15, 0.03))  # (few arrivals: long steady stretches)
    steady, rows = (kind(SLOTS, 64, pages, PAGE, 8) for kind in (RequestScheduler, RowByRow))
    waiting = deque(twin_requests(rng, 40))
    in_flight: deque[tuple[int, Plan, Plan]] = deque()
    fence, columnar = 0, 0
    for _ in range(800):
        while waiting and rng.random() < arrivals:
            a, b = waiting.popleft()
            steady.add(a)
            rows.add(b)
        if len(in_flight) < 2:
            plan, twin = steady.plan(), rows.plan()
            assert (plan is None) == (twin is None)
            if plan is not None:
                columnar += type(plan.rows) is DecodeRows
                assert tuple(plan.rows) == tuple(twin.rows) and plan.kind == twin.kind == Plan(plan.rows).kind
                assert (plan.shape, plan.copies) == (twin.shape, twin.copies)
                fence += 1
                steady.commit(plan, fence)
                rows.commit(twin, fence)
                in_flight.append((fence, plan, twin))
        if in_flight and (len(in_flight) == 2 or rng.random() < 0.6):
            done, plan, twin = in_flight.popleft()
            sampled = [row for row in twin.rows if row.sample]
            tokens = tuple(rng.choice((0, rng.randrange(1, 50))) if rng.random() < 0.05 else rng.randrange(1, 50)
                           for _ in sampled)
            logprobs = tuple(None for _ in sampled)
            results = [scheduler.complete(Completion(done, tuple(r.slot for r in sampled),
                                                     tuple(r.generation for r in sampled), tokens, 0.01,
                                                     logprobs=logprobs), p)
                       for scheduler, p in ((steady, plan), (rows, twin))]
            assert result_of(results[0]) == result_of(results[1])
        if rng.random() < 0.02:  # a cancellation, also of a request with a step in flight
            live = [r for r in steady.slots if r is not None]
            if live:
                victim = rng.choice(live)
                steady.cancel(victim)
                rows.cancel(rows.get(victim.request_id))
        for a, b in zip(steady.slots, rows.slots):
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.request_id, a.tokens, a.pages, a.scheduled, a.row_fence, a.phase, a.publish_from) == \
                    (b.request_id, b.tokens, b.pages, b.scheduled, b.row_fence, b.phase, b.publish_from)
    assert columnar > 0  # the steady path ran


def test_decode_rows_read_as_rows() -> None:
    params = SamplingParams()
    made = [Row(slot, 3, 10 + slot, 1, None, (slot,), True, 5 + slot, params, slot, 6) for slot in range(3)]
    columns = [tuple(column) for column in zip(*made)]
    columns[2], columns[7] = np.array(columns[2]), np.array(columns[7])
    rows = DecodeRows(tuple(columns))
    assert rows[1] == made[1] and type(rows[1].start) is int  # one row, before the others are made
    assert len(rows) == 3 and tuple(rows) == tuple(made) and rows == tuple(made) and rows[1:] == tuple(made[1:])
    assert list(fields(rows, SLOT)) == [0, 1, 2] and list(fields(rows, GENERATION)) == [3, 3, 3]
    assert Plan(rows).kind == "decode" and Plan(rows).num_tokens == 3
    assert Phase.DECODE  # (the phase a cohort's requests are in)
