"""GraphExecutor: the model as CUDA graphs captured at start and launched through CuPy, two steps in flight.

Per step the host packs the plan into one of two pinned input frames (engine/executor/frames.py) and, on the model
stream, uploads it, launches the model graph of the smallest capacity that holds the plan, then the sampling graph,
and copies the sampled tokens aside; the copy stream brings them to one of two pinned completion frames behind an
event, and a watcher thread wakes the engine loop when that event passes. Submitting allocates nothing and never
waits for the device. The sampled token of each slot stays on the device, where the next decode graph reads it.

Graphs: one per decode capacity (1, 2, 4, ... max_active) and one per extend capacity (64-token steps up to 512,
then 256-token steps, up to the prefill chunk plus a decode row per slot), so prefill and mixed steps are graphs
too; one sampling graph per sequence capacity, greedy and random, each with and without grammar masks (a
constrained step uploads its packed masks beside its frame and launches the masked variant). Scored prefills
(decisions) run in the extend graphs: the logits of a row's last token are in the logits buffer, and one gather by
flat index, uploaded with the step, reads their labels' (engine/executor/label_scores.py). Verify steps
(speculative decoding) run in the decode graphs: each position of a verify row is a one-token row with its token
from the host (frames.verify_rows), so a batch of B rows of width W runs in the decode graph of capacity B x W; after
the sampling graph, a few eager ops on the model stream accept the drafts and write each slot's next input token
(graph_step.accept_drafts), and the verdicts come back with the tokens. Steps that ask for
penalties, logprobs or prompt logprobs, label logits anywhere but at a row's last token, and plans no graph holds,
run eagerly on the model stream through EagerExecutor's step (the reference semantics), synchronously: these are the
exceptions, not the hot path. So do a vision model's steps holding image tokens, but their vision tower replays its
own graphs, captured here at patch capacities (engine/executor/vision_graphs.py).
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Callable

import numpy as np
import torch

from engine.executor.eager import EagerExecutor, kv_cache_shape
from engine.executor.frames import (TEMPERATURE, Layout, PageTableMirror, host_views, make_layout, pack,
                                    verify_results, verify_rows, verify_spans)
from engine.executor.graph_step import StaticBuffers, accept_drafts, model_step, sample_step
from engine.executor.inputs import any_penalty
from engine.executor.label_scores import Query, assemble, graph_index
from engine.executor.vision_graphs import VisionGraphs, vision_capacities
from engine.model.decoder import CausalLM
from engine.model.qwen3_vl import VisionLanguageLM
from engine.scheduler.plan import (GENERATION, PROMPT_TARGETS, ROPE_SHIFT, SAMPLE, SAMPLING, SCORES, SLOT, Completion,
                                   Plan)

log = logging.getLogger("flare.engine")

MAX_IN_FLIGHT = 2
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind
EVENT_DISABLE_TIMING = 2
LOGPROBS = attrgetter("logprobs")
LABELS_PER_SEQUENCE = 32  # label logits a graph step reads, per sequence of its largest capacity


def decode_capacities(max_active: int) -> list[int]:
    caps = [1 << i for i in range(max_active.bit_length()) if 1 << i < max_active]
    return caps + [max_active]


def extend_capacities(prefill_chunk: int, max_active: int) -> list[int]:
    """Token capacities of the extend graphs: a prefill chunk plus one decode row per live slot fits the last.
    Steps of 64 tokens up to 512, of 256 up to 2048, then of 1024: padding stays under an eighth of a step."""
    top = -(-(prefill_chunk + max_active) // 64) * 64
    return [t for t in range(64, top + 1, 64)
            if t <= 512 or (t <= 2048 and t % 256 == 0) or t % 1024 == 0 or t == top]


def capture_graphs(steps: list[tuple[object, Callable[[], None]]], frame: torch.Tensor, page_size: int, trash: int,
                   stream: torch.cuda.Stream, pool: tuple[int, int]) -> dict[object, torch.cuda.CUDAGraph]:
    """One graph per (key, step function): a model step's key is its Layout, a sampling step's a tuple whose first
    item is its sequence capacity. Largest first, all in `pool`: graphs that never run at once share their scratch
    memory. Each runs once outside the capture first (kernels compile, cuBLAS sets up its shape)."""
    graphs: dict[object, torch.cuda.CUDAGraph] = {}
    scratch = np.zeros(frame.numel(), dtype=np.int32)
    for key, run in sorted(steps, key=lambda step: -(step[0].tokens if isinstance(step[0], Layout) else step[0][0])):
        if isinstance(key, Layout):  # every row padding, no patches: a valid step that writes nowhere
            words = pack(Plan(()), key, scratch, host_views(scratch, key), PageTableMirror(1, 1), page_size, trash)
            frame[:words].copy_(torch.from_numpy(scratch[:words]))
        with torch.cuda.stream(stream):
            run()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            run()
        graph.instantiate()
        graphs[key] = graph
    torch.cuda.synchronize()
    return graphs


@dataclass(frozen=True)
class _Launched:
    fence: int
    plan: Plan
    frame: int
    kind: str  # the graph's: "decode" or "extend"
    labels: tuple[Query, ...] = ()  # the label queries whose logits the step gathered
    seqs: int = 0  # sequence rows the step sampled (a verify row counts one per position)
    verified: int = 0  # verify rows whose verdicts the step copied back


@dataclass(frozen=True)
class _Ready:
    plan: Plan
    completion: Completion


class GraphExecutor:
    def __init__(self, model: CausalLM, num_pages: int, page_size: int, max_active: int,
                 device: torch.device, context_limit: int, prefill_chunk: int) -> None:
        from cupy.cuda import runtime

        started = time.monotonic()
        self._rt = runtime
        self.model = model
        self.num_pages = num_pages
        self.page_size = page_size
        self.trash = max_active  # the padding slot: its page-table row and slot token belong to no request
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_pages, page_size),
                                    dtype=model.model.embed_tokens.weight.dtype, device=device)
        self._decode_caps = decode_capacities(max_active)
        self._extend_caps = extend_capacities(prefill_chunk, max_active)
        self._decode = {b: make_layout("decode", b, b) for b in self._decode_caps}
        self._extend = {t: make_layout("extend", t, min(t, max_active)) for t in self._extend_caps}
        layouts = [*self._decode.values(), *self._extend.values()]
        width = -(-context_limit // page_size)
        words = max(layout.patches for layout in layouts) + 2 * max_active * width  # every table rewritten at once
        max_seqs = max(layout.seqs for layout in layouts)
        self._buffers = StaticBuffers.allocate(words, max_active, width, max_seqs, model.config.vocab_size, device)
        self._mirror = PageTableMirror(max_active, width)
        # Two of everything the host touches per step: frame k serves fences of parity k.
        self._host = [torch.zeros(words, dtype=torch.int32).pin_memory() for _ in range(MAX_IN_FLIGHT)]
        self._host_np = [frame.numpy() for frame in self._host]
        self._views = [{layout: host_views(frame, layout) for layout in layouts} for frame in self._host_np]
        self._out_host = [torch.zeros(max_seqs, dtype=torch.int64).pin_memory() for _ in range(MAX_IN_FLIGHT)]
        self._out_dev = [torch.zeros(max_seqs, dtype=torch.int64, device=device) for _ in range(MAX_IN_FLIGHT)]
        # Label logits of scored prefills: flat indices into the logits buffer in, the values out, per frame.
        self._vocab = model.config.vocab_size
        self._max_labels = max_seqs * LABELS_PER_SEQUENCE
        self._label_index_host = [torch.zeros(self._max_labels, dtype=torch.int64).pin_memory()
                                  for _ in range(MAX_IN_FLIGHT)]
        self._label_index = torch.zeros(self._max_labels, dtype=torch.int64, device=device)
        self._label_dev = [torch.zeros(self._max_labels, device=device) for _ in range(MAX_IN_FLIGHT)]
        self._label_host = [torch.zeros(self._max_labels).pin_memory() for _ in range(MAX_IN_FLIGHT)]
        # Verify steps: each verify row's (first row, width, slot) in, its (accepted drafts, token) out, per frame.
        self._spans_host = [torch.zeros(3 * max_active, dtype=torch.int64).pin_memory() for _ in range(MAX_IN_FLIGHT)]
        self._spans = torch.zeros(3 * max_active, dtype=torch.int64, device=device)
        self._verdicts_dev = [torch.zeros(2 * max_active, dtype=torch.int64, device=device)
                              for _ in range(MAX_IN_FLIGHT)]
        self._verdicts_host = [torch.zeros(2 * max_active, dtype=torch.int64).pin_memory()
                               for _ in range(MAX_IN_FLIGHT)]
        mask_shape = tuple(self._buffers.masks.shape)
        self._masks_host = [torch.zeros(mask_shape, dtype=torch.int32).pin_memory() for _ in range(MAX_IN_FLIGHT)]
        self._model_stream = torch.cuda.Stream(device)
        self._copy_stream = torch.cuda.Stream(device)
        self._start = [runtime.eventCreate() for _ in range(MAX_IN_FLIGHT)]
        self._end = [runtime.eventCreate() for _ in range(MAX_IN_FLIGHT)]
        self._done = [runtime.eventCreateWithFlags(EVENT_DISABLE_TIMING) for _ in range(MAX_IN_FLIGHT)]
        self._origin = runtime.eventCreate()
        runtime.eventRecord(self._origin, self._model_stream.cuda_stream)
        # The reference step for what the graphs do not cover, on this executor's cache and slot tokens.
        self._eager = EagerExecutor(model, 1, page_size, max_active, device)
        self._eager.kv_cache = self.kv_cache
        self._eager.slot_tokens = self._buffers.slot_tokens[:max_active]
        # One memory pool for every graph: they never run at once, so they share their scratch memory.
        self._pool = torch.cuda.graph_pool_handle()
        self._vision: VisionGraphs | None = None
        if isinstance(model, VisionLanguageLM):  # its tower's graphs first: their scratch is the largest
            capacities = vision_capacities(self._extend_caps[-1], model.visual.config.merge_size)
            self._vision = VisionGraphs(model.visual, capacities, device, self._pool, self._model_stream)
            self._eager.vision_tower = self._vision
            log.info("vision tower: %d graphs at %s patches, %.0f MiB", self._vision.graph_count, capacities,
                     self._vision.memory_bytes / 2**20)
        self._graphs: dict[object, torch.cuda.CUDAGraph] = {}
        self._capture(layouts)
        self._exec = {key: graph.raw_cuda_graph_exec() for key, graph in self._graphs.items()}
        self.graph_count = len(self._graphs) + (self._vision.graph_count if self._vision else 0)
        self.capture_seconds = time.monotonic() - started
        #: Each graph step on the GPU: (start ms, end ms) since the executor started, rows, graph kind. For
        #: telemetry and benchmarks: the gaps between steps are where the GPU waited for the host.
        self.spans: collections.deque[tuple[float, float, int, str]] = collections.deque(maxlen=1 << 16)
        self._fence = 0
        self._in_flight = 0
        self._completed = 0  # the last fence whose completion frame is ready, as the watcher saw it
        self._failure: str | None = None
        self._pending: collections.deque[_Launched | _Ready] = collections.deque()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._watch: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch_events, name="graph-completions", daemon=True)
        self._watcher.start()

    # --- capture ------------------------------------------------------------------------------------------------
    def _capture(self, layouts: list[Layout]) -> None:
        samplers = {layout.seqs: layout for layout in layouts}
        steps = [(layout, lambda layout=layout: model_step(self.model, self.kv_cache, self._buffers, layout,
                                                           self.page_size)) for layout in layouts]
        steps += [((seqs, greedy, masked), lambda layout=layout, greedy=greedy, masked=masked:
                   sample_step(self._buffers, layout, greedy, masked))
                  for seqs, layout in samplers.items() for greedy in (True, False) for masked in (False, True)]
        self._graphs.update(capture_graphs(steps, self._buffers.frame, self.page_size, self.trash,
                                           self._model_stream, self._pool))

    # --- the protocol -------------------------------------------------------------------------------------------
    def can_submit(self) -> bool:
        return self._in_flight < MAX_IN_FLIGHT

    def next_fence(self) -> int:
        return self._fence + 1

    def submit(self, plan: Plan) -> None:
        self._fence += 1
        self._in_flight += 1
        fence = self._fence
        try:
            layout = self._layout_for(plan)
            if layout is None:
                self._pending.append(_Ready(plan, self._run_eager(fence, plan)))
                os.write(self._wake_write, b"x")
            else:
                self._launch(fence, plan, layout)
        except Exception as exc:  # a failed step fails its requests, never the engine
            log.exception("graph step %d failed", fence)
            self._mirror.forget([row.slot for row in plan.rows])
            self._pending.append(_Ready(plan, Completion(fence, (), (), (), 0.0,
                                                         error=f"execution failed: {type(exc).__name__}: {exc}")))
            os.write(self._wake_write, b"x")

    def poll(self) -> list[tuple[Plan, Completion]]:
        try:
            os.read(self.wake_fd, 1 << 16)
        except BlockingIOError:
            pass
        ready = []
        while self._pending:
            head = self._pending[0]
            if isinstance(head, _Launched):
                if head.fence > self._completed:
                    break
                ready.append((head.plan, self._collect(head)))
            else:
                ready.append((head.plan, head.completion))
            self._pending.popleft()
        self._in_flight -= len(ready)
        return ready

    def close(self) -> None:
        """Drain both streams, then free; if the drain fails the memory is kept, since work may still use it."""
        self._watch.put(None)
        try:
            self._rt.streamSynchronize(self._model_stream.cuda_stream)
            self._rt.streamSynchronize(self._copy_stream.cuda_stream)
        except Exception:
            log.exception("draining the GPU failed; keeping its memory")
            return
        self._watcher.join()
        self._eager.close()
        del self._eager
        for event in (*self._start, *self._end, *self._done, self._origin):
            self._rt.eventDestroy(event)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        if self._vision is not None:
            self._vision.close()
        self._exec.clear()
        del self.kv_cache, self._buffers, self._out_dev, self._label_index, self._label_dev, self._spans, \
            self._verdicts_dev
        torch.cuda.empty_cache()
        os.close(self.wake_fd)
        os.close(self._wake_write)

    # --- a step -------------------------------------------------------------------------------------------------
    def _layout_for(self, plan: Plan) -> Layout | None:
        """The smallest graph that holds the plan, or None for a step that runs eagerly."""
        rows = plan.rows
        if not rows:
            return None
        # Passes at C speed over the rows (plan.py's field getters): the checks run on every step.
        params = list(map(SAMPLING, rows))
        if any_penalty(params) or any(map(is_not, map(LOGPROBS, params), repeat(None))) or \
                any(map(PROMPT_TARGETS, rows)) or None in map(ROPE_SHIFT, rows):
            return None
        if plan.kind == "verify":  # one-token rows in a decode graph, when nothing else needs a span
            if plan.masks or any(row.scores or (row.length > 1 and not row.draft) for row in rows):
                return None
            i = bisect.bisect_left(self._decode_caps, sum(row.length if row.draft else 1 for row in rows))
            return self._decode[self._decode_caps[i]] if i < len(self._decode_caps) else None
        if any(map(SCORES, rows)):
            index = graph_index(plan, self._vocab)
            if index is None or len(index[1]) > self._max_labels:
                return None
        if plan.kind == "decode":
            i = bisect.bisect_left(self._decode_caps, len(rows))
            return self._decode[self._decode_caps[i]] if i < len(self._decode_caps) else None
        i = bisect.bisect_left(self._extend_caps, plan.num_tokens)
        return self._extend[self._extend_caps[i]] if i < len(self._extend_caps) else None

    def _launch(self, fence: int, plan: Plan, layout: Layout) -> None:
        self._copy_pages(plan.copies)
        k = fence % MAX_IN_FLIGHT
        verify = plan.kind == "verify"
        packed = replace(plan, rows=verify_rows(plan.rows)) if verify else plan
        words = pack(packed, layout, self._host_np[k], self._views[k][layout], self._mirror, self.page_size,
                     self.trash)
        greedy = not any(map(TEMPERATURE, compress(map(SAMPLING, plan.rows), map(SAMPLE, plan.rows))))
        rt, model, copy, seqs = self._rt, self._model_stream.cuda_stream, self._copy_stream.cuda_stream, layout.seqs
        rt.eventRecord(self._start[k], model)
        rt.memcpyAsync(self._buffers.frame.data_ptr(), self._host[k].data_ptr(), words * 4, H2D, model)
        if plan.masks:  # grammar masks, one row per plan row; rows past the plan are padding and sample nothing
            self._masks_host[k].numpy().reshape(-1)[:len(plan.masks) // 4] = np.frombuffer(plan.masks, np.int32)
            rt.memcpyAsync(self._buffers.masks.data_ptr(), self._masks_host[k].data_ptr(), len(plan.masks), H2D,
                           model)
        rt.graphLaunch(self._exec[layout], model)
        rt.graphLaunch(self._exec[(seqs, greedy, bool(plan.masks))], model)
        labels = self._gather_labels(plan, k) if any(row.scores for row in plan.rows) else ()
        verified = self._accept(plan, k, layout) if verify else 0
        # The next step's sampling overwrites `sampled`; this frame's copy waits for nobody.
        rt.memcpyAsync(self._out_dev[k].data_ptr(), self._buffers.sampled.data_ptr(), seqs * 8, D2D, model)
        rt.eventRecord(self._end[k], model)
        rt.streamWaitEvent(copy, self._end[k], 0)
        rt.memcpyAsync(self._out_host[k].data_ptr(), self._out_dev[k].data_ptr(), seqs * 8, D2H, copy)
        if labels:
            count = sum(len(query.token_ids) for query in labels)
            rt.memcpyAsync(self._label_host[k].data_ptr(), self._label_dev[k].data_ptr(), count * 4, D2H, copy)
        if verified:
            rt.memcpyAsync(self._verdicts_host[k].data_ptr(), self._verdicts_dev[k].data_ptr(), verified * 16, D2H,
                           copy)
        rt.eventRecord(self._done[k], copy)
        self._pending.append(_Launched(fence, plan, k, layout.kind, labels, len(packed.rows), verified))
        self._watch.put((fence, self._done[k]))

    def _accept(self, plan: Plan, k: int, layout: Layout) -> int:
        """On the model stream, after sampling: the verify rows' verdicts into frame k's buffer; their count."""
        spans, width = verify_spans(plan.rows)
        count = spans.shape[1]
        self._spans_host[k].numpy()[:3 * count] = spans.reshape(-1)
        self._rt.memcpyAsync(self._spans.data_ptr(), self._spans_host[k].data_ptr(), 3 * count * 8, H2D,
                             self._model_stream.cuda_stream)
        with torch.cuda.stream(self._model_stream):
            verdicts = accept_drafts(self._buffers, layout, self._spans[:3 * count].view(3, count), width)
            self._verdicts_dev[k][:2 * count].copy_(verdicts.view(-1))
        return count

    def _gather_labels(self, plan: Plan, k: int) -> tuple[Query, ...]:
        """On the model stream, after the model graph: the queried labels' logits into frame k's label buffer."""
        found, index = graph_index(plan, self._vocab)
        count = len(index)
        self._label_index_host[k].numpy()[:count] = index
        self._rt.memcpyAsync(self._label_index.data_ptr(), self._label_index_host[k].data_ptr(), count * 8, H2D,
                             self._model_stream.cuda_stream)
        with torch.cuda.stream(self._model_stream):
            torch.index_select(self._buffers.logits.view(-1), 0, self._label_index[:count],
                               out=self._label_dev[k][:count])
        return tuple(found)

    def _collect(self, step: _Launched) -> Completion:
        if self._failure is not None:
            return Completion(step.fence, (), (), (), 0.0, error=f"execution failed: {self._failure}")
        k = step.frame
        rows = step.plan.rows
        samples = self._out_host[k].numpy()[:step.seqs].tolist()
        accepted: list[int] = []
        if step.verified:
            verdicts = self._verdicts_host[k].numpy()[:2 * step.verified].reshape(2, -1)
            tokens, accepted = verify_results(rows, samples, verdicts)
        else:
            tokens = list(compress(samples, map(SAMPLE, rows)))
        sampled = list(compress(rows, map(SAMPLE, rows)))
        start = self._rt.eventElapsedTime(self._origin, self._start[k])
        end = self._rt.eventElapsedTime(self._origin, self._end[k])
        self.spans.append((start, end, len(step.plan.rows), step.kind))
        count = sum(len(query.token_ids) for query in step.labels)
        scores = assemble(list(step.labels), self._label_host[k].numpy()[:count].tolist()) if count else ()
        return Completion(step.fence, tuple(map(SLOT, sampled)), tuple(map(GENERATION, sampled)),
                          tuple(tokens), (end - start) / 1000, scores=scores, accepted=tuple(accepted))

    def _run_eager(self, fence: int, plan: Plan) -> Completion:
        """The eager executor's step (page copies included) on the model stream; its tokens reaching the host end
        it. It reads its own page tables, so the device's per-slot rows stay as the mirror says."""
        with torch.cuda.stream(self._model_stream):
            return self._eager._execute(fence, plan, time.perf_counter())

    def _copy_pages(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Private copies of cached pages, before the step that reads them (rare: exact prefix checkpoints)."""
        if not copies:
            return
        size = self.page_size
        with torch.cuda.stream(self._model_stream):
            offsets = torch.arange(size, device=self.kv_cache.device)
            src = (torch.tensor([s for s, _ in copies], device=self.kv_cache.device)[:, None] * size + offsets)
            dst = (torch.tensor([d for _, d in copies], device=self.kv_cache.device)[:, None] * size + offsets)
            self.kv_cache[:, :, dst.flatten()] = self.kv_cache[:, :, src.flatten()]

    def _watch_events(self) -> None:
        while (item := self._watch.get()) is not None:
            fence, event = item
            try:
                self._rt.eventSynchronize(event)
            except Exception as exc:  # a device fault: every step in flight fails with it
                self._failure = f"{type(exc).__name__}: {exc}"
            self._completed = fence
            os.write(self._wake_write, b"x")
