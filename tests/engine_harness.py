"""A tiny random Llama driven through the real scheduler and eager executor, without processes or sockets."""

from __future__ import annotations

import itertools
import select

import torch

from common.protocol import SamplingParams
from engine.executor.eager import EagerExecutor
from engine.model.llama import LlamaConfig, LlamaForCausalLM
from engine.scheduler.request import Request
from engine.scheduler.scheduler import RequestScheduler

TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_hf(TINY)).eval()
    with torch.no_grad():  # larger weights than the default init, so outputs vary from token to token
        for p in model.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
    return model


class Harness:
    def __init__(self, model: LlamaForCausalLM, num_pages: int = 64, page_size: int = 16, max_active: int = 8,
                 chunk: int = 48, proposer: object = None) -> None:
        self.executor = EagerExecutor(model, num_pages, page_size, max_active, torch.device("cpu"))
        self.scheduler = RequestScheduler(max_active, 64, num_pages, page_size, chunk, proposer=proposer)
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
