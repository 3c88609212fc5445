"""Qwen3-VL's kernel path (the GPU's: Triton attention, per-token M-RoPE table, fused norms) against its torch path on
a prompt with an image and the decode steps after it: on the GPU when there is one, otherwise under
TRITON_INTERPRET=1 on the CPU at a tiny size."""

from __future__ import annotations

import copy
import os

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of a kernel module
pytest.importorskip("triton")

from transformers import Qwen3VLConfig  # noqa: E402

from common.protocol import ImageInput, SamplingParams  # noqa: E402
from common.vision import ImageProcessing  # noqa: E402
from engine.executor.images import vision_step  # noqa: E402
from engine.executor.inputs import build_inputs  # noqa: E402
from engine.model.config import DecoderConfig  # noqa: E402
from engine.model.qwen3_vl import VisionLanguageLM  # noqa: E402
from engine.model.qwen3_vl_vision import VisionConfig  # noqa: E402
from engine.scheduler.plan import Plan, Row  # noqa: E402
from frontend.image_decode import ImageLimits  # noqa: E402
from frontend.image_prepare import prepare  # noqa: E402
from tests.image_samples import encode, picture  # noqa: E402

DEVICE = torch.device("cuda" if GPU else "cpu")
PAGE = 16
IMAGE_TOKEN = 5
SETTINGS = ImageProcessing(image_token_id=IMAGE_TOKEN, vision_start_token_id=3, vision_end_token_id=4,
                           min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16)


def tiny_model() -> VisionLanguageLM:
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1], patch_size=16),
        image_token_id=IMAGE_TOKEN).to_dict()
    torch.manual_seed(0)
    model = VisionLanguageLM(DecoderConfig.from_hf("qwen3_vl", config), VisionConfig.from_hf(config["vision_config"]))
    with torch.no_grad():  # larger weights than the default init, so outputs vary from token to token
        for p in model.model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return model.to(DEVICE).eval()


def row(start: int, length: int, tokens: tuple[int, ...] | None, image: ImageInput) -> Row:
    return Row(slot=0, generation=1, start=start, length=length, tokens=tokens, page_table=tuple(range(8)),
               sample=True, output_index=0, sampling=SamplingParams(temperature=0), seed=0, prompt_len=length,
               images=(image,))


def run(model: VisionLanguageLM, prompt: list[int], image: ImageInput, decodes: int) -> list[torch.Tensor]:
    """Logits of the prompt's last position, then of each greedy decode step."""
    c = model.config
    kv = torch.zeros(c.num_layers, 2, 8 * PAGE, c.num_kv_heads, c.head_dim, device=DEVICE)
    plans = [Plan((row(0, len(prompt), tuple(prompt), image),))]
    outputs, token = [], None
    for step in range(decodes + 1):
        plan = plans[-1]
        inputs = build_inputs(plan, PAGE, DEVICE)
        ids = inputs.input_ids
        if token is not None:
            ids[inputs.device_token_rows] = token
        positions, images = vision_step(model, plan, DEVICE)
        with torch.inference_mode():
            logits = model.logits(model(ids, positions, kv, inputs.meta, images)[inputs.sample_rows])
        outputs.append(logits)
        token = logits.argmax(-1)
        plans.append(Plan((row(len(prompt) + step, 1, None, image),)))
    return outputs


def test_kernel_path_gives_the_torch_paths_logits() -> None:
    prepared = prepare(encode(picture(70, 45), "PNG"), SETTINGS, ImageLimits(), "image")
    prompt = [1, 2, 3] + [IMAGE_TOKEN] * prepared.tokens + [4, 7, 8, 9]
    image = ImageInput(prepared.identity, 3, list(prepared.grid), prepared.patches.tobytes())
    torch_path = tiny_model()
    kernel_path = copy.deepcopy(torch_path)
    kernel_path.use_kernels(512)
    expected, got = run(torch_path, prompt, image, 3), run(kernel_path, prompt, image, 3)
    for reference, logits in zip(expected, got):
        torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-3)
