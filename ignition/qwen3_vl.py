"""Qwen3-VL checkpoints for `ignition export` (DESIGN.md, Cores): the config as transformers reads it, every tensor's
expected shape (taken from transformers' own model built on the meta device, so the vision tower's layout is
never restated here), and the image processor's settings from preprocessor_config.json for the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.errors import CoreError
from common.vision import ImageProcessing

MODEL_TYPE = "qwen3_vl"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor configs spell it
PROCESSOR_FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def qwen3_vl_config(raw: dict[str, object], where: Path, dtype: str, checkpoint: str) -> dict[str, object]:
    from transformers import Qwen3VLConfig

    cleaned = {k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")}
    try:
        config = Qwen3VLConfig.from_dict(cleaned).to_dict()
    except Exception as exc:  # transformers validates the config in many ways
        raise CoreError(f"{where}: invalid qwen3_vl config: {exc}") from None
    if config["vision_config"].get("hidden_act") != "gelu_pytorch_tanh" or \
            config["text_config"].get("hidden_act", "silu") != "silu" or config["text_config"].get("attention_bias"):
        raise CoreError(f"{where}: unsupported qwen3_vl variant (activations or attention bias differ)")
    config.update(architectures=["Qwen3VLForConditionalGeneration"], dtype=dtype, _name_or_path=checkpoint)
    return json.loads(json.dumps(config))


def qwen3_vl_shapes(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint by name, from transformers' model on the meta device (no memory)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(config))
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def image_processing(preprocessor: dict[str, object], config: dict[str, object], where: Path) -> ImageProcessing:
    """The manifest's vision settings: the processor's as `Qwen2VLImageProcessor` reads them (size's
    shortest/longest edge are min/max pixels), refused where Flare's preparation would differ."""
    for flag in PROCESSOR_FLAGS:
        if preprocessor.get(flag, True) is not True:
            raise CoreError(f"{where}: {flag} false is not supported")
    if preprocessor.get("resample", BICUBIC) != BICUBIC:
        raise CoreError(f"{where}: resample {preprocessor['resample']} is not supported (bicubic only)")
    size = preprocessor.get("size") or {}
    vision = config["vision_config"]
    try:
        settings = ImageProcessing(
            image_token_id=int(config["image_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
            vision_end_token_id=int(config["vision_end_token_id"]),
            min_pixels=int(preprocessor.get("min_pixels") or size["shortest_edge"]),
            max_pixels=int(preprocessor.get("max_pixels") or size["longest_edge"]),
            patch_size=int(preprocessor.get("patch_size", 16)),
            temporal_patch_size=int(preprocessor.get("temporal_patch_size", 2)),
            merge_size=int(preprocessor.get("merge_size", 2)),
            image_mean=tuple(float(v) for v in preprocessor.get("image_mean", (0.5,) * 3)),
            image_std=tuple(float(v) for v in preprocessor.get("image_std", (0.5,) * 3)),
            rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)))
    except (KeyError, TypeError, ValueError) as exc:
        raise CoreError(f"{where}: incomplete image processor settings ({exc})") from None
    if (settings.patch_size, settings.temporal_patch_size, settings.merge_size) != \
            (vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"]):
        raise CoreError(f"{where}: patch sizes differ from the vision config's")
    return settings
