"""frames.pack on the CPU (docs/design.md, Executors and CUDA graphs): every field of a packed frame against its definition per row, and
the page-table patches of a run of frames against the tables they must leave on the device. Seconds, no model."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("triton")

from common.protocol import SamplingParams  # noqa: E402
from engine.executor.frames import PageTableMirror, host_views, make_layout, pack  # noqa: E402
from engine.scheduler.plan import Plan, Row  # noqa: E402

PAGE, WIDTH, SLOTS = 4, 8, 6
TRASH = SLOTS


def random_row(rng: random.Random, slot: int, generation: int, table: tuple[int, ...], extend: bool) -> Row:
    length = rng.randint(1, min(5, len(table) * PAGE)) if extend else 1
    start = rng.randint(0, len(table) * PAGE - length)
    tokens = tuple(rng.randint(0, 99) for _ in range(length)) if extend or rng.random() < 0.3 else None
    params = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_p=rng.choice([1.0, 0.9]),
                            top_k=rng.choice([0, 20]), min_p=rng.choice([0.0, 0.05]))
    return Row(slot, generation, start, length, tokens, table, rng.random() < 0.8, rng.randint(0, 50), params,
               rng.getrandbits(62), 3, rope_shift=rng.choice([0, 7]))


def check_fields(rows: list[Row], views: dict[str, np.ndarray], kind: str) -> None:
    count = len(rows)
    firsts = np.cumsum([0] + [row.length for row in rows])[:-1]
    expected = {
        "slot": [row.slot for row in rows], "query_start": firsts, "query_len": [row.length for row in rows],
        "context_len": [row.start + row.length for row in rows],
        "sample_row": [first + row.length - 1 for first, row in zip(firsts, rows)],
        "sample_slot": [row.slot if row.sample else TRASH for row in rows],
        "output_index": [row.output_index for row in rows], "seed": [row.seed for row in rows],
        "temperature": np.float32([row.sampling.temperature for row in rows]),
        "top_p": np.float32([row.sampling.top_p for row in rows]), "top_k": [row.sampling.top_k for row in rows],
        "min_p": np.float32([row.sampling.min_p for row in rows])}
    pads = {"slot": TRASH, "sample_slot": TRASH, "top_p": 1.0}
    for name, values in expected.items():
        assert views[name][:count].tolist() == list(np.asarray(values).tolist()), name
        assert (views[name][count:] == pads.get(name, 0)).all(), name
    positions = [p for row in rows for p in range(row.start, row.start + row.length)]
    table_of = [row.page_table for row in rows for _ in range(row.length)]
    tokens = [t for row in rows for t in (row.tokens if row.tokens else (-1,) * row.length)]
    assert views["token"][:len(tokens)].tolist() == tokens
    assert views["token_slot"][:len(tokens)].tolist() == [
        TRASH if row.tokens and kind == "extend" else row.slot for row in rows for _ in range(row.length)]
    assert views["position"][:len(positions)].tolist() == [
        p + row.rope_shift for row in rows for p in range(row.start, row.start + row.length)]
    assert views["slot_mapping"][:len(positions)].tolist() == [
        table[p // PAGE] * PAGE + p % PAGE for table, p in zip(table_of, positions)]
    assert (views["slot_mapping"][len(positions):] == -1).all()


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_pack_writes_each_rows_fields_and_patches_the_page_tables(kind: str) -> None:
    rng = random.Random(kind)
    layout = make_layout(kind, 32, SLOTS)
    frame = np.zeros(layout.patches + 2 * SLOTS * WIDTH, dtype=np.int32)
    views = host_views(frame, layout)
    mirror = PageTableMirror(SLOTS, WIDTH)
    device = np.full((SLOTS, WIDTH), -7, dtype=np.int64)  # what the page-table patches leave on the device
    generations, tables = [1] * SLOTS, [(i,) for i in range(SLOTS)]
    for _ in range(60):
        for slot in range(SLOTS):  # tables grow, sometimes a new request takes the slot, sometimes a page moves
            if rng.random() < 0.1:
                generations[slot], tables[slot] = generations[slot] + 1, (rng.randint(0, 99),)
            elif rng.random() < 0.1:
                tables[slot] = tables[slot][:-1] + (rng.randint(100, 199),)
            elif len(tables[slot]) < WIDTH and rng.random() < 0.3:
                tables[slot] = tables[slot] + (rng.randint(0, 99),)
            elif rng.random() < 0.2:
                tables[slot] = tuple(list(tables[slot]))  # an equal table, not the same tuple
        slots = rng.sample(range(SLOTS), rng.randint(0, SLOTS))
        rows = [random_row(rng, slot, generations[slot], tables[slot], kind == "extend") for slot in slots]
        frame[:] = 12345  # words from earlier frames must not matter
        words = pack(Plan(tuple(rows)), layout, frame, views, mirror, PAGE, TRASH)
        check_fields(rows, views, kind)
        patches = frame[layout.patches:words]
        assert frame[0] * 2 == len(patches)
        device.reshape(-1)[patches[0::2]] = patches[1::2]
        for row in rows:
            assert device[row.slot, :len(row.page_table)].tolist() == list(row.page_table)


def test_a_slots_request_fields_follow_its_request() -> None:
    """The fields pack keeps per slot are those of the slot's current request: a new generation with the very same
    SamplingParams (another seed) and new SamplingParams within a generation are read afresh."""
    layout = make_layout("decode", SLOTS, SLOTS)
    frame = np.zeros(layout.patches + 2 * SLOTS * WIDTH, dtype=np.int32)
    views, mirror = host_views(frame, layout), PageTableMirror(SLOTS, WIDTH)
    shared = SamplingParams(temperature=0.5, top_k=3)
    for generation, params, seed in [(1, shared, 11), (1, shared, 11), (2, shared, 22),
                                     (2, SamplingParams(temperature=0.9, top_p=0.5, min_p=0.1), 22)]:
        row = Row(1, generation, 0, 1, None, (3,), True, 0, params, seed, 1)
        pack(Plan((row,)), layout, frame, views, mirror, PAGE, TRASH)
        check_fields([row], views, "decode")
