"""An FP8 core on the kernel path: its linears stay FP8 (engine/model/fp8_linear.py), fused as the Triton backend
fuses them, and run the FP8 kernels; on the CPU under the Triton interpreter, against the same core dequantized (the
torch reference, fp32). Steps of up to DEQUANTIZED_ROWS tokens take the GEMV or the dequantizing GEMM: the
activations as they are, so greedy tokens equal the reference's. Longer steps take the FP8 GEMM, which rounds the
activations to e4m3 per token: its logits equal the reference's with each FP8 linear's input rounded so (in this tiny random model that
rounding alone moves the logits by a quarter). On a GPU: the captured graphs give the eager executor's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.kernels.triton.fp8_linear import quantize_rows_reference  # noqa: E402
from engine.model.backends.select import use_backend  # noqa: E402
from engine.model.fp8_linear import DEQUANTIZED_ROWS, Fp8Linear  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from tests.support.tiny_cores import write_tiny_core  # noqa: E402
from tests.support.engine_harness import Harness  # noqa: E402
from tests.support.fp8_checkpoints import as_fp8  # noqa: E402

CONTEXT = 1024
SHORT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # a prompt step within DEQUANTIZED_ROWS, then steps of one row
LONG = list(range(20, 44))  # one over it: the FP8 GEMM


@pytest.fixture(scope="module")
def fp8_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # q/k/v with per-channel scales and gate/up with blocks: the fused products join both kinds
    return as_fp8(write_tiny_core(tmp_path_factory.mktemp("fp8"), "llama"), (16, 32))


def kernel_model(core: Path, device: str = "cpu") -> torch.nn.Module:
    _, model = load_model(core, torch.device(device), fp8_kernels=True)
    use_backend(model, "triton", CONTEXT)
    return model


def greedy(model: torch.nn.Module, prompt: list[int], device: str = "cpu") -> list[int]:
    harness = Harness(model, device=device)
    request = harness.add(prompt, temperature=0.0, max_tokens=4, ignore_eos=True)
    harness.run()
    harness.close()
    return request.tokens[len(prompt):]


def last_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    harness = Harness(model, chunk=len(prompt))  # one step of the whole prompt
    request = harness.add(prompt, label_queries=[(len(prompt) - 1, tuple(range(model.config.vocab_size)))])
    harness.run()
    harness.close()
    return torch.tensor(request.label_logits[len(prompt) - 1])


@pytest.mark.skipif(GPU, reason="the GPU compares graphs with eager steps (below)")
def test_fp8_kernels_run_the_fused_fp8_linears_with_the_dequantized_cores_tokens(fp8_core: Path) -> None:
    model = kernel_model(fp8_core)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv, Fp8Linear) and attn.qkv.scale_k is None
    assert isinstance(mlp.gate_up, Fp8Linear) and mlp.gate_up.scale_k == 32
    assert isinstance(attn.o_proj, Fp8Linear) and attn.o_proj.values.dtype == torch.float8_e4m3fn
    _, reference = load_model(fp8_core, torch.device("cpu"))
    assert len(SHORT) <= DEQUANTIZED_ROWS < len(LONG)
    assert greedy(model, SHORT) == greedy(reference, SHORT)
    for layer in reference.model.layers:  # the GEMM's activations: each row rounded to e4m3 with its own scale
        for linear in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(linear, torch.nn.Linear):
                linear.register_forward_pre_hook(per_token_e4m3)
    got, want = last_logits(model, LONG), last_logits(reference, LONG)
    assert float((got - want).norm() / want.norm()) < 1e-4


@pytest.mark.skipif(GPU, reason="the GPU compares graphs with eager steps (below)")
def test_fp8_experts_stay_fp8_on_the_kernel_path_with_the_dequantized_cores_tokens(tmp_path: Path) -> None:
    """A mixture-of-experts core whose experts are FP8 with block scales: the fused MoE kernels read them as e4m3
    (dequantized in registers; a step of this size takes the rows path, tests/kernels/test_triton_kernels.py checks
    the grouped one), and the greedy tokens are the dequantized core's."""
    core = as_fp8(write_tiny_core(tmp_path, "qwen3_moe"), (16, 32))
    model = kernel_model(core)
    mlp = model.model.layers[0].mlp
    assert mlp.w13.dtype == mlp.w2.dtype == torch.float8_e4m3fn and mlp.scales.scale_k == 32
    _, reference = load_model(core, torch.device("cpu"))
    assert reference.model.layers[0].mlp.scales is None
    assert greedy(model, SHORT) == greedy(reference, SHORT)


def per_token_e4m3(module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
    x = inputs[0]
    values, scales = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
    return ((values.float() * scales[:, None]).reshape(x.shape),)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_fp8_graphs_give_the_eager_executors_tokens(family: str, tmp_path: Path) -> None:
    """One prompt of two whole prefill chunks, then decode steps of one row: every step takes the same kernels
    eager and in its graph (a step just under DEQUANTIZED_ROWS tokens would not where its graph pads it past them:
    eager the dequantizing GEMM, in its graph the FP8 GEMM); a MoE core's FP8 experts through both fused MoE
    paths."""
    from tests.engine.test_graph_executor import CHUNK, gpu_harness

    fp8_core = as_fp8(write_tiny_core(tmp_path, family), (16, 32))
    prompt = list(range(10, 10 + 2 * CHUNK))
    tokens = []
    for graphs in (True, False):
        harness = gpu_harness(kernel_model(fp8_core, "cuda"), graphs)
        request = harness.add(prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
        harness.run()
        harness.close()
        tokens.append(request.tokens[len(prompt):])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.skipif(GPU, reason="the GPU compares graphs with eager steps (below)")
def test_long_steps_take_their_e4m3_rows_from_the_norm_and_silu_kernels(fp8_core: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step over DEQUANTIZED_ROWS: q/k/v and gate/up take their rows quantized by the RMSNorm kernel, down by the
    SiLU kernel (engine/model/backends/triton_layers.py), with the logits of quantizing them apart, bit for bit."""
    from engine.kernels.triton.activation import silu_and_mul
    from engine.kernels.triton.fp8_linear import E4m3Rows, quantize_rows
    from engine.kernels.triton.rmsnorm import add_rms_norm
    from engine.model.backends import triton_layers

    model = kernel_model(fp8_core)
    fused = {"norm": 0, "silu": 0}
    for name, key in (("add_rms_norm_e4m3", "norm"), ("silu_and_mul_e4m3", "silu")):
        def counted(*args: object, made=getattr(triton_layers, name), key=key) -> object:
            fused[key] += 1
            return made(*args)
        monkeypatch.setattr(triton_layers, name, counted)
    got = last_logits(model, LONG)
    layers = len(model.model.layers)
    assert fused == {"norm": 2 * layers, "silu": layers}

    def apart(x: torch.Tensor) -> E4m3Rows:
        return E4m3Rows(*quantize_rows(x), x.dtype)

    monkeypatch.setattr(triton_layers, "add_rms_norm_e4m3",
                        lambda *args: (apart(add_rms_norm(*args)[0]), add_rms_norm(*args)[1]))
    monkeypatch.setattr(triton_layers, "silu_and_mul_e4m3", lambda x: apart(silu_and_mul(x)))
    assert torch.equal(last_logits(model, LONG), got)
