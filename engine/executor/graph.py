"""GraphExecutor: the model as CUDA graphs captured at start and launched through CuPy, two steps in flight.

Per step the host packs the plan into one of two pinned input frames (engine/executor/frames.py) and, on the model
stream, uploads it, launches the model graph of the smallest capacity that holds the plan, then the sampling graph,
and copies the sampled tokens aside; the copy stream brings them to one of two pinned completion frames behind an
event, and a watcher thread wakes the engine loop when that event passes. Submitting allocates nothing and never
waits for the device. The sampled token of each slot stays on the device, where the next decode graph reads it.

Graphs: one per decode capacity (1, 2, 4, ... max_active) and one per extend capacity (64-token steps up to 512,
then 256-token steps, up to the prefill chunk plus a decode row per slot), so prefill and mixed steps are graphs
too; one sampling graph per sequence capacity, greedy and random, each plain, with grammar masks (a constrained
step uploads its packed masks and launches the masked variant; when they come later, Plan.masks_later, the model
graph runs at submit and the sampling graph once `give_masks` brings them) or with the extras: penalties,
min_tokens bans and logprobs, and one prompt-logprobs graph (engine/sampling/graph_extras.py). Scored prefills
(decisions) run in the extend graphs: the logits of a row's last token are in the logits buffer, and one gather by
flat index, uploaded with the step, reads their labels' (engine/sampling/label_scores.py). Verify steps
(speculative decoding) run in the decode graphs: each position of a verify row is a one-token row with its token
from the host (frames.verify_rows), so a batch of B rows of width W runs in the decode graph of capacity B x W; after
the sampling graph, a few eager ops on the model stream accept the drafts and write each slot's next input token
(graph_step.accept_drafts), and the verdicts come back with the tokens. Steps that ask for
label logits anywhere but at a row's last token, more logprobs or bans than the graphs hold, penalties, logprobs or
bans in a verify plan (the planner never drafts for such requests), and plans no graph holds, run eagerly on the
model stream through EagerExecutor's step (the reference semantics), synchronously: these are the exceptions, not
the hot path. So do a vision model's steps holding image tokens, but their vision tower replays its own graphs,
captured here at patch capacities (engine/executor/vision_graphs.py). Embeddings (docs/design.md, Embeddings) run in
the extend graphs, which keep every token's final hidden state: after the model graph, an index uploaded with the
step pools the embedding rows' states into frame k's buffer (engine/executor/pooling.py), copied back with the tokens.
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
from itertools import compress
from typing import Callable

import numpy as np
import torch

from engine.executor.disk_worker import DiskWorker
from engine.executor.eager import EagerExecutor, copy_pages, kv_cache_shape
from engine.executor.faults import DeviceFault, sticky_fault
from engine.executor.frames import (TEMPERATURE, Layout, PageTableMirror, host_views, make_layout, pack,
                                    sequence_rows, verify_results, verify_rows, verify_spans)
from engine.executor.graph_step import StaticBuffers, accept_drafts, model_step, sample_step
from engine.executor.pooling import assemble as assemble_pooled
from engine.executor.pooling import pool_index, pool_rows, pools
from engine.executor.tier_copies import HostPages, moves
from engine.executor.vision_graphs import VisionGraphs, vision_capacities
from engine.model.backends.triton import KernelTower
from engine.model.decoder import CausalLM
from engine.model.qwen3_vl import VisionLanguageLM
from engine.sampling.graph_extras import (PROMPT_ROWS, ExtrasBuffers, StepExtras, extras_words, graph_holds_extras,
                                          host_extras_views, logprob_words, pack_extras, prompt_logprobs_step,
                                          read_logprobs, read_prompt_logprobs, step_extras)
from engine.sampling.label_scores import Query, assemble, graph_index
from engine.sampling.penalty_state import apply_known_tokens
from engine.scheduler.plan import (GENERATION, ROPE_SHIFT, SAMPLE, SAMPLING, SCORES, SLOT, Completion, DiskDone, Plan,
                                  Row, fields)

log = logging.getLogger("flare.engine")

MAX_IN_FLIGHT = 2
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind
EVENT_DISABLE_TIMING = 2
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
    extras: StepExtras | None = None  # penalties, bans, logprobs, prompt logprobs (engine/sampling/graph_extras.py)
    pooled: tuple[Row, ...] = ()  # the embedding rows whose pooled states the step copied back


@dataclass(frozen=True)
class _Ready:
    plan: Plan
    completion: Completion


class GraphExecutor:
    def __init__(self, model: CausalLM, num_pages: int, page_size: int, max_active: int,
                 device: torch.device, context_limit: int, prefill_chunk: int, snapshots: int = 0) -> None:
        """`snapshots`: a hybrid model's state rows beyond the slots', for exact checkpoints (Plan.state_copies)."""
        from cupy.cuda import runtime

        started = time.monotonic()
        self._rt = runtime
        self.model = model
        self.num_pages = num_pages
        self.page_size = page_size
        self.trash = max_active  # the padding slot: its page-table row and slot token belong to no request
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_pages, page_size), dtype=model.cache_dtype,
                                    device=device)
        self._decode_caps = decode_capacities(max_active)
        self._extend_caps = extend_capacities(prefill_chunk, max_active)
        dtype = model.model.embed_tokens.weight.dtype
        # A hybrid model's graphs make a step's recurrent-state row copies, up to two a slot (more run eagerly).
        self._state_copies = 2 * max_active if model.config.hybrid else 0
        self._decode = {b: make_layout("decode", b, b, self._state_copies) for b in self._decode_caps}
        self._extend = {t: make_layout("extend", t, min(t, max_active), self._state_copies)
                        for t in self._extend_caps}
        layouts = [*self._decode.values(), *self._extend.values()]
        width = -(-context_limit // page_size)
        words = max(layout.patches for layout in layouts) + 2 * max_active * width  # every table rewritten at once
        max_seqs = max(layout.seqs for layout in layouts)
        self._buffers = StaticBuffers.allocate(words, max_active, width, max_seqs, model.config.vocab_size, device)
        self._mirror = PageTableMirror(max_active, width)
        self._extras = ExtrasBuffers.allocate(max_active, max_seqs, self._extend_caps[-1], model.config.vocab_size,
                                              model.config.hidden_size, dtype, device)
        self._extras_host = [torch.zeros(extras_words(max_seqs), dtype=torch.int32).pin_memory()
                             for _ in range(MAX_IN_FLIGHT)]
        self._extras_views = [{seqs: host_extras_views(frame.numpy(), seqs) for seqs in {lay.seqs for lay in layouts}}
                              for frame in self._extras_host]
        row_words = logprob_words(self._extras.top)
        self._logprobs_dev = [torch.zeros(max_seqs, row_words, dtype=torch.int32, device=device)
                              for _ in range(MAX_IN_FLIGHT)]
        self._logprobs_host = [torch.zeros(max_seqs, row_words, dtype=torch.int32).pin_memory()
                               for _ in range(MAX_IN_FLIGHT)]
        # Penalty-state updates of host tokens (a request's history and prompt): beyond this many, the step is eager.
        self._max_known = 4 * context_limit + max_active
        self._known_host = [torch.zeros(self._max_known, dtype=torch.int64).pin_memory() for _ in range(MAX_IN_FLIGHT)]
        self._known = torch.zeros(self._max_known, dtype=torch.int64, device=device)
        # Prompt logprobs: positions in by chunks of PROMPT_ROWS, logprob rows out, per frame.
        chunks = -(-self._extend_caps[-1] // PROMPT_ROWS)
        self._prompt_host = [torch.zeros(chunks, 2, PROMPT_ROWS, dtype=torch.int64).pin_memory()
                             for _ in range(MAX_IN_FLIGHT)]
        self._prompt_in = torch.zeros(chunks, 2, PROMPT_ROWS, dtype=torch.int64, device=device)
        self._prompt_dev = [torch.zeros(chunks * PROMPT_ROWS, row_words, dtype=torch.int32, device=device)
                            for _ in range(MAX_IN_FLIGHT)]
        self._prompt_out_host = [torch.zeros(chunks * PROMPT_ROWS, row_words, dtype=torch.int32).pin_memory()
                                 for _ in range(MAX_IN_FLIGHT)]
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
        # Embeddings: each pooled token's (step row, pooling row) in, a float32 vector per pooling row out, per frame.
        hidden = model.config.hidden_size
        self._pool_index_host = [torch.zeros(2 * self._extend_caps[-1], dtype=torch.int64).pin_memory()
                                 for _ in range(MAX_IN_FLIGHT)]
        self._pool_index = torch.zeros(2 * self._extend_caps[-1], dtype=torch.int64, device=device)
        self._pool_dev = [torch.zeros(max_seqs, hidden, device=device) for _ in range(MAX_IN_FLIGHT)]
        self._pool_host = [torch.zeros(max_seqs, hidden).pin_memory() for _ in range(MAX_IN_FLIGHT)]
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
        # A hybrid model's recurrent state (a row per slot, then its snapshot rows) is the eager step's.
        self._eager = EagerExecutor(model, 1, page_size, max_active, device, snapshots)
        self._eager.kv_cache = self.kv_cache
        self.state = self._eager.state
        self._eager.slot_tokens = self._buffers.slot_tokens[:max_active]
        self._eager.output_counts = self._extras.counts[:max_active]  # one penalty state for both
        self._eager.seen = self._extras.seen[:max_active]
        # One memory pool for every graph: they never run at once, so they share their scratch memory.
        self._pool = torch.cuda.graph_pool_handle()
        self._vision: VisionGraphs | None = None
        if isinstance(model, VisionLanguageLM):  # its tower's graphs first: their scratch is the largest
            capacities = vision_capacities(self._extend_caps[-1], model.visual.config.merge_size)
            self._vision = VisionGraphs(KernelTower(model.visual), capacities, device, self._pool,
                                        self._model_stream)
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
        self.fault: str | None = None  # once set, every step fails: engine/executor/faults.py
        self._pending: collections.deque[_Launched | _Ready] = collections.deque()
        self.late_masks = True
        # The step submitted with Plan.masks_later, until its masks come: (fence, plan, its graph or None when it
        # runs eagerly, its extras). None also when its submit failed.
        self._awaiting: tuple[int, Plan, Layout | None, StepExtras | None] | None = None
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._disk = DiskWorker(self._wake_write)
        self._watch: queue.SimpleQueue[tuple[int, int, Plan] | None] = queue.SimpleQueue()
        self._tier_events: dict[int, tuple] = {}  # per fence: timing events around its spills and restores
        self._watcher = threading.Thread(target=self._watch_events, name="graph-completions", daemon=True)
        self._watcher.start()

    # --- capture ------------------------------------------------------------------------------------------------
    def _capture(self, layouts: list[Layout]) -> None:
        samplers = {layout.seqs: layout for layout in layouts}
        steps = [(layout, lambda layout=layout: model_step(
            self.model, self.kv_cache, self._buffers, layout, self.page_size,
            self._extras.hidden if layout.kind == "extend" else None, self.state)) for layout in layouts]
        steps += [((seqs, greedy, mode), lambda layout=layout, greedy=greedy, mode=mode:
                   sample_step(self._buffers, layout, greedy, mode == "masked",
                               self._extras if mode == "extras" else None))
                  for seqs, layout in samplers.items() for greedy in (True, False)
                  for mode in ("plain", "masked", "extras")]
        steps.append(((PROMPT_ROWS, "prompt"), lambda: prompt_logprobs_step(self.model, self._extras)))
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
        self._guarded(fence, plan, lambda: self._start_step(fence, plan))

    def _start_step(self, fence: int, plan: Plan) -> None:
        layout = self._layout_for(plan)
        extras = step_extras(plan.rows, self._vocab) if layout is not None else None
        if layout is None or extras is not None and (extras.known_count > self._max_known or
                                                     not graph_holds_extras(plan.rows)):
            layout = extras = None  # it runs eagerly, at once or once its masks come
        else:
            self._launch_model(fence, plan, layout, extras)
        if plan.masks_later:
            self._awaiting = (fence, plan, layout, extras)
        else:
            self._finish_step(fence, plan, layout, extras)

    def give_masks(self, masks: bytes) -> None:
        if self._awaiting is None:
            return  # its submit failed: its completion says so
        fence, plan, layout, extras = self._awaiting
        self._awaiting = None
        plan = replace(plan, masks=masks, masks_later=False)
        self._guarded(fence, plan, lambda: self._finish_step(fence, plan, layout, extras))

    def _finish_step(self, fence: int, plan: Plan, layout: Layout | None, extras: StepExtras | None) -> None:
        """A graph step's sampling and copies back, or an eager step whole."""
        if layout is not None:
            self._launch_sampling(fence, plan, layout, extras)
        else:
            self._pending.append(_Ready(plan, self._run_eager(fence, plan)))
            os.write(self._wake_write, b"x")

    def _guarded(self, fence: int, plan: Plan, work: Callable[[], None]) -> None:
        """Run part of a step; a failure fails its requests (a sticky device fault, the engine)."""
        try:
            work()
        except Exception as exc:
            log.exception("graph step %d failed", fence)
            self.fault = self.fault or sticky_fault(self.kv_cache.device)
            self._mirror.forget([row.slot for row in plan.rows])
            self._awaiting = None
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
                if self.fault is not None:  # the watcher sets it before it advances _completed
                    raise DeviceFault(self.fault)
                ready.append((head.plan, self._collected(head)))
            else:
                ready.append((head.plan, head.completion))
            self._pending.popleft()
        self._in_flight -= len(ready)
        if self.fault is not None:
            raise DeviceFault(self.fault)
        return ready

    def disk_done(self) -> list[DiskDone]:
        """The steps whose disk work ended since the last call (engine/executor/disk_worker.py)."""
        return self._disk.done()

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
        self._disk.close()
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
        del self.kv_cache, self.state, self._buffers, self._out_dev, self._label_index, self._label_dev, self._spans, \
            self._verdicts_dev, self._extras, self._logprobs_dev, self._known, self._prompt_in, self._prompt_dev, \
            self._pool_index, self._pool_dev
        torch.cuda.empty_cache()
        os.close(self.wake_fd)
        os.close(self._wake_write)

    # --- a step -------------------------------------------------------------------------------------------------
    def _layout_for(self, plan: Plan) -> Layout | None:
        """The smallest graph that holds the plan, or None for a step that runs eagerly (so does one whose extras
        the graphs do not hold: `submit` asks)."""
        rows = plan.rows
        if not rows:
            return None
        # Passes at C speed over the rows (plan.py's field getters): the checks run on every step.
        if None in fields(rows, ROPE_SHIFT) or len(plan.state_copies) > self._state_copies:
            return None
        if plan.kind == "verify":  # one-token rows in a decode graph, when nothing else needs a span
            if plan.masks or plan.masks_later or step_extras(rows, self._vocab) is not None or \
                    any(row.scores or row.pool or (row.length > 1 and not row.draft) for row in rows):
                return None
            i = bisect.bisect_left(self._decode_caps, sequence_rows(rows))
            return self._decode[self._decode_caps[i]] if i < len(self._decode_caps) else None
        if any(fields(rows, SCORES)):
            index = graph_index(plan, self._vocab)
            if index is None or len(index[1]) > self._max_labels:
                return None
        if plan.kind == "decode":
            i = bisect.bisect_left(self._decode_caps, len(rows))
            return self._decode[self._decode_caps[i]] if i < len(self._decode_caps) else None
        i = bisect.bisect_left(self._extend_caps, plan.num_tokens)
        return self._extend[self._extend_caps[i]] if i < len(self._extend_caps) else None

    @property
    def host_pages(self) -> HostPages | None:
        return self._eager.host_pages

    @host_pages.setter
    def host_pages(self, pages: HostPages | None) -> None:
        """The host tier's slots; the eager steps copy them too."""
        self._eager.host_pages = pages

    def _launch_model(self, fence: int, plan: Plan, layout: Layout, extras: StepExtras | None) -> None:
        """On the model stream: the step's tier and page copies, its frame and extras, the model graph."""
        if self.host_pages is not None and moves(plan):
            with torch.cuda.stream(self._model_stream):
                self._tier_events[fence] = self.host_pages.copy(self.kv_cache, self.state, plan, self._copy_stream)
        self._copy_pages(plan.copies)
        k = fence % MAX_IN_FLIGHT
        packed = replace(plan, rows=verify_rows(plan.rows)) if plan.kind == "verify" else plan
        words = pack(packed, layout, self._host_np[k], self._views[k][layout], self._mirror, self.page_size,
                     self.trash)
        rt, model = self._rt, self._model_stream.cuda_stream
        rt.eventRecord(self._start[k], model)
        rt.memcpyAsync(self._buffers.frame.data_ptr(), self._host[k].data_ptr(), words * 4, H2D, model)
        if extras is not None:
            self._upload_extras(plan, extras, k, layout.seqs)
        rt.graphLaunch(self._exec[layout], model)
        if extras is not None and extras.prompt.shape[1]:
            self._prompt_logprobs(extras.prompt, k)

    def _launch_sampling(self, fence: int, plan: Plan, layout: Layout, extras: StepExtras | None) -> None:
        """On the model stream after the model graph: the masks, the sampling graph and what reads its tokens; then
        the copies back, on the copy stream, and the step handed to the watcher."""
        k = fence % MAX_IN_FLIGHT
        verify = plan.kind == "verify"
        greedy = not any(map(TEMPERATURE, compress(fields(plan.rows, SAMPLING), fields(plan.rows, SAMPLE))))
        rt, model, copy, seqs = self._rt, self._model_stream.cuda_stream, self._copy_stream.cuda_stream, layout.seqs
        if plan.masks:  # grammar masks, one row per plan row; rows past the plan are padding and sample nothing
            self._masks_host[k].numpy().reshape(-1)[:len(plan.masks) // 4] = np.frombuffer(plan.masks, np.int32)
            rt.memcpyAsync(self._buffers.masks.data_ptr(), self._masks_host[k].data_ptr(), len(plan.masks), H2D,
                           model)
        elif extras is not None and extras.sample:  # the extras sampler applies masks: these allow everything
            rt.memsetAsync(self._buffers.masks.data_ptr(), 255, self._buffers.masks[:seqs].nbytes, model)
        mode = "extras" if extras is not None and extras.sample else "masked" if plan.masks else "plain"
        rt.graphLaunch(self._exec[(seqs, greedy, mode)], model)
        labels = self._gather_labels(plan, k) if any(fields(plan.rows, SCORES)) else ()
        pooled = self._pool_embeddings(plan, k) if pools(plan) else ()
        verified = self._accept(plan, k, layout) if verify else 0
        # The next step's sampling overwrites `sampled`; this frame's copy waits for nobody.
        rt.memcpyAsync(self._out_dev[k].data_ptr(), self._buffers.sampled.data_ptr(), seqs * 8, D2D, model)
        logprobs = extras is not None and extras.logprobs
        if logprobs:
            rt.memcpyAsync(self._logprobs_dev[k].data_ptr(), self._extras.logprobs.data_ptr(),
                           self._extras.logprobs[:seqs].nbytes, D2D, model)
        rt.eventRecord(self._end[k], model)
        rt.streamWaitEvent(copy, self._end[k], 0)
        rt.memcpyAsync(self._out_host[k].data_ptr(), self._out_dev[k].data_ptr(), seqs * 8, D2H, copy)
        if labels:
            count = sum(len(query.token_ids) for query in labels)
            rt.memcpyAsync(self._label_host[k].data_ptr(), self._label_dev[k].data_ptr(), count * 4, D2H, copy)
        if pooled:
            rt.memcpyAsync(self._pool_host[k].data_ptr(), self._pool_dev[k].data_ptr(),
                           self._pool_dev[k][:len(pooled)].nbytes, D2H, copy)
        if verified:
            rt.memcpyAsync(self._verdicts_host[k].data_ptr(), self._verdicts_dev[k].data_ptr(), verified * 16, D2H,
                           copy)
        if logprobs:
            rt.memcpyAsync(self._logprobs_host[k].data_ptr(), self._logprobs_dev[k].data_ptr(),
                           self._logprobs_dev[k][:seqs].nbytes, D2H, copy)
        if extras is not None and extras.prompt.shape[1]:
            rt.memcpyAsync(self._prompt_out_host[k].data_ptr(), self._prompt_dev[k].data_ptr(),
                           self._prompt_dev[k][:extras.prompt.shape[1]].nbytes, D2H, copy)
        rt.eventRecord(self._done[k], copy)
        rows = sequence_rows(plan.rows) if verify else len(plan.rows)
        self._pending.append(_Launched(fence, plan, k, layout.kind, labels, rows, verified, extras, pooled))
        self._watch.put((fence, self._done[k], plan))

    def _upload_extras(self, plan: Plan, extras: StepExtras, k: int, seqs: int) -> None:
        """On the model stream, before the graphs: the extras frame and the penalty state of the tokens the host
        gives."""
        rt, model = self._rt, self._model_stream.cuda_stream
        if extras.sample:
            pack_extras(plan.rows, self._extras_views[k][seqs])
            rt.memcpyAsync(self._extras.inputs.data_ptr(), self._extras_host[k].data_ptr(), extras_words(seqs) * 4,
                           H2D, model)
        count = extras.known_count
        if not count:
            return
        self._known_host[k].numpy()[:count] = np.concatenate(extras.known)
        rt.memcpyAsync(self._known.data_ptr(), self._known_host[k].data_ptr(), count * 8, H2D, model)
        reset, seen, _ = map(len, extras.known)
        with torch.cuda.stream(self._model_stream):
            apply_known_tokens(self._extras.counts, self._extras.seen, self._known[:reset],
                               self._known[reset:reset + seen], self._known[reset + seen:count])

    def _prompt_logprobs(self, positions: np.ndarray, k: int) -> None:
        """On the model stream, after the extend graph: the prompt graph once per PROMPT_ROWS asked positions, its
        logprob rows gathered into frame k's buffer."""
        rt, model = self._rt, self._model_stream.cuda_stream
        count = positions.shape[1]
        chunks = -(-count // PROMPT_ROWS)
        padded = np.zeros((2, chunks * PROMPT_ROWS), dtype=np.int64)
        padded[:, :count] = positions
        self._prompt_host[k].numpy()[:chunks] = padded.reshape(2, chunks, PROMPT_ROWS).transpose(1, 0, 2)
        chunk_bytes = self._prompt_in[0].nbytes
        rt.memcpyAsync(self._prompt_in.data_ptr(), self._prompt_host[k].data_ptr(), chunks * chunk_bytes, H2D, model)
        rows_bytes = self._extras.prompt_logprobs.nbytes
        for chunk in range(chunks):
            rt.memcpyAsync(self._extras.prompt_positions.data_ptr(), self._prompt_in[chunk].data_ptr(), chunk_bytes,
                           D2D, model)
            rt.graphLaunch(self._exec[(PROMPT_ROWS, "prompt")], model)
            rt.memcpyAsync(self._prompt_dev[k][chunk * PROMPT_ROWS].data_ptr(),
                           self._extras.prompt_logprobs.data_ptr(), rows_bytes, D2D, model)

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

    def _pool_embeddings(self, plan: Plan, k: int) -> tuple[Row, ...]:
        """On the model stream, after the model graph: the embedding rows' pooled states (from the extend graph's
        kept hidden states) into frame k's pooling buffer; the rows, in plan order."""
        rows, index = pool_index(plan)
        count = index.shape[1]
        self._pool_index_host[k].numpy()[:2 * count] = index.reshape(-1)
        self._rt.memcpyAsync(self._pool_index.data_ptr(), self._pool_index_host[k].data_ptr(), 2 * count * 8, H2D,
                             self._model_stream.cuda_stream)
        with torch.cuda.stream(self._model_stream):
            pool_rows(self._extras.hidden, self._pool_index[:2 * count].view(2, count), self._pool_dev[k][:len(rows)])
        return rows

    def _collected(self, step: _Launched) -> Completion:
        """The step's completion; reading it calls the device too (its events' times), which a fault since the step
        ended makes fail."""
        try:
            completion = self._collect(step)
            events = self._tier_events.pop(step.fence, None)
            if events is None:
                return completion
            return replace(completion, tier_seconds=events[0].elapsed_time(events[1]) / 1000)
        except Exception as exc:
            log.exception("reading graph step %d failed", step.fence)
            self.fault = self.fault or sticky_fault(self.kv_cache.device)
            if self.fault is not None:
                raise DeviceFault(self.fault) from exc
            return Completion(step.fence, (), (), (), 0.0, error=f"execution failed: {type(exc).__name__}: {exc}")

    def _collect(self, step: _Launched) -> Completion:
        k = step.frame
        rows = step.plan.rows
        samples = self._out_host[k].numpy()[:step.seqs].tolist()
        accepted: list[int] = []
        if step.verified:
            verdicts = self._verdicts_host[k].numpy()[:2 * step.verified].reshape(2, -1)
            tokens, accepted = verify_results(rows, samples, verdicts)
        else:
            tokens = list(compress(samples, fields(rows, SAMPLE)))
        sample = list(fields(rows, SAMPLE))
        start = self._rt.eventElapsedTime(self._origin, self._start[k])
        end = self._rt.eventElapsedTime(self._origin, self._end[k])
        self.spans.append((start, end, len(step.plan.rows), step.kind))
        count = sum(len(query.token_ids) for query in step.labels)
        scores = assemble(list(step.labels), self._label_host[k].numpy()[:count].tolist()) if count else ()
        # (a copy: the frame's buffer takes a later step's vectors)
        pooled = assemble_pooled(step.pooled, self._pool_host[k].numpy()[:len(step.pooled)].copy()) \
            if step.pooled else ()
        logprobs, prompt, extras = (), (), step.extras
        if extras is not None and extras.logprobs:
            logprobs = read_logprobs(rows, tokens, self._logprobs_host[k].numpy(), self._extras.top)
        if extras is not None and extras.prompt.shape[1]:
            prompt = read_prompt_logprobs(rows, self._prompt_out_host[k].numpy()[:extras.prompt.shape[1]],
                                          self._extras.top)
        return Completion(step.fence, tuple(compress(fields(rows, SLOT), sample)),
                          tuple(compress(fields(rows, GENERATION), sample)),
                          tuple(tokens), (end - start) / 1000, scores=scores, accepted=tuple(accepted),
                          logprobs=logprobs, prompt_logprobs=prompt, pooled=pooled)

    def _run_eager(self, fence: int, plan: Plan) -> Completion:
        """The eager executor's step (page copies included) on the model stream; its tokens reaching the host end
        it. It reads its own page tables, so the device's per-slot rows stay as the mirror says."""
        with torch.cuda.stream(self._model_stream):
            completion = self._eager._execute(fence, plan, time.perf_counter())
        if plan.disk is not None:
            self._rt.streamSynchronize(self._model_stream.cuda_stream)  # its spills, before their slots are written
            self._disk.queue(fence, plan.disk, self.host_pages)
        return completion

    def _copy_pages(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Private copies of cached pages, before the step that reads them (rare: exact prefix checkpoints)."""
        if not copies:
            return
        with torch.cuda.stream(self._model_stream):
            copy_pages(self.kv_cache, copies, self.page_size)

    def _watch_events(self) -> None:
        while (item := self._watch.get()) is not None:
            fence, event, plan = item
            try:
                self._rt.eventSynchronize(event)
                if plan.disk is not None:  # its copies are done
                    self._disk.queue(fence, plan.disk, self.host_pages)
            except Exception as exc:  # a device fault: sticky, the engine stops (poll raises it)
                self.fault = f"{type(exc).__name__}: {exc}"
            self._completed = fence
            os.write(self._wake_write, b"x")
