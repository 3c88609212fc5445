"""The core manifest: what `ignition export` writes and every process reads (no torch here)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from common.errors import CoreError
from common.vision import ImageProcessing

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# Model families the engine serves (engine/model/config.py).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "qwen3_vl",
                           "qwen3_5", "qwen3_5_moe", "qwen3_next")
# A decision model's settings and prompt template, carried into a core as they are (frontend/decisions/prompts.py).
DECISION_FILES = ("decision.json", "decision_template.jinja")


class Capacities(msgspec.Struct, forbid_unknown_fields=True):
    max_active: int = 64  # live request slots
    queue_capacity: int = 256  # requests waiting for a slot
    page_size: int = 64  # tokens per KV page
    prefill_chunk_size: int = 512  # most prompt tokens in one step
    kv_cache_bytes: int = 2 << 30  # KV budget on the CPU; a GPU sizes from free memory


class GenerationDefaults(msgspec.Struct, forbid_unknown_fields=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


POOLING_MODES = ("last", "mean")


class Pooling(msgspec.Struct, forbid_unknown_fields=True):
    """An embedding core's pooling (docs/design.md, Embeddings), from its sentence-transformers layout or
    `ignition export --pooling`."""

    mode: str  # "last": the last token's final hidden state; "mean": the mean over the prompt's
    normalize: bool = False  # the vector is L2-normalised (sentence-transformers' Normalize module)
    matryoshka: bool = False  # trained for truncated vectors: a request may ask for fewer dimensions

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not one of {POOLING_MODES}")


class Manifest(msgspec.Struct, forbid_unknown_fields=True):
    format_version: int
    architecture: str  # model family, e.g. "llama"
    config: dict[str, object]  # the Hugging Face config.json of the checkpoint
    dtype: str  # "float32" | "bfloat16" | "float16"
    served_names: list[str]
    checkpoint: str  # where the weights came from (repository id or file name)
    context_limit: int
    eos_token_ids: list[int]
    capacities: Capacities
    generation: GenerationDefaults
    files: dict[str, str]  # relative path -> SHA-256 hex
    bos_token_id: int | None = None
    created: int = 0  # unix time of export
    vision: ImageProcessing | None = None  # a vision core's image settings; None: text only
    # The quantized layouts the weights use, comma-separated: "q4", "q8" (groups of 32, engine/model/quant.py),
    # "fp8-channel", "fp8-block-128x128" (e4m3 with per-channel or per-block scales, engine/model/fp8.py).
    quantization: str | None = None
    pooling: Pooling | None = None  # an embedding core's; None: a generation core

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"format_version {self.format_version} is not {FORMAT_VERSION}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}")
        if self.context_limit < 1:
            raise ValueError("context_limit must be positive")
        if not self.served_names:
            raise ValueError("served_names is empty")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(core: Path, manifest: Manifest) -> None:
    (core / MANIFEST_NAME).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")


def load_manifest(core: Path, verify: bool = False, only: tuple[str, ...] | None = None) -> Manifest:
    """Read and validate `core/manifest.json`; with `verify`, check the SHA-256 of each listed file
    (or of those named in `only`). Every failure is a CoreError naming the file."""
    path = core / MANIFEST_NAME
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except FileNotFoundError:
        raise CoreError(f"{path}: no manifest (is this a core directory made by `ignition export`?)") from None
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise CoreError(f"{path}: invalid manifest: {exc}") from None
    if verify:
        for name, expected in manifest.files.items():
            if only is not None and name not in only:
                continue
            file = core / name
            if not file.is_file():
                raise CoreError(f"{file}: missing from the core")
            if sha256_file(file) != expected:
                raise CoreError(f"{file}: SHA-256 mismatch (the file changed after export)")
    return manifest
