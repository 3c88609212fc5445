"""A decode step's attention in fewer launches on the kernel path (engine/model/backends/triton_layers.py): the
rotary and cache store inside the decode kernel. Under the Triton interpreter on the CPU (fp32), requests decoding
together and one alone (the one-row GEMV path) produce the separate launches' greedy tokens, for Llama, for Qwen3's
per-head norms and for a mixture of experts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.model.backends import triton_layers  # noqa: E402
from engine.model.backends.select import use_backend  # noqa: E402
from tests.support.engine_harness import Harness, tiny_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 77)), [3] * 18]


def decode(family: str, prompts: list[list[int]]) -> list[list[int]]:
    model = tiny_model(0, family)
    use_backend(model, "triton", 1024)
    harness = Harness(model)
    requests = [harness.add(prompt, temperature=0.0, max_tokens=8, ignore_eos=True) for prompt in prompts]
    harness.run()
    harness.close()
    return [r.tokens[r.prompt_len:] for r in requests]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU: tests/engine/test_graph_executor.py")
@pytest.mark.parametrize(("family", "prompts"), [("llama", PROMPTS), ("llama", PROMPTS[:1]), ("qwen3", PROMPTS[:1]),
                                                ("qwen3_moe", PROMPTS[:1])],
                         ids=["llama-together", "llama-alone", "qwen3-alone", "qwen3_moe-alone"])
def test_decode_attention_in_fewer_launches_gives_the_same_tokens(family: str, prompts: list[list[int]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_layers, "ROTARY_IN_DECODE", False)
    separate = decode(family, prompts)
    monkeypatch.setattr(triton_layers, "ROTARY_IN_DECODE", True)
    assert decode(family, prompts) == separate
