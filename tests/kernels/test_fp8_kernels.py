"""The FP8 products (engine/kernels/triton/fp8_linear.py) against their torch references: on the GPU when there is
one, otherwise under TRITON_INTERPRET=1 on the CPU at small sizes. Stated tolerances: against the references (the same
quantization, fp32 sums in another order), 1e-5 relative in fp32 outputs and 1e-2 in 16-bit ones; against the
unquantized product, the FP8 rounding itself: under 5% relative for weights alone (e4m3 keeps 3 mantissa bits,
about 2-3% relative error a value on random weights), under 8% with the activations quantized too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.kernels.triton.fp8_linear import (DEQUANTIZED_CONFIG, DequantizedConfig, GemmConfig,  # noqa: E402
                                              fp8_dequantized_gemm, fp8_gemm, fp8_gemm_reference, fp8_scaled_mm,
                                              fp8_weight_only_reference, gemm_block_k, quantize_rows,
                                              quantize_rows_reference)
from engine.kernels.triton.gemv import gemv  # noqa: E402
from engine.model.fp8 import rows_expanded  # noqa: E402
from tests.support.fp8_checkpoints import block_quantized, channel_quantized  # noqa: E402

pytestmark = [pytest.mark.gpu] if GPU else []
DEVICE = torch.device("cuda" if GPU else "cpu")
# The interpreter has no bfloat16 dot (tests/kernels/test_triton_kernels.py): float16 stands in there.
DTYPES = [torch.bfloat16, torch.float32] if GPU else [torch.float16, torch.float32]
# (N, K, block or None for one scale per channel): Llama-3.1-8B's gate/up and down on the GPU, with 128 x 128 blocks
# and per channel; small ones on the CPU, with partial blocks (K = 80 over blocks of 32 columns).
SHAPES = [(28672, 4096, (128, 128)), (4096, 14336, None)] if GPU else [(40, 80, (16, 32)), (24, 64, None),
                                                                        (48, 96, (128, 128)), (24, 200, (8, 96))]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12))


def weight(n: int, k: int, block: tuple[int, int] | None, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
    """(dense weight, e4m3 values, the kernels' scales [N, S], the columns of a scale)."""
    dense = torch.randn(n, k, generator=generator) * 0.05
    if block is None:
        values, scale = channel_quantized(dense)
        return dense, values, scale, None
    values, scale = block_quantized(dense, block)
    return dense, values, rows_expanded(scale, n, block[0]), block[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, block", SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_weight_only_product_equals_its_reference(n: int, k: int, block: tuple[int, int] | None, rows: int,
                                                  dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(n + k + rows)
    dense, values, scale, scale_k = weight(n, k, block, generator)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    values, scale, x, bias = (t.to(DEVICE) for t in (values, scale, x, bias))
    out = gemv(x, values, bias, scale=scale, scale_k=scale_k)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = fp8_weight_only_reference(x, values, scale, scale_k, bias)
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert relative_error(out, x.float() @ dense.to(DEVICE).T + bias.float()) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, block", SHAPES)
@pytest.mark.parametrize("rows, split_k", [(5, 1), (70, 1), (5, 3)])
def test_dequantizing_gemm_equals_the_weight_only_reference(n: int, k: int, block: tuple[int, int] | None, rows: int,
                                                            split_k: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(n + k + rows)
    dense, values, scale, scale_k = weight(n, k, block, generator)
    if scale_k is not None and gemm_block_k(scale_k, k) is None:
        pytest.skip("scale blocks that take no K tile run the GEMV")
    x = torch.randn(rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    values, scale, x, bias = (t.to(DEVICE) for t in (values, scale, x, bias))
    # Rows over two row tiles under the interpreter; split K over K tiles of a scale block or less.
    config = replace(DEQUANTIZED_CONFIG if GPU else DequantizedConfig(32, 16, 64, 4, 2), split_k=split_k)
    out = fp8_dequantized_gemm(x, values, scale, scale_k, bias, config)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = fp8_weight_only_reference(x, values, scale, scale_k, bias)
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert relative_error(out, x.float() @ dense.to(DEVICE).T + bias.float()) < 0.05


@pytest.mark.skipif(not GPU, reason="cuBLASLt's FP8 product runs on a GPU")
@pytest.mark.parametrize("rows", [5, 700])
def test_cublaslt_product_with_row_wise_scales_equals_the_gemms_reference(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    dense, values, scale, _ = weight(4096, 14336, None, generator)
    x = (torch.randn(rows, 14336, generator=generator) * torch.rand(rows, 1, generator=generator) * 4).bfloat16()
    bias = torch.randn(4096, generator=generator).bfloat16()
    values, scale, x, bias = (t.to(DEVICE) for t in (values, scale, x, bias))
    out = fp8_scaled_mm(x, values, scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 4096)
    assert relative_error(out, fp8_gemm_reference(x, values, scale, None, bias)) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, block", SHAPES)
@pytest.mark.parametrize("rows, split_k", [(5, 1), (70, 1), (70, 3)])
def test_fp8_gemm_with_per_token_activation_scales_equals_its_reference(
        n: int, k: int, block: tuple[int, int] | None, rows: int, split_k: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(n * k + rows)
    dense, values, scale, scale_k = weight(n, k, block, generator)
    x = (torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 4).to(dtype)
    x[1] = 0  # a row of zeros: the bias alone out
    bias = torch.randn(n, generator=generator).to(dtype)
    values, scale, x, bias = (t.to(DEVICE) for t in (values, scale, x, bias))
    out = fp8_gemm(x, values, scale, scale_k, bias, config=GemmConfig(32, 32, 4, 2, group_m=2, split_k=split_k))
    assert out.dtype == dtype and out.shape == (rows, n) and torch.equal(out[1], bias)
    assert relative_error(out, fp8_gemm_reference(x, values, scale, scale_k, bias)) < \
        (1e-5 if dtype == torch.float32 else 1e-2)
    assert relative_error(out, x.float() @ dense.to(DEVICE).T + bias.float()) < 0.08


def test_rows_are_quantized_per_token_as_their_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 300, generator=generator) * torch.arange(6.0)[:, None]
    # a tie (100 between 96 and 104: to even, 96), a carry into the next binade (124.3: 128), a subnormal
    x[2, :5] = torch.tensor([448.0, 100.0, 124.3, -250.0, 0.01])
    x = x.to(DEVICE)
    values, scales = quantize_rows(x, block_k=128)
    expected_values, expected_scales = quantize_rows_reference(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.float(), expected_values.float())  # as numbers: -0 (zeros times -1) equals 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_and_silu_kernels_write_the_rows_quantize_rows_makes_of_their_output(dtype: torch.dtype) -> None:
    """add_rms_norm_e4m3 and silu_and_mul_e4m3: the same e4m3 bytes and scales as their bf16 (here fp16/fp32) kernels
    followed by quantize_rows, a row of zeros among them, and the same product from the FP8 GEMM."""
    from engine.kernels.triton.activation import silu_and_mul, silu_and_mul_e4m3
    from engine.kernels.triton.rmsnorm import add_rms_norm, add_rms_norm_e4m3

    generator = torch.Generator().manual_seed(4)
    hidden, inter = (4096, 14336) if GPU else (96, 2100)  # a SiLU row over several of its kernel's blocks
    x, residual = (torch.randn(2, 7, hidden, generator=generator) * 3).to(dtype).to(DEVICE)
    x[3] = -residual[3]  # a row of zeros
    weight = (torch.randn(hidden, generator=generator) * 0.5 + 1).to(dtype).to(DEVICE)
    gate_up = (torch.randn(7, 2 * inter, generator=generator) * 2).to(dtype).to(DEVICE)
    gate_up[2] = 0
    same_bytes = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    rows, fused_summed = add_rms_norm_e4m3(x, residual, weight, 1e-6)
    values, scales = quantize_rows(normed)
    assert torch.equal(fused_summed, summed) and rows.dtype == dtype
    assert same_bytes(rows.values, values) and torch.equal(rows.scales, scales)
    rows = silu_and_mul_e4m3(gate_up)
    values, scales = quantize_rows(silu_and_mul(gate_up))
    assert same_bytes(rows.values, values) and torch.equal(rows.scales, scales)
    w_values, w_scale = channel_quantized(torch.randn(32, inter, generator=generator))
    w_values, w_scale = w_values.to(DEVICE), w_scale.to(DEVICE)
    assert torch.equal(fp8_gemm(rows, w_values, w_scale, None), fp8_gemm(silu_and_mul(gate_up), w_values, w_scale,
                                                                          None))


def test_gemm_tiles_fit_inside_scale_blocks() -> None:
    assert gemm_block_k(128, 4096) == 128 and gemm_block_k(4096, 4096) == 128
    assert gemm_block_k(96, 192) == 32 and gemm_block_k(32, 80) == 32
    assert gemm_block_k(48, 96) is None  # no tile of 32 or more divides 48 columns: the weight-only kernel runs
