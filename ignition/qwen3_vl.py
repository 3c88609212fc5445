"""What `ignition export` adds for a checkpoint with Qwen3-VL's vision tower: Qwen3-VL itself, and Qwen3.5 and
Qwen3.5-MoE (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: the same tower without deepstack
mergers, beside their hybrid text models). ignition/families.py does the rest, the text model's renaming included
(docs/design.md, Cores): here, the vision tower's names and shapes, and the image processor's settings from
preprocessor_config.json for the manifest."""

from __future__ import annotations

from pathlib import Path

import torch

from common.errors import CoreError
from common.vision import ImageProcessing

# Checkpoint model_type -> transformers' (config class, vision tower class), named in `transformers`.
TOWERS = {"qwen3_vl": ("Qwen3VLConfig", "Qwen3VLVisionModel"), "qwen3_5": ("Qwen3_5Config", "Qwen3_5VisionModel"),
          "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeVisionModel")}
VISION_CHECKPOINT_PREFIX = "model.visual."
VISION_PREFIX = "visual."
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, as preprocessor configs spell it
PROCESSOR_FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def has_vision(config: dict[str, object]) -> bool:
    """Whether a normalised config (families.normalised_config) is a checkpoint of one of TOWERS with its tower."""
    return config.get("model_type") in TOWERS and "vision_config" in config


def vision_shapes(config: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """The vision tower's tensors by core name (`visual.`), from transformers' own tower built on the meta device
    (no memory), so its layout is never restated here."""
    import transformers

    config_class, tower_class = (getattr(transformers, name) for name in TOWERS[str(config["model_type"])])
    with torch.device("meta"):
        tower = tower_class(config_class.from_dict(config).vision_config)
    return {VISION_PREFIX + name: tuple(tensor.shape) for name, tensor in tower.state_dict().items()}


def core_name(name: str) -> str:
    """The tower's checkpoint names as the core's (`visual.`); the text model's prefix is families.py's to drop."""
    if name.startswith(VISION_CHECKPOINT_PREFIX):
        return VISION_PREFIX + name.removeprefix(VISION_CHECKPOINT_PREFIX)
    return name


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
