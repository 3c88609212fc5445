"""What the scheduler hands the executor (a Plan) and what comes back (a Completion): both immutable
(docs/design.md, Scheduler and prefix checkpoints)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from common.protocol import ImageInput, Logprobs, SamplingParams


class Row(NamedTuple):
    """One request's part of a step: positions [start, start + length) of its sequence.

    A named tuple rather than a frozen dataclass: a step at 256 live requests makes 256 rows, and a tuple is built
    several times faster than a frozen dataclass, whose __init__ sets each field through object.__setattr__."""

    slot: int
    generation: int
    start: int
    length: int
    # Host tokens for prompt (or recompute) rows; None for a decode row, whose input is the token the previous
    # step sampled for this slot, still on the device.
    tokens: tuple[int, ...] | None
    page_table: tuple[int, ...]  # every page up to start + length
    sample: bool  # the last position yields an output token
    output_index: int  # index of that output token (the RNG position)
    sampling: SamplingParams
    seed: int
    prompt_len: int
    # On a request's first row after (re)starting: the tokens before `start` (reused from the prefix cache), so the
    # executor can rebuild the slot's penalty state. None on later rows.
    history: tuple[int, ...] | None = None
    # When the request asked for prompt logprobs: the prompt token each position of this row predicts.
    prompt_targets: tuple[int, ...] = ()
    epoch: int = 0  # the request's epoch when planned: commit refuses the plan if it changed
    banned: tuple[int, ...] = ()  # token ids the sampled token may not be (stop ids before min_tokens)
    # A scored prefill's label queries in [start, start + length): (position, label token ids) whose logits the
    # step reads at that position's hidden state. Such a row never samples.
    scores: tuple[tuple[int, tuple[int, ...]], ...] = ()
    images: tuple[ImageInput, ...] = ()  # the request's images (a vision model's prompt), shared, not copied
    # Added to the positions for the rotary (a vision model's text after images); None: the row holds image tokens,
    # whose positions only the eager step computes (engine/executor/images.py).
    rope_shift: int | None = 0
    # A verify row (docs/speculative.md): `tokens` is the last committed token then these drafts; every position
    # samples (output_index + i at position i) and the executor accepts the drafts the samples agree with.
    draft: tuple[int, ...] = ()
    proposer: str = ""
    # An embedding's row (docs/design.md, Embeddings): "mean", the sum of the row's final hidden states comes back;
    # "last", the final hidden state of the row's last token (the prompt's last). Such a row never samples.
    pool: str = ""


# Getters of Row fields, for passes over a step's rows at C speed (map(SLOT, rows), or `fields`): at 256 rows a Python
# loop per field costs several times more.
_GETTER_NAMES = ("slot", "generation", "start", "length", "tokens", "page_table", "sample", "output_index", "sampling",
                 "seed", "prompt_targets", "banned", "scores", "rope_shift", "draft", "pool")
(SLOT, GENERATION, START, LENGTH, TOKENS, PAGE_TABLE, SAMPLE, OUTPUT_INDEX, SAMPLING, SEED, PROMPT_TARGETS, BANNED,
 SCORES, ROPE_SHIFT, DRAFT, POOL) = _GETTERS = tuple(itemgetter(Row._fields.index(name)) for name in _GETTER_NAMES)
_FIELD_INDEX = {getter: Row._fields.index(name) for getter, name in zip(_GETTERS, _GETTER_NAMES)}


class DecodeRows(Sequence[Row]):
    """A steady decode step's rows as columns (docs/design.md, Scheduler and prefix checkpoints): the same requests as a step before, each moved
    on by a position. The scheduler builds them without a Row per request, and the step's hot readers (commit,
    complete, the graph executor's frame) take whole columns (`fields`); any other reader sees Rows, made once, on
    first use. `columns` are in Row field order: `start` and `output_index` int64 arrays, the others sequences."""

    __slots__ = ("columns", "_rows")

    def __init__(self, columns: tuple[Sequence, ...]) -> None:
        self.columns = columns
        self._rows: tuple[Row, ...] | None = None

    @property
    def rows(self) -> tuple[Row, ...]:
        if self._rows is None:  # (tuple.__new__ over zipped columns: no Python call per row)
            self._rows = tuple(map(tuple.__new__, repeat(Row), zip(*(
                column.tolist() if isinstance(column, np.ndarray) else column for column in self.columns))))
        return self._rows

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, index):  # type: ignore[override]
        if self._rows is None and isinstance(index, int):  # one row (the few a frame looks at), not all of them
            return tuple.__new__(Row, [column[index].item() if isinstance(column, np.ndarray) else column[index]
                                       for column in self.columns])
        return self.rows[index]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (tuple, DecodeRows)) and self.rows == tuple(other)

    __hash__ = None  # type: ignore[assignment]


def fields(rows: Sequence[Row], getter: itemgetter) -> Iterable:
    """One field of every row, in row order, for a pass at C speed: a DecodeRows's column as it is (an int64 array for
    start and output_index), else a map of the getter over the rows."""
    if type(rows) is DecodeRows:
        return rows.columns[_FIELD_INDEX[getter]]
    return map(getter, rows)


class DiskWrite(NamedTuple):
    """A host slot (and a hybrid's host snapshot row, -1: none) written to `key`'s file."""

    slot: int
    key: bytes
    length: int  # tokens the checkpoint covers
    snapshot: int = -1
    parent: bytes = b""  # the key of the block before the checkpoint's own (an exact checkpoint's index)


class DiskRead(NamedTuple):
    """`key`'s file read into a host slot (and its snapshot into a host snapshot row, -1: none)."""

    key: bytes
    slot: int
    snapshot: int = -1


@dataclass(frozen=True)
class DiskWork:
    """The disk tier's work of a step (docs/design.md, Host retention), done on the executor's disk thread once the
    step's copies are (its completion does not wait for it): host slots written to files, files read into host
    slots, files deleted (keys). Its end is reported apart, as DiskDone."""

    writes: tuple[DiskWrite, ...] = ()
    reads: tuple[DiskRead, ...] = ()
    erasures: tuple[bytes, ...] = ()


class DiskDone(NamedTuple):
    """The disk work of the step of `fence` is done; `unreadable`: the host slots of its reads whose files were not
    served (on any rank of a tensor-parallel group); `seconds`: what the work took on the disk thread (the slowest
    rank's)."""

    fence: int
    unreadable: tuple[int, ...] = ()
    seconds: float = 0.0


@dataclass(frozen=True, eq=False)
class Plan:
    rows: Sequence[Row]  # a tuple of Rows, or a steady decode step's DecodeRows
    # KV pages to copy (source, destination) before the step's forward: private copies of partial pages for exact
    # prefix checkpoints, made or reused. A plan may hold copies and no rows.
    copies: tuple[tuple[int, int], ...] = ()
    # A hybrid model's recurrent-state row copies (source row, destination row), in order, before the step's forward
    # and after its page copies: snapshots of slot rows at exact endpoints, and restores of snapshots into slot rows
    # (engine/scheduler/snapshot_rows.py). Slot s is row s; snapshot i is row max_active + i.
    state_copies: tuple[tuple[int, int], ...] = ()
    # The host tier's copies (docs/design.md, Host retention), made before everything else the step does: spills
    # (device page, host slot) of evicted checkpoints' pages, which the step may hand out, then restores (host slot,
    # device page) into requests' private pages.
    spills: tuple[tuple[int, int], ...] = ()
    restores: tuple[tuple[int, int], ...] = ()
    # A hybrid model's snapshots with them: spills (device state row, host snapshot row) with the spills, restores
    # (host snapshot row, device state row) with the restores, into a snapshot row that a state copy then reads.
    state_spills: tuple[tuple[int, int], ...] = ()
    state_restores: tuple[tuple[int, int], ...] = ()
    disk: DiskWork | None = None
    shape: tuple = ("", 0)  # (kind, capacity[, width]) whose cost the policy learns from this step's duration
    # Grammar masks (engine/sampling/grammar.py): int32 [len(rows), words] as bytes, a row per plan row; empty when no row
    # of the step is constrained. Set by the engine after commit, from the matchers' state after the last token.
    masks: bytes = b""
    # The masks come after submit (Executor.give_masks), once the steps before this one have completed and their
    # tokens have advanced the matchers: the step's forward runs meanwhile, and only its sampling waits for them.
    masks_later: bool = False

    @classmethod
    def of_kind(cls, kind: str, rows: Sequence[Row], **values: object) -> Plan:
        """A plan whose maker knows its kind (what `kind` would compute): no pass over the rows finds it again."""
        plan = cls(rows, **values)
        plan.__dict__["kind"] = kind  # where cached_property keeps what it computed
        return plan

    # Both cached: each is a pass over the rows, and the engine and executors ask several times a step.
    @cached_property
    def num_tokens(self) -> int:
        return sum(fields(self.rows, LENGTH))

    @cached_property
    def kind(self) -> str:
        if any(fields(self.rows, DRAFT)):
            return "verify"
        tokens = list(fields(self.rows, TOKENS))  # a decode row's are None; any other row's a non-empty tuple
        decode = None in tokens
        prefill = any(tokens)
        return "mixed" if decode and prefill else "decode" if decode else "prefill"


@dataclass(frozen=True)
class Completion:
    fence: int
    slots: tuple[int, ...]  # sampled rows, in plan order
    generations: tuple[int, ...]
    tokens: tuple[int, ...]
    duration: float  # seconds the step took to execute
    error: str | None = None  # the step failed; its requests fail with this message
    logprobs: tuple[Logprobs | None, ...] = ()  # per sampled row, when its request asked
    prompt_logprobs: tuple[tuple[int, int, Logprobs], ...] = ()  # (slot, generation, logprobs) per row that asked
    # (slot, generation, position, label logits) per label query of the plan's rows, in plan order.
    scores: tuple[tuple[int, int, int, tuple[float, ...]], ...] = ()
    # Per sampled row, when the plan verified drafts: how many of the row's drafts were accepted; `tokens` then
    # holds the target's token after them (the correction, or the bonus when all were accepted).
    accepted: tuple[int, ...] = ()
    # (slot, generation, row start, float32 vector) per pooling row of the plan (Row.pool), in plan order.
    pooled: tuple[tuple[int, int, int, np.ndarray], ...] = ()
    tier_seconds: float = 0.0  # what the plan's spills and restores took (0.0: not measured)
