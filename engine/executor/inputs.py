"""Turn a Plan into the tensors one model step reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, ne

import numpy as np
import torch

from common.protocol import SamplingParams
from engine.model.attention import AttentionMetadata, PrefillSpan
from engine.model.recurrent_state import RecurrentRows, RecurrentState
from engine.sampling.sampler import SamplingTensors
from engine.scheduler.plan import Plan, Row

PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY = (
    attrgetter(name) for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"))


def any_penalty(params: Sequence[SamplingParams]) -> bool:
    """Whether any of these asks for a penalty: a pass at C speed per parameter, since the graph executor asks
    for every row of every step (a number is true when not 0)."""
    return any(map(PRESENCE_PENALTY, params)) or any(map(FREQUENCY_PENALTY, params)) or \
        any(map(ne, map(REPETITION_PENALTY, params), repeat(1)))


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]; decode rows hold 0 until filled from the device-side slot tokens
    positions: torch.Tensor  # [T]
    device_token_rows: torch.Tensor  # [Bd] rows whose input is the slot's last sampled token
    device_token_slots: torch.Tensor  # [Bd]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] step rows whose hidden state is sampled: one per sampled row, W per verify row
    sample_slots: torch.Tensor  # [S]
    sampling: SamplingTensors


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def sampled_masks(plan: Plan, device: torch.device) -> torch.Tensor | None:
    """The grammar masks of the plan's sampled rows, or None when the step is unconstrained."""
    if not plan.masks:
        return None
    masks = np.frombuffer(plan.masks, dtype=np.int32).reshape(len(plan.rows), -1)
    # A verify row (never constrained: its mask allows everything) samples every position.
    rows = [i for i, row in enumerate(plan.rows) if row.sample for _ in range(row.length if row.draft else 1)]
    return torch.from_numpy(masks[rows]).to(device)


def build_inputs(plan: Plan, page_size: int, device: torch.device, state: RecurrentState | None = None
                 ) -> StepInputs:
    """`state`: a hybrid model's recurrent state, whose row each request continues is its slot's."""
    ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    device_rows, device_slots = [], []
    decode_rows, decode_tables, decode_lens, decode_slots, span_slots = [], [], [], [], []
    prefills: list[PrefillSpan] = []
    sample_rows = []
    sampled: list[tuple[Row, int]] = []  # (row, offset of the sampled position after the row's first sample)
    for row in plan.rows:
        first = len(ids)
        end = row.start + row.length
        if row.tokens is None:
            device_rows.append(first)
            device_slots.append(row.slot)
            ids.append(0)
        else:
            ids.extend(row.tokens)
        positions.extend(range(row.start, end))
        slot_mapping.extend(row.page_table[p // page_size] * page_size + p % page_size for p in range(row.start, end))
        if row.length == 1:
            decode_rows.append(first)
            decode_tables.append(row.page_table)
            decode_lens.append(end)
            decode_slots.append(row.slot)
        else:
            span_slots.append(row.slot)
            prefills.append(PrefillSpan(first, row.length, end, _tensor(list(row.page_table), torch.int64, device)))
        if row.sample:
            count = row.length if row.draft else 1  # a verify row samples every position
            sample_rows.extend(range(first + row.length - count, first + row.length))
            sampled.extend((row, i) for i in range(count))
    width = max((len(t) for t in decode_tables), default=0)
    padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
    meta = AttentionMetadata(
        slot_mapping=_tensor(slot_mapping, torch.int64, device),
        decode_rows=_tensor(decode_rows, torch.int64, device),
        decode_page_tables=_tensor(padded, torch.int64, device).view(len(padded), width),
        decode_context_lens=_tensor(decode_lens, torch.int64, device),
        prefills=tuple(prefills), page_size=page_size,
        recurrent=None if state is None else RecurrentRows(state, _tensor(decode_slots, torch.int64, device),
                                                           tuple(span_slots)))
    sampling = SamplingTensors(
        temperature=_tensor([r.sampling.temperature for r, _ in sampled], torch.float32, device),
        top_p=_tensor([r.sampling.top_p for r, _ in sampled], torch.float32, device),
        top_k=_tensor([r.sampling.top_k for r, _ in sampled], torch.int64, device),
        min_p=_tensor([r.sampling.min_p for r, _ in sampled], torch.float32, device),
        seed=_tensor([r.seed for r, _ in sampled], torch.int64, device),
        position=_tensor([r.output_index + i for r, i in sampled], torch.int64, device),
        presence_penalty=_tensor([r.sampling.presence_penalty for r, _ in sampled], torch.float32, device),
        frequency_penalty=_tensor([r.sampling.frequency_penalty for r, _ in sampled], torch.float32, device),
        repetition_penalty=_tensor([r.sampling.repetition_penalty for r, _ in sampled], torch.float32, device),
        banned_rows=_tensor([i for i, (r, _) in enumerate(sampled) for _ in r.banned], torch.int64, device),
        banned_ids=_tensor([t for r, _ in sampled for t in r.banned], torch.int64, device),
        allowed=sampled_masks(plan, device),
        all_greedy=all(r.sampling.temperature == 0 for r, _ in sampled),
        any_penalty=any_penalty([r.sampling for r, _ in sampled]))
    return StepInputs(
        input_ids=_tensor(ids, torch.int64, device), positions=_tensor(positions, torch.int64, device),
        device_token_rows=_tensor(device_rows, torch.int64, device),
        device_token_slots=_tensor(device_slots, torch.int64, device), meta=meta,
        sample_rows=_tensor(sample_rows, torch.int64, device),
        sample_slots=_tensor([r.slot for r, _ in sampled], torch.int64, device), sampling=sampling)
