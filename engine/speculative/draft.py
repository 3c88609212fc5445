"""The draft-model proposer: a second, smaller core with the same tokenizer, in the engine process, with KV pages of
its own; it proposes up to D tokens greedily, one batched forward per position (docs/speculative.md).

Per request slot it remembers which tokens its KV holds. Before proposing it feeds what it has not seen (the whole
prompt the first time, then the tokens committed since its last proposal, which start where its own drafts stopped
being accepted), so its KV always agrees with the request's committed tokens. It runs on the scheduler's thread
when a verify round is planned: on the CPU eagerly, one batched forward per position with the host reading each
position's argmax; on a GPU through `steps` (engine/speculative/draft_steps.py: captured graphs chained on the
device, one host sync per round).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.cache.page_allocator import PageAllocator
from engine.executor.eager import kv_cache_shape
from engine.executor.inputs import build_inputs
from engine.model.decoder import CausalLM
from engine.scheduler.plan import Plan, Row
from engine.scheduler.request import Request
from engine.speculative.draft_round import GREEDY, Lane, RoundSteps

log = logging.getLogger("flare.engine")

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

    def __init__(self, model: CausalLM, num_pages: int, page_size: int, device: torch.device,
                 context_limit: int | None = None) -> None:
        """`context_limit`: the draft's own (its rotary tables end there on the kernel path); a request whose
        drafts would reach past it proposes nothing."""
        self.model = model
        self.page_size = page_size
        self.device = device
        self.context_limit = context_limit
        self.pages = PageAllocator(num_pages)
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_pages, page_size), dtype=dtype, device=device)
        self._slots: dict[int, _SlotState] = {}
        self.steps: RoundSteps | None = None  # set by use_steps

    def use_steps(self, steps: type[RoundSteps], max_active: int, prefill_chunk: int) -> None:
        """Run rounds as step frames (DraftSteps eagerly, DraftGraphs as captured graphs) on this proposer's KV."""
        if self.context_limit is None:
            raise ValueError("step frames need the draft's context limit (their page tables' width)")
        self.steps = steps(self.model, self.kv_cache, self.page_size, max_active, self.context_limit,
                           prefill_chunk, self.device)

    def available(self, request: Request, depth: int) -> int:
        return depth

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, int]], live: set[tuple[int, int]]) -> list[tuple[int, ...]]:
        self._forget(live)
        lanes: list[_Lane] = []
        for request, depth in batch:
            state = self._state(request)
            # Without pages for its drafts a request proposes nothing this round (it decodes plainly).
            end = len(request.tokens) + depth - 1  # positions the round's KV reaches
            if (self.context_limit is None or end <= self.context_limit) and self._reserve(state, end):
                # Re-feed at least the last token: its logits give the first draft.
                common = min(_common_prefix(state.known, request.tokens), len(request.tokens) - 1)
                del state.known[common:]
                lanes.append(_Lane(request, depth, state, request.tokens[common:]))
        if self.steps is None:
            self._propose_eagerly(lanes)
        elif lanes:
            self._propose_in_frames(lanes)
        drafts = {lane.request: tuple(lane.drafts) for lane in lanes}
        return [drafts.get(request, ()) for request, _ in batch]

    def _propose_eagerly(self, lanes: list[_Lane]) -> None:
        for position in range(max((lane.depth for lane in lanes), default=0)):
            active = [lane for lane in lanes if position < lane.depth]
            for lane, token in zip(active, self._step(active)):
                lane.drafts.append(token)
                lane.feed = [token]

    def _propose_in_frames(self, lanes: list[_Lane]) -> None:
        lanes = sorted(lanes, key=lambda lane: -lane.depth)
        try:
            drafts = self.steps.propose([Lane(lane.request.slot, lane.state.generation, len(lane.state.known),
                                              tuple(lane.feed), tuple(lane.state.pages), lane.depth)
                                         for lane in lanes])
        except Exception:  # a failed round proposes nothing: its requests decode plainly, the engine goes on
            log.exception("a draft round failed")
            for lane in lanes:
                lane.state.known.clear()  # what the KV holds is unknown: the next round feeds everything
            return
        for lane, proposal in zip(lanes, drafts):
            lane.state.known.extend(lane.feed)  # and every draft but the last, as the eager steps feed them
            lane.state.known.extend(proposal[:-1])
            lane.drafts = list(proposal)

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
