"""The vision tower's static-shape body (what engine/executor/vision_graphs.py captures) against the tower called
as it is on the CPU: padded rows and split calls change no image's features. On the CPU the kernel path runs under
TRITON_INTERPRET=1 and a graph's "replay" runs its captured function eagerly; on a GPU the graphs are replayed."""

from __future__ import annotations


import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from engine.executor.vision_graphs import VisionGraphs, groups, vision_capacities  # noqa: E402
from engine.model.backends.triton import KernelTower  # noqa: E402
from engine.model.qwen3_vl_vision import VisionConfig, VisionTower  # noqa: E402
from tests.engine.test_qwen3_vl_vision import VISION, prepared  # noqa: E402

DEVICE = torch.device("cuda" if GPU else "cpu")
SIZES = [(300, 300), (130, 100), (40, 300), (64, 64), (200, 40)]  # 160, 48, 36, 16 and 24 patches


def tower(kernels: bool, dtype: torch.dtype = torch.float32) -> VisionTower | KernelTower:
    config = VisionConfig.from_hf({**VISION, "spatial_merge_size": 2, "temporal_patch_size": 2})
    torch.manual_seed(0)
    model = VisionTower(config).eval()
    model.to(DEVICE, dtype)
    model.set_rope(DEVICE)
    return KernelTower(model) if kernels else model


def assert_same(got: tuple[torch.Tensor, list[torch.Tensor]], expected: tuple[torch.Tensor, list[torch.Tensor]],
                tokens: int | None = None, tolerance: float = 0.0) -> None:
    """Bit for bit unless a tolerance is given."""
    features, deepstack = got
    assert len(deepstack) == len(expected[1]) == 2
    for ours, reference in zip([features, *deepstack], [expected[0], *expected[1]]):
        torch.testing.assert_close(ours[:tokens], reference, rtol=tolerance, atol=tolerance)


def test_capacities_and_groups() -> None:
    assert vision_capacities(100, 2) == [1024]
    assert vision_capacities(2048 + 64, 2) == [1024, 2048, 4096, 8192, 16384]
    assert vision_capacities(1 << 20, 2)[-1] == 16384
    assert groups([160, 48, 36, 16, 24], 64) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert groups([], 64) == []


@pytest.mark.skipif(GPU, reason="CPU numbers: a GPU's GEMMs may pick other kernels for other row counts")
@pytest.mark.parametrize("kernels", [False, True])
def test_padded_body_gives_the_unpadded_towers_features(kernels: bool) -> None:
    """Bit for bit: padding rows come after the images, which no real row sees, and the CPU's GEMMs give each row
    the same numbers whatever the row count."""
    model = tower(kernels)
    patches, grids = prepared(SIZES[1:4])
    rows = patches.shape[0]
    padded = torch.cat([patches, torch.randn(64, patches.shape[1])])
    with torch.inference_mode():
        expected = model(patches, grids)
        got = model.body(padded, model.inputs(grids, rows + 64))
    assert_same(got, expected, rows // 4)


def test_kernel_path_matches_the_sdpa_path() -> None:
    patches, grids = prepared(SIZES[1:4])
    with torch.inference_mode():
        expected = tower(False)(patches.to(DEVICE), grids)
        features, deepstack = tower(True)(patches.to(DEVICE), grids)
    torch.testing.assert_close(features, expected[0], rtol=1e-4, atol=1e-4)
    for layer, reference in zip(deepstack, expected[1]):
        torch.testing.assert_close(layer, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(GPU, reason="the GPU's version below replays real graphs")
def test_vision_graphs_give_the_towers_features() -> None:
    """Capacities of 32 and 64 patches: the first image runs eagerly (too large), the others in three calls, one of
    two images, each padded. Not bit for bit: an image that starts at another row than in the one call over all
    of them cuts its keys into other tiles, so the online softmax rounds differently (float32: 1e-5)."""
    model = tower(True)
    patches, grids = prepared(SIZES)
    graphs = VisionGraphs(model, [32, 64], DEVICE)
    with torch.inference_mode():
        expected = model(patches, grids)
    assert_same(graphs(patches, grids), expected, tolerance=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_graph_replays_give_the_eager_towers_features(dtype: torch.dtype) -> None:
    """Replayed graphs at 32 and 64 patches (and one image run eagerly) against the eager kernel-path tower: equal
    within GEMM reassociation (other row counts may pick other cuBLAS kernels)."""
    model = tower(True, dtype)
    patches, grids = prepared(SIZES)
    graphs = VisionGraphs(model, [32, 64], DEVICE)
    assert graphs.graph_count == 2
    patches = patches.to(DEVICE, dtype)
    with torch.inference_mode():
        expected = model(patches, grids)
        first = graphs(patches, grids)
        again = graphs(patches, grids)
    assert_same(again, first)  # a replay is deterministic
    assert_same(first, expected, tolerance=1e-4 if dtype == torch.float32 else 2e-2)
    graphs.close()
