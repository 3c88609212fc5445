"""`ignition export`: turn a checkpoint (Hugging Face directory or GGUF file) into a core (docs/design.md, Cores)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from common.errors import CoreError
from common.manifest import (FORMAT_VERSION, Capacities, GenerationDefaults, Manifest, Pooling, load_manifest,
                             sha256_file)
from common.manifest import DECISION_FILES, write_manifest
from engine.model.config import text_config
from ignition import fp8, qwen3_vl
from ignition.families import core_tensors, expected_shapes, normalised_config
from ignition.fp8 import Fp8Weight
from ignition.gguf_source import GgufSource
from ignition.hf_source import HfSource, token_ids
from ignition.quantize import Blocks, quantizable, quantize
from ignition.template_marks import annotate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
TEMPLATE_NAME = "chat_template.jinja"
_GGUF_MAGIC = b"GGUF"


class Source(Protocol):
    """What export needs from a checkpoint; GgufSource and HfSource provide it."""

    path: Path
    config_file: Path  # named in errors about the config
    checkpoint: str
    default_dtype: str
    default_names: list[str]
    chat_template: str
    generation: GenerationDefaults
    generation_eos_ids: list[int]
    pooling: Pooling | None  # an embedding checkpoint's (ignition/sentence_transformers.py)

    def config(self) -> dict[str, object]: ...
    def write_tokenizer(self, target: Path) -> list[int]: ...
    def tensor_count(self) -> int: ...
    def tensors(self) -> Iterator[tuple[str, torch.Tensor | Blocks | Fp8Weight]]: ...
    def quantized_bits(self, name: str) -> int | None: ...  # the width a weight keeps by default


@dataclass(frozen=True)
class ExportOptions:
    dtype: str | None = None  # None: the source's own (float32 for GGUF)
    served_names: tuple[str, ...] = ()  # empty: derived from the source
    context_limit: int | None = None  # caps max_position_embeddings
    force: bool = False  # replace an existing OUT
    quant: str | None = None  # "q4", "q8", "fp8" or "none"; None: each weight as the source holds it
    pooling: str | None = None  # "last" or "mean": an embedding core (normalised) whatever the source says
    matryoshka: bool = False  # the model was trained for truncated vectors


def open_source(path: Path) -> Source:
    if path.is_dir():
        return HfSource(path)
    if not path.is_file():
        raise CoreError(f"{path}: no such file or directory")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic == _GGUF_MAGIC or path.suffix.lower() == ".gguf":
        return GgufSource(path)
    raise CoreError(f"{path}: neither a GGUF file nor a Hugging Face checkpoint directory")


def export(source_path: Path, out: Path, options: ExportOptions = ExportOptions()) -> Manifest:
    if out.exists() and not options.force:
        raise CoreError(f"{out}: already exists (pass --force to replace it)")
    return export_source(open_source(source_path), out, options)


def export_source(source: Source, out: Path, options: ExportOptions = ExportOptions()) -> Manifest:
    """Write the core into a hidden sibling of `out`, then rename it: a failed export leaves nothing behind."""
    if out.exists() and not options.force:
        raise CoreError(f"{out}: already exists (pass --force to replace it)")
    dtype = options.dtype or source.default_dtype
    if dtype not in DTYPES:
        raise CoreError(f"{source.config_file}: unsupported dtype {dtype} (pass --dtype)")
    # Steps: config, tokenizer, each tensor, saving the weights. The bar shows on a terminal only, so that
    # a log, or a failing run's stderr, stays clean.
    with tqdm(total=source.tensor_count() + 3, desc="ignition export", unit="step", file=sys.stderr,
              disable=None) as bar:
        bar.set_postfix_str("config")
        raw = source.config()
        family, config = normalised_config(raw, source.config_file, dtype, source.checkpoint)
        bar.update()
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.with_name(f".{out.name}.{os.getpid()}.partial")
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed run that had our pid
        staging.mkdir()
        try:
            pooling = _pooling(source, options)
            eos_ids, kinds = _write_files(source, family, config, DTYPES[dtype], options.quant, staging, bar,
                                          pooling is not None)
            manifest = _manifest(source, options, raw, family, config, dtype, eos_ids, staging, kinds, pooling)
            write_manifest(staging, manifest)
            load_manifest(staging)  # what every process will read must decode and validate
            _replace(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return manifest


def _manifest(source: Source, options: ExportOptions, raw: dict[str, object], family: str,
              config: dict[str, object], dtype: str, eos_ids: list[int], staging: Path, kinds: set[str],
              pooling: Pooling | None) -> Manifest:
    try:
        return Manifest(
            format_version=FORMAT_VERSION,
            architecture=family,
            config=config,
            dtype=dtype,
            served_names=list(options.served_names) or source.default_names,
            checkpoint=source.checkpoint,
            context_limit=min(int(text_config(config)["max_position_embeddings"]),
                              options.context_limit or sys.maxsize),
            eos_token_ids=_unique(eos_ids + source.generation_eos_ids + token_ids(raw.get("eos_token_id"))),
            bos_token_id=raw["bos_token_id"] if isinstance(raw.get("bos_token_id"), int) else None,
            capacities=Capacities(),
            generation=source.generation,
            files={file.name: sha256_file(file) for file in sorted(staging.iterdir())},
            created=int(time.time()),
            vision=qwen3_vl.image_processing(source.preprocessor, config, source.preprocessor_file)
            if qwen3_vl.has_vision(config) else None,
            quantization=",".join(sorted(kinds)) or None,
            pooling=pooling,
        )
    except ValueError as exc:  # the Manifest's own checks
        raise CoreError(f"{source.path}: cannot make a valid manifest: {exc}") from None


def _pooling(source: Source, options: ExportOptions) -> Pooling | None:
    if options.pooling is not None:
        return Pooling(options.pooling, normalize=True, matryoshka=options.matryoshka)
    if source.pooling is not None and options.matryoshka:
        return Pooling(source.pooling.mode, source.pooling.normalize, matryoshka=True)
    if options.matryoshka:
        raise CoreError(f"{source.path}: --matryoshka is for an embedding model (a sentence-transformers layout "
                        "or --pooling)")
    return source.pooling


def _write_files(source: Source, family: str, config: dict[str, object], dtype: torch.dtype, quant: str | None,
                 staging: Path, bar: tqdm, embeds: bool) -> tuple[list[int], set[str]]:
    """Write tokenizer, annotated template (when the source has one) and weights into `staging`; return the
    tokenizer's EOS ids and the quantized kinds written ("q4", "q8", "fp8-channel", "fp8-block-128x128":
    engine/model/fp8.py). An embedding checkpoint without a head (a base model, as sentence-transformers saves it)
    gets its head tied to the embeddings in `config`: the engine computes logits with every step, though an
    embedding reads none."""
    shapes = expected_shapes(family, config)
    weights: dict[str, torch.Tensor] = {}
    written: set[str] = set()
    kinds: set[str] = set()
    bar.set_postfix_str("tokenizer")
    eos_ids = source.write_tokenizer(staging / TOKENIZER_NAME)
    if source.chat_template:
        (staging / TEMPLATE_NAME).write_text(annotate(source.chat_template), encoding="utf-8")
    for name in DECISION_FILES:
        if source.path.is_dir() and (source.path / name).is_file():
            shutil.copyfile(source.path / name, staging / name)
    bar.update()
    for name, tensor in core_tensors(family, config, _counted(source.tensors(), bar)):
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and name not in shapes):
            continue  # recomputed by the engine / a tied copy of the embeddings
        if name.endswith(fp8.KV_SCALES):
            text = text_config(config)
            kv_heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
            weights[name] = fp8.kv_scale(name, tensor, kv_heads)
            continue
        if name not in shapes:
            raise CoreError(f"{source.path}: unexpected tensor {name} for a {family} model")
        if tuple(tensor.shape) != shapes[name]:
            raise CoreError(f"{source.path}: {name} has shape {tuple(tensor.shape)}, "
                            f"the config says {shapes[name]}")
        if isinstance(tensor, Fp8Weight) and quant not in (None, "fp8") or \
                isinstance(tensor, Blocks) and quant == "fp8":
            tensor = tensor.dequantize()  # dense for --quant none, quantized again below otherwise
        if quant == "fp8" and fp8.quantizable(name, tensor):
            tensor = fp8.quantize(tensor)
        if isinstance(tensor, Fp8Weight):
            weights.update(tensor.core_tensors(name))
            kinds.add(tensor.scheme)
            written.add(name)
            continue
        bits = {"q4": 4, "q8": 8, "none": None, "fp8": None}[quant] if quant else source.quantized_bits(name)
        if isinstance(tensor, Blocks) and bits is None:
            tensor = tensor.dequantize()
        elif not isinstance(tensor, Blocks) and bits is not None and quantizable(tensor):
            tensor = quantize(tensor, bits)
        if isinstance(tensor, Blocks):
            tensor = tensor.with_bits(bits)
            weights.update(tensor.core_tensors(name))
            kinds.add(f"q{tensor.bits}")
        else:
            weights[name] = tensor.to(dtype).contiguous()
        written.add(name)
    if embeds and "lm_head.weight" in shapes.keys() - written:
        config["tie_word_embeddings"] = True
        written.add("lm_head.weight")
    missing = sorted(shapes.keys() - written)
    if missing:
        raise CoreError(f"{source.path}: missing tensor {missing[0]} ({len(missing)} missing in all)")
    bar.set_postfix_str(WEIGHTS_NAME)
    save_file(weights, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
    # safetensors writes its file owner-only; a core is read by other users' server processes too.
    (staging / WEIGHTS_NAME).chmod((staging / TOKENIZER_NAME).stat().st_mode)
    bar.update()
    return eos_ids, kinds


def _counted(tensors: Iterator[tuple[str, torch.Tensor]], bar: tqdm) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        bar.set_postfix_str(name)
        bar.update()
        yield name, tensor


def _replace(staging: Path, out: Path) -> None:
    # Move the old core aside first so that `out` is either the old core or the new one, never a mix.
    trash = None
    if out.exists() or out.is_symlink():
        trash = out.with_name(f".{out.name}.{time.time_ns()}.old")
        out.rename(trash)
    staging.rename(out)
    if trash is not None:
        shutil.rmtree(trash) if trash.is_dir() and not trash.is_symlink() else trash.unlink()


def _unique(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))
