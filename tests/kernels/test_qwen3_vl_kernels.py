"""Qwen3-VL's kernel path (the GPU's: Triton attention, per-token M-RoPE table, fused norms) against its torch path on
a prompt with an image and the decode steps after it: on the GPU when there is one, otherwise under
TRITON_INTERPRET=1 on the CPU at a tiny size."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest
import torch

GPU = torch.cuda.is_available()
pytest.importorskip("triton")

from transformers import Qwen3VLConfig  # noqa: E402

from common.mrope import mrope_delta  # noqa: E402
from common.protocol import ImageInput, SamplingParams  # noqa: E402
from common.vision import ImageProcessing  # noqa: E402
from engine.executor.eager import EagerExecutor  # noqa: E402
from engine.executor.images import vision_step  # noqa: E402
from engine.executor.inputs import build_inputs  # noqa: E402
from engine.model.backends.select import use_backend  # noqa: E402
from engine.model.config import DecoderConfig  # noqa: E402
from engine.model.qwen3_vl import VisionLanguageLM  # noqa: E402
from engine.model.qwen3_vl_vision import VisionConfig  # noqa: E402
from engine.scheduler.plan import Plan, Row  # noqa: E402
from engine.scheduler.request import Request  # noqa: E402
from frontend.images.decode import ImageLimits  # noqa: E402
from frontend.images.prepare import prepare  # noqa: E402
from tests.support.engine_harness import Harness  # noqa: E402
from tests.support.image_samples import encode, picture  # noqa: E402

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


def run(model: VisionLanguageLM, prompt: list[int], image: ImageInput, decodes: int, plain_decode: bool = False
        ) -> list[torch.Tensor]:
    """Logits of the prompt's last position, then of each greedy decode step; with `plain_decode`, decode steps
    get the graphs' plain positions (index plus the images' shift) instead of M-RoPE rows."""
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
        if plain_decode and step:
            positions = inputs.positions + mrope_delta([(image.offset, image.grid)], 2)
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
    use_backend(kernel_path, "triton", 512)
    expected, got = run(torch_path, prompt, image, 3), run(kernel_path, prompt, image, 3)
    for reference, logits in zip(expected, got):
        torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-3)


def test_decode_steps_with_shifted_plain_positions_equal_mrope_ones() -> None:
    """What lets a graph run a vision model's text steps: after the images, t = h = w, so M-RoPE is plain rope at
    the shifted position (the scheduler's Row.rope_shift)."""
    prepared = prepare(encode(picture(40, 90), "PNG"), SETTINGS, ImageLimits(), "image")
    prompt = [1, 2] + [IMAGE_TOKEN] * prepared.tokens + [4, 7]
    image = ImageInput(prepared.identity, 2, list(prepared.grid), prepared.patches.tobytes())
    model = tiny_model()
    kernel_path = copy.deepcopy(model)
    use_backend(kernel_path, "triton", 512)
    for path in (model, kernel_path):
        for mrope, plain in zip(run(path, prompt, image, 3), run(path, prompt, image, 3, plain_decode=True)):
            torch.testing.assert_close(plain, mrope, rtol=1e-4, atol=1e-4)


def image_requests() -> list[Request]:
    requests = []
    for i, (w, h) in enumerate(((70, 45), (40, 90))):
        prepared = prepare(encode(picture(w, h, seed=w), "PNG"), SETTINGS, ImageLimits(), "image")
        prompt = [1, 2] + [IMAGE_TOKEN] * prepared.tokens + [4, 7, 8]
        image = ImageInput(prepared.identity, 2, list(prepared.grid), prepared.patches.tobytes())
        span = (2, 2 + prepared.tokens, mrope_delta([(2, image.grid)], 2))
        requests.append(Request(f"r{i}", b"t", len(prompt), prompt, SamplingParams(temperature=0.0, max_tokens=8),
                                0, frozenset(), 8, float(i), images=(image,), image_spans=(span,)))
    return requests


def generated(executor_for: Callable[[VisionLanguageLM], object]) -> list[list[int]]:
    model = tiny_model()
    use_backend(model, "triton", 512)
    harness = Harness(model, 64, PAGE, 4, 48)
    harness.executor.close()
    harness.executor = executor_for(model)
    requests = image_requests()
    for request in requests:
        harness.scheduler.add(request)
    harness.run()
    harness.close()
    return [r.tokens[r.prompt_len:] for r in requests]


@pytest.mark.skipif(GPU, reason="the GPU runs the GraphExecutor itself (below)")
def test_frame_steps_after_images_give_the_eager_executors_tokens() -> None:
    """The graph executor's data path on the CPU (tests/engine/test_graph_executor.py's FrameExecutor), with the image
    steps run eagerly as GraphExecutor runs them: the text steps after the images take the shifted positions."""
    from tests.engine.test_graph_executor import FrameExecutor

    class ImageStepsEager(FrameExecutor):
        def __init__(self, model: VisionLanguageLM) -> None:
            super().__init__(model, 64, PAGE, 4)
            self.eager = EagerExecutor(model, 64, PAGE, 4, DEVICE)
            self.eager.kv_cache, self.eager.slot_tokens = self.kv_cache, self.buffers.slot_tokens[:4]

        def submit(self, plan: Plan) -> None:
            if all(row.rope_shift is not None for row in plan.rows):
                super().submit(plan)
                return
            self.fence += 1
            self.done.append((plan, self.eager._execute(self.fence, plan, 0.0)))
            os.write(self._write, b"x")

    expected = generated(lambda model: EagerExecutor(model, 64, PAGE, 4, DEVICE))
    assert generated(ImageStepsEager) == expected and all(len(tokens) == 8 for tokens in expected)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_graph_executor_gives_the_eager_executors_tokens_for_image_prompts() -> None:
    """Image steps run their text model eagerly inside the GraphExecutor and their tower from its vision graphs (one,
    at 1,024 patches; the eager executor runs the same tower eagerly); the text steps after them replay graphs."""
    from engine.executor.graph import GraphExecutor

    expected = generated(lambda model: EagerExecutor(model, 64, PAGE, 4, DEVICE))
    assert generated(lambda model: GraphExecutor(model, 64, PAGE, 4, DEVICE, 512, 48)) == expected
