"""EagerExecutor: plain torch on a worker thread, two submissions in flight.

The engine loop keeps ingesting and planning while the worker runs a step (torch releases the GIL in its kernels).
Each slot's last sampled token stays in a device tensor, so decode step N+1 can be submitted before step N's tokens
reach the host. A step whose grammar masks come later (Plan.masks_later) waits whole for them: the worker runs one
step at a time, so there is no forward to overlap with them.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import replace

import torch

from common.protocol import Logprobs
from engine.executor.disk_worker import DiskWorker
from engine.executor.faults import DeviceFault, sticky_fault
from engine.executor.images import vision_step
from engine.executor.inputs import build_inputs
from engine.executor.pooling import eager_pooled
from engine.executor.tier_copies import HostPages, moves
from engine.model.decoder import CausalLM
from engine.model.image_features import Tower
from engine.model.qwen3_vl import VisionLanguageLM
from engine.model.recurrent_state import RecurrentState
from engine.sampling.label_scores import eager_scores
from engine.sampling.penalty_state import apply_known_tokens, known_tokens
from engine.sampling.sampler import apply_penalties, sample, token_logprobs
from engine.scheduler.plan import Completion, DiskDone, Plan, Row
from engine.speculative.verify import accept

MAX_IN_FLIGHT = 2


def kv_cache_shape(model: CausalLM, num_pages: int, page_size: int) -> tuple[int, ...]:
    c = model.config
    return (len(c.kv_layers), 2, num_pages * page_size, c.num_kv_heads, c.head_dim)


def pages_for_budget(model: CausalLM, page_size: int, budget_bytes: int, dtype: torch.dtype) -> int:
    """`dtype`: the cache's (CausalLM.cache_dtype): an FP8 cache fits twice a bfloat16 one's pages."""
    c = model.config
    page_bytes = len(c.kv_layers) * 2 * page_size * c.num_kv_heads * c.head_dim * dtype.itemsize
    return max(budget_bytes // page_bytes, 1)


def copy_pages(kv_cache: torch.Tensor, copies: tuple[tuple[int, int], ...], page_size: int) -> None:
    """Each (source page, destination page) of every layer's K and V, as bytes where the elements are single bytes
    (an FP8 cache: indexing copies of float8 tensors are not on every device's list)."""
    if not copies:
        return
    cache = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
    offsets = torch.arange(page_size, device=cache.device)
    src = (torch.tensor([s for s, _ in copies], device=cache.device)[:, None] * page_size + offsets).flatten()
    dst = (torch.tensor([d for _, d in copies], device=cache.device)[:, None] * page_size + offsets).flatten()
    cache[:, :, dst] = cache[:, :, src]


class EagerExecutor:
    def __init__(self, model: CausalLM, num_pages: int, page_size: int, max_active: int,
                 device: torch.device, snapshots: int = 0) -> None:
        """`snapshots`: a hybrid model's state rows beyond the slots', for exact checkpoints (Plan.state_copies)."""
        self.model = model
        self.device = device
        self.page_size = page_size
        self.num_pages = num_pages
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_pages, page_size), dtype=model.cache_dtype,
                                    device=device)
        # A hybrid model's linear-attention layers: a state row per slot, then its snapshot rows
        # (engine/model/recurrent_state.py).
        self.state = RecurrentState(model.config, max_active + snapshots, dtype, device) \
            if model.config.hybrid else None
        self.slot_tokens = torch.zeros(max_active, dtype=torch.int64, device=device)
        vocab = model.config.vocab_size
        # Penalty state per slot: output token counts, and every token seen (prompt and output).
        self.output_counts = torch.zeros(max_active, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(max_active, vocab, dtype=torch.bool, device=device)
        # A vision model's tower: its own module, or (set by the GraphExecutor) its captured graphs.
        self.vision_tower: Tower | None = None
        self.fault: str | None = None
        self.host_pages: HostPages | None = None  # the host tier's slots, when there is one (make_executor)
        self._fence = 0
        self._in_flight = 0
        self.late_masks = True
        self._awaiting: tuple[int, Plan] | None = None  # the step submitted whose masks are to come
        self._work: queue.SimpleQueue[tuple[int, Plan] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Plan, Completion]] = queue.SimpleQueue()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._disk = DiskWorker(self._wake_write)
        self._worker = threading.Thread(target=self._run, name="eager-executor", daemon=True)
        self._worker.start()

    def can_submit(self) -> bool:
        return self._in_flight < MAX_IN_FLIGHT

    def next_fence(self) -> int:
        return self._fence + 1

    def submit(self, plan: Plan) -> None:
        self._fence += 1
        self._in_flight += 1
        if plan.masks_later:
            self._awaiting = (self._fence, plan)
        else:
            self._work.put((self._fence, plan))

    def give_masks(self, masks: bytes) -> None:
        fence, plan = self._awaiting
        self._awaiting = None
        self._work.put((fence, replace(plan, masks=masks, masks_later=False)))

    def poll(self) -> list[tuple[Plan, Completion]]:
        if self.fault is not None:
            raise DeviceFault(self.fault)
        try:
            os.read(self.wake_fd, 1 << 16)
        except BlockingIOError:
            pass
        ready = []
        while True:
            try:
                ready.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(ready)
        return ready

    def disk_done(self) -> list[DiskDone]:
        """The steps whose disk work ended since the last call (engine/executor/disk_worker.py)."""
        return self._disk.done()

    def close(self) -> None:
        self._work.put(None)
        self._worker.join()
        self._disk.close()
        os.close(self.wake_fd)
        os.close(self._wake_write)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            fence, plan = item
            started = time.perf_counter()
            try:
                completion = self._execute(fence, plan, started)
                if plan.disk is not None:
                    if self.kv_cache.is_cuda:  # its copies done (a step without rows returns before they are)
                        torch.cuda.current_stream(self.device).synchronize()
                    self._disk.queue(fence, plan.disk, self.host_pages)
            except Exception as exc:  # a failed step fails its requests; a sticky device fault, the engine
                self.fault = self.fault or sticky_fault(self.device)
                completion = Completion(fence, (), (), (), time.perf_counter() - started,
                                        error=f"execution failed: {type(exc).__name__}: {exc}")
            self._done.put((plan, completion))
            os.write(self._wake_write, b"x")

    @torch.inference_mode()
    def _execute(self, fence: int, plan: Plan, started: float) -> Completion:
        tier_seconds = 0.0
        if self.host_pages is not None and moves(plan):
            self.host_pages.copy(self.kv_cache, self.state, plan)
            if not self.kv_cache.is_cuda:  # (on a GPU the copies are queued, not done: not timed here)
                tier_seconds = time.perf_counter() - started
        self._copy_pages(plan.copies)
        if plan.state_copies:
            self.state.copy_rows(plan.state_copies)
        if not plan.rows:
            return Completion(fence, (), (), (), time.perf_counter() - started, tier_seconds=tier_seconds)
        step = build_inputs(plan, self.page_size, self.device, self.state)
        if self.state is not None and (fresh := [row.slot for row in plan.rows if row.start == 0]):
            self.state.reset(torch.tensor(fresh, device=self.device))
        input_ids = step.input_ids
        if step.device_token_rows.numel():
            input_ids[step.device_token_rows] = self.slot_tokens[step.device_token_slots]
        self._record_prompt_tokens(plan)
        positions, images = step.positions, None
        if isinstance(self.model, VisionLanguageLM):
            positions, images = vision_step(self.model, plan, self.device, self.vision_tower)
        hidden = self.model(input_ids, positions, self.kv_cache, step.meta, images)
        logits = self.model.logits(hidden[step.sample_rows])
        if step.sampling.any_penalty:  # the slots' state rows are [S, vocab] copies: only when someone reads them
            logits = apply_penalties(logits, step.sampling, self.output_counts[step.sample_slots],
                                     self.seen[step.sample_slots])
        tokens = sample(logits, step.sampling)
        # Penalty state counts every sampled position; verify rows belong to requests without penalties, whose
        # state nobody reads (a request's first row resets its slot's).
        self.output_counts.index_put_((step.sample_slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                      accumulate=True)
        self.seen[step.sample_slots, tokens] = True
        sampled = [row for row in plan.rows if row.sample]
        lasts, accepted = None, ()
        if any(row.draft for row in sampled):
            lasts, tokens, accepted = self._verify(sampled, tokens)
            logits = logits[lasts]
        self.slot_tokens[step.sample_slots if lasts is None else step.sample_slots[lasts]] = tokens
        return Completion(fence, tuple(r.slot for r in sampled), tuple(r.generation for r in sampled),
                          tuple(tokens.tolist()), time.perf_counter() - started,
                          logprobs=self._logprobs(sampled, logits, tokens),
                          prompt_logprobs=self._prompt_logprobs(plan, hidden),
                          scores=eager_scores(plan, hidden, self.model.logits), accepted=accepted,
                          pooled=eager_pooled(plan, hidden), tier_seconds=tier_seconds)

    def _verify(self, sampled: list[Row], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                           tuple[int, ...]]:
        """Per sampled row: the index of its last sample, the token it emits last, and its accepted drafts
        (engine/speculative/verify.py)."""
        widths = [len(row.draft) + 1 for row in sampled]
        firsts = torch.tensor([0] + widths[:-1], device=self.device).cumsum(0)
        width = torch.tensor(widths, device=self.device)
        columns = torch.arange(max(widths), device=self.device)
        grid = tokens[firsts[:, None] + torch.minimum(columns[None, :], width[:, None] - 1)]
        drafts = torch.tensor([list(row.draft) + [-1] * (max(widths) - 1 - len(row.draft)) for row in sampled],
                              dtype=torch.int64, device=self.device).view(len(sampled), max(widths) - 1)
        accepted, final = accept(grid, drafts, width)
        return firsts + width - 1, final, tuple(accepted.tolist())

    def _copy_pages(self, copies: tuple[tuple[int, int], ...]) -> None:
        copy_pages(self.kv_cache, copies, self.page_size)

    def _record_prompt_tokens(self, plan: Plan) -> None:
        """Host-known tokens enter the slot's penalty state; a request's first row clears what the slot held."""
        reset, seen, counted = (torch.from_numpy(index).to(self.device)
                                for index in known_tokens(plan.rows, self.output_counts.shape[1]))
        apply_known_tokens(self.output_counts, self.seen, reset, seen, counted)

    def _logprobs(self, sampled: list[Row], logits: torch.Tensor, tokens: torch.Tensor
                  ) -> tuple[Logprobs | None, ...]:
        wanted = [r.sampling.logprobs for r in sampled if r.sampling.logprobs is not None]
        if not wanted:
            return ()
        chosen, top_ids, top = token_logprobs(logits, tokens, max(wanted))
        chosen, top_ids, top, ids = chosen.tolist(), top_ids.tolist(), top.tolist(), tokens.tolist()
        return tuple(
            Logprobs([ids[i]], [chosen[i]], [top_ids[i][:r.sampling.logprobs]], [top[i][:r.sampling.logprobs]])
            if r.sampling.logprobs is not None else None for i, r in enumerate(sampled))

    def _prompt_logprobs(self, plan: Plan, hidden: torch.Tensor) -> tuple[tuple[int, int, Logprobs], ...]:
        result = []
        first = 0
        for row in plan.rows:
            if row.prompt_targets:
                count = len(row.prompt_targets)
                targets = torch.tensor(row.prompt_targets, dtype=torch.int64, device=self.device)
                k = row.sampling.prompt_logprobs or 0
                chosen, top_ids, top = token_logprobs(self.model.logits(hidden[first:first + count]), targets, k)
                result.append((row.slot, row.generation, Logprobs(list(row.prompt_targets), chosen.tolist(),
                                                                  top_ids.tolist(), top.tolist())))
            first += row.length
        return tuple(result)
