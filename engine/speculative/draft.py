"""The draft-model proposer: a second, smaller core with the same tokenizer, in the engine process, with KV pages of
its own; it proposes up to D tokens greedily, one batched forward per position (docs/speculative.md).

Per request slot it remembers which tokens its KV holds. Before proposing it feeds what it has not seen (the whole
prompt the first time, then the tokens committed since its last proposal, which start where its own drafts stopped
being accepted), so its KV always agrees with the request's committed tokens. Its steps are eager (plain torch on
the CPU; the same model code on a GPU), run by the scheduler's thread when a verify round is planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol import SamplingParams
from engine.cache.page_allocator import PageAllocator
from engine.executor.eager import kv_cache_shape
from engine.executor.inputs import build_inputs
from engine.model.decoder import CausalLM
from engine.scheduler.plan import Plan, Row
from engine.scheduler.request import Request

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class _SlotState:
    generation: int
    known: list[int] = field(default_factory=list)  # tokens whose KV the draft holds, positions 0..len-1
    pages: list[int] = field(default_factory=list)


@dataclass(eq=False)
class _Lane:
    request: Request
    depth: int
    state: _SlotState
    feed: list[int]  # tokens to feed next
    drafts: list[int] = field(default_factory=list)


class DraftProposer:
    name = "draft"

    def __init__(self, model: CausalLM, num_pages: int, page_size: int, device: torch.device) -> None:
        self.model = model
        self.page_size = page_size
        self.device = device
        self.pages = PageAllocator(num_pages)
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_pages, page_size), dtype=dtype, device=device)
        self._slots: dict[int, _SlotState] = {}

    def available(self, request: Request, depth: int) -> int:
        return depth

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, int]], live: set[tuple[int, int]]) -> list[tuple[int, ...]]:
        self._forget(live)
        lanes: list[_Lane] = []
        for request, depth in batch:
            state = self._state(request)
            # Without pages for its drafts a request proposes nothing this round (it decodes plainly).
            if self._reserve(state, len(request.tokens) + depth - 1):
                # Re-feed at least the last token: its logits give the first draft.
                common = min(_common_prefix(state.known, request.tokens), len(request.tokens) - 1)
                del state.known[common:]
                lanes.append(_Lane(request, depth, state, request.tokens[common:]))
        for position in range(max((lane.depth for lane in lanes), default=0)):
            active = [lane for lane in lanes if position < lane.depth]
            for lane, token in zip(active, self._step(active)):
                lane.drafts.append(token)
                lane.feed = [token]
        drafts = {lane.request: tuple(lane.drafts) for lane in lanes}
        return [drafts.get(request, ()) for request, _ in batch]

    def _step(self, lanes: list[_Lane]) -> list[int]:
        """Feed each lane its new tokens; the greedy next token of each."""
        rows = []
        for lane in lanes:
            state = lane.state
            start, end = len(state.known), len(state.known) + len(lane.feed)
            rows.append(Row(slot=lane.request.slot, generation=state.generation, start=start, length=len(lane.feed),
                            tokens=tuple(lane.feed), page_table=tuple(state.pages[: -(-end // self.page_size)]),
                            sample=True, output_index=0, sampling=GREEDY, seed=0, prompt_len=end))
            state.known.extend(lane.feed)
        step = build_inputs(Plan(tuple(rows)), self.page_size, self.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
        return self.model.logits(hidden[step.sample_rows]).argmax(dim=-1).tolist()

    def _state(self, request: Request) -> _SlotState:
        state = self._slots.get(request.slot)
        if state is None or state.generation != request.generation:
            if state is not None:
                self.pages.release(state.pages, 0)
            state = self._slots[request.slot] = _SlotState(request.generation)
        return state

    def _reserve(self, state: _SlotState, positions: int) -> bool:
        needed = -(-positions // self.page_size) - len(state.pages)
        if needed > self.pages.free_count:
            return False
        if needed > 0:
            state.pages.extend(self.pages.allocate(needed))
        return True

    def _forget(self, live: set[tuple[int, int]]) -> None:
        """Pages of requests that ended go back (the draft runs synchronously: nothing of it is in flight)."""
        for slot, state in list(self._slots.items()):
            if (slot, state.generation) not in live:
                self.pages.release(state.pages, 0)
                del self._slots[slot]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
