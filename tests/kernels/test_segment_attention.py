"""The vision tower's attention kernel (engine/kernels/triton/segment_attention.py) against its torch reference: on the GPU
when there is one, otherwise under TRITON_INTERPRET=1 on the CPU at small sizes (float16 stands in for bfloat16)."""

from __future__ import annotations


import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.kernels.triton.segment_attention import (segment_attention, segment_attention_reference, segment_bounds,  # noqa: E402
                                                      tile_config)
from tests.kernels.test_triton_kernels import relative_error, tolerance  # noqa: E402

pytestmark = [pytest.mark.gpu] if GPU else []
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if GPU else [torch.float16, torch.float32]
# Images' patch counts: odd ones, one shorter than a tile, one row alone; Qwen3-VL's 4,096-patch image on the GPU.
SEGMENTS = [[37, 5, 64, 1, 100], [16]] + ([[4096, 1024, 300]] if GPU else [])


def projection(rows: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the tower has them: strided views into one fused qkv product [rows, 3, heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, 3, heads, head_dim, generator=g) * 2).to(dtype).to(DEVICE)
    return qkv.unbind(1)


def test_segment_bounds_name_each_rows_segment_and_pad_alone() -> None:
    bounds = segment_bounds([3, 2], rows=7)
    assert bounds.tolist() == [[0, 0, 0, 3, 3, 5, 6], [3, 3, 3, 5, 5, 6, 7]]
    with pytest.raises(ValueError, match="do not fit"):
        segment_bounds([3, 2], rows=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", SEGMENTS)
@pytest.mark.parametrize("head_dim", [72, 64] if GPU else [72, 16])
def test_segment_attention_matches_reference(dtype: torch.dtype, lengths: list[int], head_dim: int) -> None:
    heads = 16 if GPU else 2
    q, k, v = projection(sum(lengths), heads, head_dim, dtype, seed=sum(lengths) + head_dim)
    bounds = segment_bounds(lengths, device=DEVICE)
    ref = segment_attention_reference(q, k, v, bounds)
    if len(lengths) > 1:  # the segments matter: one softmax over all rows is far from the reference
        whole = segment_attention_reference(q, k, v, segment_bounds([sum(lengths)], device=DEVICE))
        assert relative_error(whole, ref) > 0.05
    assert relative_error(segment_attention(q, k, v, bounds), ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_change_no_real_row(dtype: torch.dtype) -> None:
    """A graph's capacity pads the rows, each padding row its own segment: the real rows' outputs are the unpadded
    call's, bit for bit (their extra key tiles are fully masked, adding exact zeros)."""
    lengths = [37, 5, 64]
    total, capacity = sum(lengths), 2 * tile_config(dtype, DEVICE)[0] * 2
    q, k, v = projection(capacity, 2, 72, dtype, seed=7)
    unpadded = segment_attention(q[:total], k[:total], v[:total], segment_bounds(lengths, device=DEVICE))
    padded = segment_attention(q, k, v, segment_bounds(lengths, capacity, DEVICE))
    assert torch.equal(padded[:total], unpadded)
    assert not padded.isnan().any()
    torch.testing.assert_close(padded[total:], v[total:])  # a row alone sees only itself
