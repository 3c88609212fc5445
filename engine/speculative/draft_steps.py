"""The draft model's proposal round as step frames; on CUDA, graphs captured at start and chained on the device, one
host sync per round (docs/speculative.md, GPU).

A round is the catch-up feed (each lane's tokens the draft has not seen: the prompt the first time, then the tokens
committed since), as extend frames of at most the largest extend capacity (a long first prompt takes several),
whose greedy samples become each lane's slot token; then one decode frame per further draft position, whose rows
have no host token, so they read the slot token the previous frame sampled (frames.pack): position i's argmax is
position i + 1's input without the host. Lanes come deepest first, so the lanes still drafting at position i are a
prefix and frame i's samples are theirs in order. Each frame's samples are copied aside on the device; one copy back
and one sync end the round. The catch-up runs in extend graphs rather than eagerly: an eager step of even a small
draft is a few hundred kernel launches from Python, more host time than a graph step of the target.

The building blocks are the graph executor's: layouts and packing (engine/executor/frames.py), the step functions
(engine/executor/graph_step.py) and capture (engine/executor/graph.py). `DraftSteps` runs the step functions
eagerly (what the CPU tests check under the Triton interpreter); `DraftGraphs` replays them as captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.executor.frames import Layout, PageTableMirror, host_views, make_layout, pack
from engine.executor.graph import capture_graphs, decode_capacities, extend_capacities
from engine.executor.graph_step import StaticBuffers, model_step, sample_step
from engine.model.decoder import CausalLM
from engine.scheduler.plan import Plan, Row
from engine.speculative.acceptance import MAX_DEPTH
from engine.speculative.draft_round import GREEDY, Lane

HOST_FRAMES = MAX_DEPTH + 1  # a round of one catch-up frame fills no more; longer catch-ups wait to reuse them
H2D = 1  # cudaMemcpyKind


@dataclass(frozen=True)
class Frame:
    plan: Plan
    kind: str  # "extend" (catch-up) or "decode" (one token per lane)
    position: int  # which draft the frame's samples are (0: the first, from the catch-up)
    first_lane: int  # the frame's sampled rows 0..count-1 are lanes first_lane.. in order
    count: int


def round_frames(lanes: list[Lane], chunk: int) -> list[Frame]:
    """A round's frames, lanes deepest first; catch-up frames hold at most `chunk` tokens."""
    if any(a.depth < b.depth for a, b in zip(lanes, lanes[1:])):
        raise ValueError("lanes must come deepest first")
    frames: list[Frame] = []
    rows: list[Row] = []
    first_lane = used = 0
    for index, lane in enumerate(lanes):
        offset = 0
        while offset < len(lane.feed):
            if used == chunk:
                frames.append(_catch_up(rows, first_lane))
                rows, first_lane, used = [], index, 0
            take = min(len(lane.feed) - offset, chunk - used)
            last = offset + take == len(lane.feed)
            rows.append(Row(lane.slot, lane.generation, lane.start + offset, take, lane.feed[offset:offset + take],
                            lane.pages, last, 0, GREEDY, 0, lane.start + offset + take))
            offset += take
            used += take
    if rows:
        frames.append(_catch_up(rows, first_lane))
    for position in range(1, lanes[0].depth if lanes else 0):
        active = [lane for lane in lanes if lane.depth > position]
        rows = [Row(lane.slot, lane.generation, lane.start + len(lane.feed) + position - 1, 1, None, lane.pages,
                    True, 0, GREEDY, 0, lane.start + len(lane.feed)) for lane in active]
        frames.append(Frame(Plan(tuple(rows)), "decode", position, 0, len(active)))
    return frames


def _catch_up(rows: list[Row], first_lane: int) -> Frame:
    """Every row samples but a last one that continues in the next frame."""
    return Frame(Plan(tuple(rows)), "extend", 0, first_lane, len(rows) - (not rows[-1].sample))


class DraftSteps:
    """The draft model's step state (static buffers, layouts, its page-table mirror) and a round's frames, run
    eagerly."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, page_size: int, max_active: int,
                 context_limit: int, prefill_chunk: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.context_limit = context_limit
        self.trash = max_active  # the padding slot
        self.decode = {b: make_layout("decode", b, b) for b in decode_capacities(max_active)}
        self.extend = {t: make_layout("extend", t, min(t, max_active))
                       for t in extend_capacities(prefill_chunk, max_active)}
        self.layouts = [*self.decode.values(), *self.extend.values()]
        width = -(-context_limit // page_size)
        words = max(layout.patches for layout in self.layouts) + 2 * max_active * width
        max_seqs = max(layout.seqs for layout in self.layouts)
        self.buffers = StaticBuffers.allocate(words, max_active, width, max_seqs, model.config.vocab_size, device)
        self.mirror = PageTableMirror(max_active, width)
        self.drafts = torch.zeros(MAX_DEPTH, max_active, dtype=torch.int64, device=device)  # [position, lane]
        pinned = device.type == "cuda"
        self.host = [torch.zeros(words, dtype=torch.int32, pin_memory=pinned) for _ in range(HOST_FRAMES)]
        self.views = [{layout: host_views(frame.numpy(), layout) for layout in self.layouts} for frame in self.host]

    @torch.inference_mode()
    def propose(self, lanes: list[Lane]) -> list[tuple[int, ...]]:
        """Each lane's drafts (lanes deepest first)."""
        try:
            for i, frame in enumerate(round_frames(lanes, max(self.extend))):
                k = i % HOST_FRAMES
                if i and not k:
                    self._drain()  # host frame 0 is written again: what it held must be on the device
                layout = self._layout(frame)
                words = pack(frame.plan, layout, self.host[k].numpy(), self.views[k][layout], self.mirror,
                             self.page_size, self.trash)
                self._run(layout, k, words)
                self.drafts[frame.position, frame.first_lane:frame.first_lane + frame.count] = \
                    self.buffers.sampled[:frame.count]
            drafts = self.drafts[:lanes[0].depth if lanes else 0, :len(lanes)].cpu().T.tolist()
        except Exception:
            self.mirror.forget([lane.slot for lane in lanes])  # their device rows are rewritten on next use
            raise
        return [tuple(row[:lane.depth]) for lane, row in zip(lanes, drafts)]

    def _layout(self, frame: Frame) -> Layout:
        if frame.kind == "decode":
            return self.decode[min(b for b in self.decode if b >= len(frame.plan.rows))]
        return self.extend[min(t for t in self.extend if t >= frame.plan.num_tokens)]

    def _run(self, layout: Layout, k: int, words: int) -> None:
        self.buffers.frame[:words].copy_(self.host[k][:words])
        model_step(self.model, self.kv_cache, self.buffers, layout, self.page_size)
        sample_step(self.buffers, layout, greedy=True)

    def _drain(self) -> None:
        """Eager steps have used their host frames by the time they return."""


class DraftGraphs(DraftSteps):
    """The same round, each frame a model graph and a greedy sampling graph captured at start, launched on the
    draft's own stream (beside the target's steps in flight); the round's one sync is its drafts' copy back."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, page_size: int, max_active: int,
                 context_limit: int, prefill_chunk: int, device: torch.device) -> None:
        from cupy.cuda import runtime

        super().__init__(model, kv_cache, page_size, max_active, context_limit, prefill_chunk, device)
        self._rt = runtime
        self.stream = torch.cuda.Stream(device)
        samplers = {layout.seqs: layout for layout in self.layouts}
        steps = [(layout, lambda layout=layout: model_step(model, kv_cache, self.buffers, layout, page_size))
                 for layout in self.layouts]
        steps += [((seqs,), lambda layout=layout: sample_step(self.buffers, layout, greedy=True))
                  for seqs, layout in samplers.items()]
        # A pool of its own: a draft round runs beside the target's steps in flight, so their scratch must not alias.
        self._graphs = capture_graphs(steps, self.buffers.frame, page_size, self.trash, self.stream,
                                      torch.cuda.graph_pool_handle())
        self._exec = {key: graph.raw_cuda_graph_exec() for key, graph in self._graphs.items()}
        self.graph_count = len(self._graphs)

    def propose(self, lanes: list[Lane]) -> list[tuple[int, ...]]:
        with torch.cuda.stream(self.stream):  # the samples' copies and the copy back go on the draft's stream
            return super().propose(lanes)

    def _run(self, layout: Layout, k: int, words: int) -> None:
        stream = self.stream.cuda_stream
        self._rt.memcpyAsync(self.buffers.frame.data_ptr(), self.host[k].data_ptr(), words * 4, H2D, stream)
        self._rt.graphLaunch(self._exec[layout], stream)
        self._rt.graphLaunch(self._exec[(layout.seqs,)], stream)

    def _drain(self) -> None:
        self.stream.synchronize()
