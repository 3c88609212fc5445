"""The engine's Qwen3-VL vision tower (engine/model/qwen3_vl_vision.py) and M-RoPE positions (common/mrope.py)
against transformers' Qwen3VLVisionModel and get_rope_index, and Qwen3.5's (the same tower without deepstack, the
same positions), fp32 on the CPU, fed by the frontend's preparation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5Model, Qwen3_5VisionModel, Qwen3VLConfig, Qwen3VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from common.mrope import mrope_positions
from common.vision import ImageProcessing
from engine.model.qwen3_vl_vision import VisionConfig, VisionTower
from frontend.images.decode import ImageLimits
from frontend.images.prepare import prepare
from tests.support.image_samples import encode, picture

VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 2], patch_size=16)
TEXT = dict(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=24)
# family -> (transformers' config, its vision tower, its model (get_rope_index), the config's sub-configs)
FAMILIES = {
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLVisionModel, Qwen3VLModel, dict(vision_config=VISION, text_config=TEXT)),
    "qwen3_5": (Qwen3_5Config, Qwen3_5VisionModel, Qwen3_5Model,
                dict(vision_config={k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"},
                     text_config=dict(TEXT, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                                      linear_value_head_dim=8))),
}
SETTINGS = ImageProcessing(image_token_id=5, vision_start_token_id=3, vision_end_token_id=4,
                           min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 40)
SIZES = [(130, 100), (40, 300), (64, 64)]


def tower_pair(family: str) -> tuple[torch.nn.Module, VisionTower]:
    """transformers' tower of the family, random, and ours with its weights."""
    config_class, tower_class, _, parts = FAMILIES[family]
    config = config_class(**parts)
    torch.manual_seed(0)
    reference = tower_class(config.vision_config).eval()
    ours = VisionTower(VisionConfig.from_hf(config.vision_config.to_dict())).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


@pytest.fixture(scope="module")
def towers() -> tuple[Qwen3VLVisionModel, VisionTower]:
    return tower_pair("qwen3_vl")


def prepared(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    images = [prepare(encode(picture(w, h, seed=i), "PNG"), SETTINGS, ImageLimits(), "image")
              for i, (w, h) in enumerate(sizes)]
    return torch.from_numpy(np.concatenate([i.patches for i in images])), [i.grid for i in images]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("count", [1, 3])
def test_tower_features_match_transformers(family: str, count: int) -> None:
    reference, ours = tower_pair(family)
    patches, grids = prepared(SIZES[:count])
    with torch.no_grad():
        expected = reference(patches, grid_thw=torch.tensor(grids))
        features, deepstack = ours(patches, grids)
    assert features.shape == (sum(t * h * w for t, h, w in grids) // 4, VISION["out_hidden_size"])
    torch.testing.assert_close(features, expected.pooler_output, rtol=1e-5, atol=1e-5)
    expected_stack = getattr(expected, "deepstack_features", None) or []  # Qwen3.5's tower has none
    assert len(deepstack) == len(expected_stack) == {"qwen3_vl": 2, "qwen3_5": 0}[family]
    for ours_layer, reference_layer in zip(deepstack, expected_stack):
        torch.testing.assert_close(ours_layer, reference_layer, rtol=1e-5, atol=1e-5)


def test_tower_runs_in_bfloat16(towers: tuple[Qwen3VLVisionModel, VisionTower]) -> None:
    """GPU cores are bf16 while the frontend's patches are float32: the tower takes them (it once failed on the
    H200 with a dtype mismatch that fp32 tests could not show) and stays close to its fp32 self."""
    _, ours = towers
    patches, grids = prepared(SIZES[:2])
    half = VisionTower(ours.config).eval()
    half.load_state_dict(ours.state_dict())
    half.to(torch.bfloat16)
    with torch.no_grad():
        features, deepstack = half(patches, grids)
        expected, _ = ours(patches, grids)
    assert features.dtype == torch.bfloat16 and len(deepstack) == 2
    torch.testing.assert_close(features.float(), expected, rtol=0.1, atol=0.1)


def test_images_do_not_attend_to_each_other(towers: tuple[Qwen3VLVisionModel, VisionTower]) -> None:
    _, ours = towers
    patches, grids = prepared(SIZES[:2])
    alone, _ = prepared(SIZES[:1])
    with torch.no_grad():
        together, _ = ours(patches, grids)
        first, _ = ours(alone, grids[:1])
    torch.testing.assert_close(together[: first.shape[0]], first, rtol=1e-5, atol=1e-5)


def test_window_attention_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="window attention"):
        VisionConfig.from_hf({**VISION, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                              "fullatt_block_indexes": [1]})


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", [
    [(3, (1, 4, 6))],  # one image after a short text
    [(2, (1, 8, 4)), (15, (1, 2, 2))],  # two images, text between
    [(0, (1, 6, 6))],  # an image first, the prompt ending in text
    [(5, (1, 4, 4))],  # the prompt ending right after the image
])
def test_mrope_positions_match_get_rope_index(family: str, layout: list[tuple[int, tuple[int, int, int]]]) -> None:
    config_class, _, model_class, parts = FAMILIES[family]
    model = model_class(config_class(**parts))
    end = layout[-1][0] + SETTINGS.tokens(layout[-1][1])
    length = end + (0 if layout == [(5, (1, 4, 4))] else 7)
    types = torch.zeros(1, length, dtype=torch.int32)
    for offset, grid in layout:
        types[0, offset: offset + SETTINGS.tokens(grid)] = 1
    expected, delta = model.get_rope_index(torch.zeros(1, length, dtype=torch.long), types,
                                           image_grid_thw=torch.tensor([grid for _, grid in layout]))
    positions, ours_delta = mrope_positions(length, layout, merge_size=2)
    assert np.array_equal(positions, expected[:, 0].numpy())
    assert ours_delta == int(delta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tower_on_the_gpu_matches_the_cpu(towers: tuple[Qwen3VLVisionModel, VisionTower]) -> None:
    _, ours = towers
    patches, grids = prepared(SIZES)
    with torch.no_grad():
        expected, expected_stack = ours(patches, grids)
        gpu = VisionTower(ours.config).eval()
        gpu.load_state_dict(ours.state_dict())
        gpu = gpu.cuda()
        gpu.set_rope(torch.device("cuda"))
        features, deepstack = gpu(patches.cuda(), grids)
    torch.testing.assert_close(features.cpu(), expected, rtol=1e-4, atol=1e-4)
    for layer, reference in zip(deepstack, expected_stack):
        torch.testing.assert_close(layer.cpu(), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("start, length, expected", [
    (0, 10, 10),  # ends before the image at 10
    (0, 12, 10),  # would end inside it: stops before it
    (10, 5, 16),  # starts at it: takes all of it, over the budget
    (12, 2, 14),  # starts inside it (a cached prefix ended there): takes the rest
    (0, 26, 26),  # ends exactly at its end
    (20, 10, 10),  # after it, then before the next at 40
    (30, 12, 10),  # would cut the second image: stops before it
    (30, 15, 15),  # takes the second image whole
])
def test_prefill_chunks_never_cut_an_image_span(start: int, length: int, expected: int) -> None:
    from common.protocol import SamplingParams
    from engine.scheduler.request import Request

    request = Request("r", b"f", 60, [0] * 60, SamplingParams(), 0, frozenset(), 8, 0.0,
                      image_spans=((10, 26, -8), (40, 44, -2)))
    assert request.atomic_length(start, length) == expected


def test_text_rows_after_images_are_plain_rope_rows_shifted() -> None:
    from common.protocol import SamplingParams
    from engine.scheduler.request import Request

    request = Request("r", b"f", 60, [0] * 60, SamplingParams(), 0, frozenset(), 8, 0.0,
                      image_spans=((10, 26, -8), (40, 44, -2)))
    assert request.rope_shift(0, 10) == 0 and request.rope_shift(26, 40) == -8 and request.rope_shift(60, 61) == -10
    assert request.rope_shift(5, 12) is None and request.rope_shift(43, 50) is None
