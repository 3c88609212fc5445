"""FP8 checkpoints end to end on the CPU: tiny random Llama and Qwen3 checkpoints written in each FP8 format
(tests/support/fp8_checkpoints.py quantizes every decoder linear by the format's definition, scales beside the
weights), or dense ones exported with `ignition export --quant fp8`; the core keeps e4m3 weights and their scales,
the engine dequantizes them at load, and greedy tokens over HTTP (the openai client) equal transformers' on the
dequantized weights (fp32). Where transformers reads the format itself (block-wise, blocks dividing the weights), the
reference is transformers' own loading of the FP8 checkpoint."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
import transformers
from safetensors import safe_open

from common.manifest import load_manifest, write_manifest
from ignition.main import main as ignition
from tests.e2e.test_families import CAPACITIES, CONVERSATIONS, FAMILIES, build_checkpoint, chat, hf_generate, ids_of
from tests.support.fp8_checkpoints import (BLOCK, CHANNEL_DYNAMIC, TENSOR_STATIC, channel_quantized, is_linear,
                                           rewrite_as_fp8)
from tests.support.servers import Server

pytestmark = pytest.mark.slow
EXPORTED = "export --quant fp8"
# (family, format, block, the core's scheme)
CASES = {
    "qwen3-block-32x32": ("qwen3", BLOCK, (32, 32), "fp8-block-32x32"),
    "llama-block-128x128": ("llama", BLOCK, (128, 128), "fp8-block-128x128"),  # partial blocks: 64 columns
    "llama-compressed-tensors-channel": ("llama", CHANNEL_DYNAMIC, None, "fp8-channel"),
    "qwen3-compressed-tensors-tensor-static": ("qwen3", TENSOR_STATIC, None, "fp8-channel"),
    "llama-export-quant-fp8": ("llama", EXPORTED, None, "fp8-channel"),
    "qwen3-export-quant-fp8": ("qwen3", EXPORTED, None, "fp8-channel"),
}
# A short prompt and one of several prefill chunks.
PROMPTS = CONVERSATIONS[1:3]
CHECKPOINTS = {**FAMILIES, "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False})}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(case, a server of the FP8 core, transformers' model on the dequantized weights, the core)."""
    family, fmt, block, scheme = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = build_checkpoint(family, root, CHECKPOINTS)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # like ignore_eos: always the same number of tokens
    if fmt == EXPORTED:  # quantized by --quant fp8's definition
        quantized = {name: channel_quantized(weight) for name, weight in reference.state_dict().items()
                     if is_linear(name)}
        dense = {name: values.float() * scale for name, (values, scale) in quantized.items()}
    else:
        dense = rewrite_as_fp8(hf_dir, fmt, block or (128, 128))
    reference.load_state_dict(dense, strict=False)
    if block == (32, 32):  # transformers dequantizes this checkpoint itself: to the same weights
        own = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
        assert all(torch.equal(own[name], value) for name, value in reference.state_dict().items())
    core = root / "core"
    assert ignition(["export", str(hf_dir), str(core), *(["--quant", "fp8"] if fmt == EXPORTED else [])]) == 0
    manifest = load_manifest(core)
    assert manifest.quantization == scheme
    write_manifest(core, msgspec.structs.replace(manifest, capacities=CAPACITIES))
    server = Server(core)
    yield request.param, server, reference, core
    server.stop()


def test_the_core_holds_e4m3_weights_and_greedy_tokens_equal_transformers_on_the_dequantized_weights(case) -> None:
    name, server, reference, core = case
    with safe_open(core / "model.safetensors", framework="pt") as weights:
        linears = [n for n in weights.keys() if is_linear(n.removesuffix(".fp8"))]
        assert linears and all(n.endswith(".fp8") and weights.get_slice(n).get_dtype() == "F8_E4M3"
                               for n in linears)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = [ids_of(r) for r in pool.map(lambda m: chat(server, m), PROMPTS)]
    assert len({token for _, tokens in results for token in tokens}) > 10, "degenerate outputs would test little"
    assert max(len(prompt) for prompt, _ in results) > 2 * CAPACITIES.prefill_chunk_size
    for (prompt, tokens), messages in zip(results, PROMPTS):
        assert tokens == hf_generate(reference, prompt), (name, messages)
