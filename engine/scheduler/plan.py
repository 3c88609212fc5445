"""What the scheduler hands the executor (a Plan) and what comes back (a Completion): both immutable
(DESIGN.md, Scheduling)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple

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


# Getters of Row fields, for passes over a step's rows at C speed (map(SLOT, rows)): at 256 rows a Python loop per
# field costs several times more.
(SLOT, GENERATION, START, LENGTH, TOKENS, PAGE_TABLE, SAMPLE, OUTPUT_INDEX, SAMPLING, SEED, PROMPT_TARGETS, SCORES,
 ROPE_SHIFT, DRAFT) = (itemgetter(Row._fields.index(name)) for name in (
    "slot", "generation", "start", "length", "tokens", "page_table", "sample", "output_index", "sampling", "seed",
    "prompt_targets", "scores", "rope_shift", "draft"))


@dataclass(frozen=True, eq=False)
class Plan:
    rows: tuple[Row, ...]
    # KV pages to copy (source, destination) before the step's forward: private copies of partial pages for exact
    # prefix checkpoints, made or reused. A plan may hold copies and no rows.
    copies: tuple[tuple[int, int], ...] = ()
    shape: tuple = ("", 0)  # (kind, capacity[, width]) whose cost the policy learns from this step's duration
    # Grammar masks (engine/grammar.py): int32 [len(rows), words] as bytes, a row per plan row; empty when no row
    # of the step is constrained. Set by the engine after commit, from the matchers' state after the last token.
    masks: bytes = b""

    @classmethod
    def of_kind(cls, kind: str, rows: tuple[Row, ...], **fields: object) -> Plan:
        """A plan whose maker knows its kind (what `kind` would compute): no pass over the rows finds it again."""
        plan = cls(rows, **fields)
        plan.__dict__["kind"] = kind  # where cached_property keeps what it computed
        return plan

    # Both cached: each is a pass over the rows, and the engine and executors ask several times a step.
    @cached_property
    def num_tokens(self) -> int:
        return sum(row.length for row in self.rows)

    @cached_property
    def kind(self) -> str:
        if any(map(DRAFT, self.rows)):
            return "verify"
        tokens = list(map(TOKENS, self.rows))  # a decode row's are None; any other row's a non-empty tuple
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
