"""A live request's state as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from common.prefix_history import PrefixHistory
from common.protocol import ImageInput, Logprobs, SamplingParams
from engine.cache.checkpoint_cache import Checkpoint
from engine.speculative.acceptance import AcceptanceStats
from engine.speculative.ngram import NgramIndex


@dataclass
class SpeculationState:
    """What one request carries for speculation."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    ngram: NgramIndex = field(default_factory=NgramIndex)
    verifying: bool = False  # a verify round is in flight: the next step waits for its accepted length
    observed: set[str] = field(default_factory=set)  # proposers whose rounds this request has completed
    rounds: int = 0  # completed verify rounds (the dashboard marks them)


class Phase(enum.Enum):
    WAITING = "waiting"  # no slot yet (new, or preempted for recompute)
    PREFILL = "prefill"  # consuming its prompt
    DECODE = "decode"  # generating
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    owner: bytes  # the frontend's identity
    prompt_len: int
    tokens: list[int]  # prompt, then committed output tokens
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]  # ids that end generation (eos unless ignored, plus stop_token_ids)
    max_outputs: int  # output tokens allowed (max_tokens capped by the context)
    arrival: float
    message_ends: list[int] = field(default_factory=list)
    images: tuple[ImageInput, ...] = ()  # prompt images, in order (docs/design.md, Images)
    # Their placeholder tokens [first, end), atomic for chunking, and how far each moves the M-RoPE position of the
    # text after it (common/mrope.py).
    image_spans: tuple[tuple[int, int, int], ...] = ()
    cache_salt: str = ""  # requests of different salts share no cached prefix (common/prefix_history.py, salt_event)
    phase: Phase = Phase.WAITING
    slot: int = -1
    generation: int = 0
    pages: list[int] = field(default_factory=list)
    scheduled: int = 0  # positions whose KV has been submitted
    prefill_target: int = 0  # positions to consume before decoding (prompt, plus outputs after a preemption)
    # The last submitted step with a row of the request: while the scheduler's completed fence is below it, the
    # request has steps in flight (steps complete in fence order, so no count per step is kept).
    row_fence: int = 0
    copy_fence: int = 0  # the last submitted step with a KV page copy that reads the request's pages
    epoch: int = 0  # bumped whenever a plan touching the request would go stale (placed, preempted, ended)
    fresh: bool = False  # placed in a slot and not yet planned: its first row resets the slot's state
    cached_tokens: int = 0
    prompt_logprobs: list[Logprobs] = field(default_factory=list)  # pieces per prefill chunk, until published
    started: bool = False  # scheduled at least once (its queue time is measured)
    last_commit: float = 0.0  # monotonic time a token was last committed (or of arrival)
    last_publish: float = 0.0  # monotonic time output was last published; 0 before the first
    bursts: int = 0  # completed steps whose output was published
    # Prefix cache state (engine/scheduler/prefix.py):
    history: PrefixHistory | None = None  # keys of the request's prefixes
    cache_pages: set[int] = field(default_factory=set)  # pages of `pages` that the cache owns
    block_chain: list[Checkpoint] = field(default_factory=list)  # checkpoints of the request's complete blocks
    pinned: Checkpoint | None = None  # the deepest checkpoint whose pages the request reads
    published_ends: int = 0  # message ends at or below this are published (or reused)
    publish_from: int = 0  # PrefixReuse.publish has no work before the request's computed positions reach this
    room_fence: int = 0  # the step it waited for, for room to restore host blocks into (PrefixReuse.awaits_room)
    snapshots: dict[int, int] = field(default_factory=dict)  # a hybrid's state snapshots not yet published: end -> id
    finish_reason: str | None = None
    # A scored prefill (decisions): (position, label token ids) to read, and what was read, by position.
    label_queries: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    label_logits: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # An embedding (docs/design.md, Embeddings): "last" or "mean", and what its rows pooled so far (float32: the
    # last token's hidden state, or the sum of the hidden states computed since the prompt's first position).
    pooling: str = ""
    pooled: np.ndarray | None = None
    # Structured output: the request's llguidance matcher (engine/sampling/grammar.py), advanced on every committed token.
    # A constrained request's next sampled row needs its last token, so it is never the second step in flight.
    grammar: object | None = None
    speculation: SpeculationState | None = None  # acceptance history and proposer state, once it has drafted
    # The fields of the last decode row planned for it in this epoch, as a list: the next one is this list with its
    # position moved on (engine/scheduler/rows.py decode_row), copied into a Row. None at each new epoch, and while
    # min_tokens bans the stop ids.
    decode_row: list | None = None

    @property
    def last_fence(self) -> int:
        """The last submitted step that uses the request's pages."""
        return max(self.row_fence, self.copy_fence)

    @property
    def scored(self) -> bool:
        """A prefill-only request (a scored prefill or an embedding): it samples nothing and ends with its prompt."""
        return bool(self.label_queries) or bool(self.pooling)

    @property
    def first_computed(self) -> int:
        """The first position whose hidden state the request reads: prefix reuse must stop before it (a mean
        reads every position, so it reuses nothing)."""
        if self.label_queries:
            return min(p for p, _ in self.label_queries)
        return 0 if self.pooling == "mean" else self.prefill_target - 1

    def embedding(self) -> np.ndarray:
        """The pooled vector of an embedding whose prompt is computed."""
        return self.pooled / self.prompt_len if self.pooling == "mean" else self.pooled

    def atomic_length(self, start: int, length: int) -> int:
        """`length` tokens from `start`, moved off the inside of an image span: a chunk stops before the span, or,
        starting at or in it, takes it to its end (over the budget if need be), so its tower call happens once."""
        end = start + length
        for first, last, _ in self.image_spans:
            if first < end < last:
                return first - start if first > start else last - start
        return length

    def rope_shift(self, start: int, end: int) -> int | None:
        """Positions start..end as plain rope positions: each M-RoPE position of text after images is its index
        plus what those images moved it (t = h = w then). None when the range holds image tokens."""
        shift = 0
        for first, last, moved in self.image_spans:
            if first < end and start < last:
                return None
            if last <= start:
                shift += moved
        return shift

    @property
    def outputs(self) -> int:
        return len(self.tokens) - self.prompt_len
