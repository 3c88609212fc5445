"""A tiny random model (Llama, or another family) driven through the real scheduler and eager executor, without processes or sockets."""

from __future__ import annotations

import itertools
import select

import torch

from common.protocol import SamplingParams
from engine.executor.eager import EagerExecutor
from engine.model.config import DecoderConfig
from engine.model.decoder import CausalLM
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
}


def tiny_model(seed: int = 0, family: str = "llama", **changes: object) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(DecoderConfig.from_hf(family, {**TINY, **FAMILY_CONFIGS[family], **changes})).eval()
    with torch.no_grad():  # larger weights than the default init, so outputs vary from token to token
        for p in model.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
    return model


class Harness:
    def __init__(self, model: CausalLM, num_pages: int = 64, page_size: int = 16, max_active: int = 8,
                 chunk: int = 48) -> None:
        self.executor = EagerExecutor(model, num_pages, page_size, max_active, torch.device("cpu"))
        self.scheduler = RequestScheduler(max_active, 64, num_pages, page_size, chunk)
        self._ids = itertools.count()
        self.steps = 0

    def add(self, prompt: list[int], message_ends: list[int] = (), **sampling: object) -> Request:
        params = SamplingParams(**sampling)
        request = Request(f"r{next(self._ids)}", b"test", len(prompt), list(prompt), params,
                          params.seed if params.seed is not None else 0, frozenset(params.stop_token_ids),
                          params.max_tokens, float(next(self._ids)), message_ends=list(message_ends))
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
        while self.scheduler.has_work():
            self.step()
        while not self.executor.can_submit() or self.scheduler.pages.retiring_count:
            select.select([self.executor.wake_fd], [], [], 0.05)
            for plan, completion in self.executor.poll():
                self.scheduler.complete(completion, plan)
            if self.executor.can_submit() and not self.scheduler.pages.retiring_count:
                break

    def close(self) -> None:
        self.executor.close()
