"""A tiny random model (Llama, or another family) driven through the real scheduler and eager executor, without processes or sockets."""

from __future__ import annotations

import itertools
import select
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from common.protocol import SamplingParams
from engine.cache.host_tier import HostTier
from engine.executor.factory import make_executor
from engine.executor.tier_copies import host_slot_bytes
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
from engine.model.recurrent_state import SNAPSHOTS_PER_SLOT, RecurrentState
from engine.sampling.grammar import mask_words
from engine.scheduler.plan import Plan
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler

TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


# What each family adds to TINY: its features at tiny sizes (MoE: 8 experts, top 2; Gemma 3: a window of 24 on the
# outer layers, a global layer between them).
FAMILY_CONFIGS = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 32},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                  "num_hidden_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 24, "num_hidden_layers": 3,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    # A hybrid: 3 linear-attention layers (2 key heads serving 4 value heads) and a gated attention layer.
    "qwen3_5": {"head_dim": 32, "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}},
}
# The mixture-of-experts hybrids: Qwen3.5's layers, each MLP 8 experts (top 2) beside a shared expert.
HYBRID_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
              "shared_expert_intermediate_size": 32, "norm_topk_prob": True}
FAMILY_CONFIGS |= {family: {**FAMILY_CONFIGS["qwen3_5"], **HYBRID_MOE} for family in ("qwen3_5_moe", "qwen3_next")}


def tiny_model(seed: int = 0, family: str = "llama", **changes: object) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(DecoderConfig.from_hf(family, {**TINY, **FAMILY_CONFIGS[family], **changes})).eval()
    with torch.no_grad():  # larger weights than the default init, so outputs vary from token to token
        for p in model.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
    return model


class Harness:
    def __init__(self, model: CausalLM, num_pages: int = 64, page_size: int = 16, max_active: int = 8,
                 chunk: int = 48, proposer: object = None, snapshots: int | None = None,
                 device: str = "cpu", host_slots: int = 0, graphs: bool = False, host_snapshots: int = 0,
                 late_masks: bool = False) -> None:
        """`snapshots`: a hybrid model's snapshot rows (None: as many as the engine would keep; 0: none); `device`:
        the model's; `host_slots`: a host tier's pages, `host_snapshots` its snapshot rows; `graphs`: the graph
        executor (on a GPU); `late_masks`: constrained steps go two deep, their masks given once the step before
        completed (run_split)."""
        if snapshots is None and model.config.hybrid:
            snapshots = SNAPSHOTS_PER_SLOT * max_active
        self.executor = make_executor(model, num_pages, page_size, max_active, torch.device(device), 512, chunk,
                                      graphs, snapshots or 0, host_slots, host_snapshots=host_snapshots)
        dtype = model.model.embed_tokens.weight.dtype
        host = HostTier(host_slots, host_snapshots) if host_slots else None
        self.scheduler = RequestScheduler(max_active, 64, num_pages, page_size, chunk, proposer=proposer,
                                          snapshots=snapshots, host=host,
                                          page_bytes=host_slot_bytes(model.config, page_size, model.cache_dtype),
                                          snapshot_bytes=RecurrentState.row_bytes(model.config, dtype),
                                          late_masks=late_masks)
        self._ids = itertools.count()
        self.steps = 0

    def add(self, prompt: list[int], message_ends: list[int] = (),
            label_queries: list[tuple[int, tuple[int, ...]]] = (), pooling: str = "", grammar: object = None,
            **sampling: object) -> Request:
        """A request as the engine admits it; with label queries a scored prefill, with a pooling an embedding
        (either generates nothing); `grammar`: a constrained request's matcher (the scheduler only asks whether
        there is one)."""
        params = SamplingParams(**sampling)
        request = Request(f"r{next(self._ids)}", b"test", len(prompt), list(prompt), params,
                          params.seed if params.seed is not None else 0, frozenset(params.stop_token_ids),
                          0 if label_queries or pooling else params.max_tokens, float(next(self._ids)),
                          message_ends=list(message_ends), label_queries=list(label_queries), pooling=pooling,
                          grammar=grammar)
        self.scheduler.add(request)
        return request

    def step(self) -> list:
        """Submit what can be submitted, wait for one completion, return its StepResult."""
        while self.executor.can_submit() and (plan := self.scheduler.plan()) is not None:
            self.scheduler.commit(plan, self.executor.next_fence())
            self.executor.submit(plan)
            self.steps += 1
        select.select([self.executor.wake_fd], [], [], 5)
        results = []
        for plan, completion in self.executor.poll():
            assert completion.error is None, completion.error
            results.append(self.scheduler.complete(completion, plan))
        return results

    def run(self) -> None:
        """Until every request ended and the copies their ends left (exact checkpoints) are made, as the engine
        loop makes them in its next step."""
        while self.scheduler.has_work() or self.scheduler.prefix.pending:
            self.step()
        while not self.executor.can_submit() or self.scheduler.pages.retiring_count:
            select.select([self.executor.wake_fd], [], [], 0.05)
            for plan, completion in self.executor.poll():
                self.scheduler.complete(completion, plan)
            if self.executor.can_submit() and not self.scheduler.pages.retiring_count:
                break

    def close(self) -> None:
        self.executor.close()


def run_split(harness: Harness, constrained: set, vocab: int, allowed: Callable[[Request], int] | None = None
              ) -> list[tuple[set, set]]:
    """Run the harness as the engine loop does; masks (when `allowed` is given) allow constrained rows only the token
    it names for their request as it is when the masks are made (as a matcher, it sees the tokens committed before).
    With the scheduler's late masks, a step planned while another is in flight gets its masks once that one has
    completed (Plan.masks_later). Returns, per submitted plan, (slots in it, slots of every step then in flight)."""
    steps, in_flight, late = [], [], None

    def masks(plan: Plan) -> bytes:
        words = np.full((len(plan.rows), mask_words(vocab)), -1, dtype=np.int32)
        for i, row in enumerate(plan.rows):
            if (request := harness.scheduler.slots[row.slot]) in constrained:
                token = allowed(request)
                words[i] = 0
                words[i, token // 32] = np.int32(np.uint32(1 << token % 32))
        return words.tobytes()

    while harness.scheduler.has_work():
        while harness.executor.can_submit() and (plan := harness.scheduler.plan()) is not None:
            harness.scheduler.commit(plan, harness.executor.next_fence())
            rows = {r.slot for r in plan.rows}
            if allowed is not None and any(harness.scheduler.slots[s] in constrained for s in rows):
                if in_flight and harness.scheduler.late_masks:
                    late, plan = plan, replace(plan, masks_later=True)
                else:
                    plan = replace(plan, masks=masks(plan))
            steps.append((rows, set().union(*in_flight) if in_flight else set()))
            in_flight.append(rows)
            harness.executor.submit(plan)
        select.select([harness.executor.wake_fd], [], [], 5)
        for plan, completion in harness.executor.poll():
            in_flight.pop(0)
            harness.scheduler.complete(completion, plan)
        if late is not None and len(in_flight) == 1:
            harness.executor.give_masks(masks(late))
            late = None
    return steps
