"""A Hugging Face checkpoint directory as an ignition source: config.json, safetensors, tokenizer files."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from common.errors import CoreError
from common.manifest import GenerationDefaults
from ignition.families import family_of
from ignition.fp8 import Fp8Weight, checkpoint_scheme, is_scale_or_dropped, scale_name
from ignition.qwen3_vl import TOWERS
from ignition.sentence_transformers import read_pooling

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class HfSource:
    """Opening reads the small JSON files and checks the architecture; weights are read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config_file = path / "config.json"
        self._raw = _read_json(self.config_file)
        family_of(self._raw, self.config_file)  # an unsupported architecture fails before any work
        self._fp8 = checkpoint_scheme(self._raw, self.config_file)  # likewise an unsupported quantization
        self._tokenizer_config = _read_json(path / "tokenizer_config.json", required=False)
        self.pooling = read_pooling(path, self._raw)  # a sentence-transformers layout: an embedding checkpoint
        self.chat_template = self._find_chat_template()
        self.default_dtype = str(self._raw.get("dtype") or self._raw.get("torch_dtype") or "float32")
        name_or_path = str(self._raw.get("_name_or_path") or "")
        self._repo = name_or_path if _REPO_ID.match(name_or_path) else None
        self.checkpoint = self._repo or path.resolve().name
        generation = _read_json(path / "generation_config.json", required=False)
        sampling = {key: generation[key] for key in _SAMPLING_KEYS if generation.get(key) is not None}
        try:
            self.generation = msgspec.convert(sampling, GenerationDefaults, strict=False)
        except msgspec.ValidationError as exc:
            raise CoreError(f"{path / 'generation_config.json'}: {exc}") from None
        self.generation_eos_ids = token_ids(generation.get("eos_token_id"))
        self.preprocessor_file = path / "preprocessor_config.json"  # a vision checkpoint's image processor
        self.preprocessor = _read_json(self.preprocessor_file, required=self._raw.get("model_type") in TOWERS)
        self._shards = self._find_shards()

    @property
    def default_names(self) -> list[str]:
        names = [self.path.resolve().name.lower()]
        if self._repo and self._repo not in names:
            names.append(self._repo)
        return names

    def config(self) -> dict[str, object]:
        return dict(self._raw)

    def write_tokenizer(self, target: Path) -> list[int]:
        """Copy tokenizer.json after checking that `tokenizers` loads it; return the tokenizer's EOS ids."""
        source = self.path / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(source))
        except Exception as exc:  # tokenizers raises a bare Exception for a missing or malformed file
            raise CoreError(f"{source}: cannot load with tokenizers: {exc}") from None
        shutil.copyfile(source, target)
        eos = self._tokenizer_config.get("eos_token")
        content = eos.get("content") if isinstance(eos, dict) else eos
        token_id = tokenizer.token_to_id(content) if isinstance(content, str) else None
        return [token_id] if token_id is not None else []

    def quantized_bits(self, name: str) -> int | None:
        return None  # dense weights stay dense unless export is asked for --quant

    def tensor_count(self) -> int:
        return sum(len(self._kept(names)) for names in self._names().values())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
        """Each tensor; an FP8 checkpoint's weights as Fp8Weights, their scales read beside them (from any shard)."""
        names = self._names()
        shard_of = {name: shard for shard, held in names.items() for name in held}
        for shard, held in names.items():
            with _open_shard(shard) as handle:
                for name in self._kept(held):
                    tensor = _read(handle, shard, name)
                    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and self._fp8 is None:
                        raise CoreError(f"{shard}: {name} is {tensor.dtype}, but config.json names no FP8 "
                                        "quantization_config")
                    scale = scale_name(name, self._fp8) if self._fp8 and tensor.element_size() == 1 else None
                    if scale is None:
                        yield name, tensor
                        continue
                    if scale not in shard_of:
                        raise CoreError(f"{shard}: FP8 weight {name} has no {scale}")
                    with _open_shard(shard_of[scale]) as scales:
                        yield name, Fp8Weight.of(tensor, _read(scales, shard_of[scale], scale), self._fp8,
                                                 f"{shard}: {name}")

    def _names(self) -> dict[Path, list[str]]:
        names = {}
        for shard in self._shards:
            with _open_shard(shard) as handle:
                names[shard] = list(handle.keys())
        return names

    def _kept(self, names: list[str]) -> list[str]:
        """The names a core takes: less an FP8 checkpoint's scales (read with their weights) and what a core drops
        (ignition/fp8.py)."""
        return [name for name in names if not (self._fp8 and is_scale_or_dropped(name, self._fp8))]

    def _find_chat_template(self) -> str:
        template = self._tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str) and template.strip():
            return template
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        if self.pooling is not None:
            return ""  # an embedding model needs none: its inputs are texts
        raise CoreError(f"{self.path}: no chat template (neither tokenizer_config.json's chat_template "
                        "nor chat_template.jinja)")

    def _find_shards(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CoreError(f"{index}: no weight_map")
            shards = [self.path / name for name in sorted(set(weight_map.values()))]
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise CoreError(f"{self.path}: no *.safetensors weights")
        for shard in shards:
            if not shard.is_file():
                raise CoreError(f"{shard}: missing (listed in {index.name})")
        return shards


def _open_shard(shard: Path):  # noqa: ANN202 (safetensors' handle has no public type)
    try:
        return safe_open(str(shard), framework="pt")
    except Exception as exc:  # SafetensorError for a truncated header, OSError for an unreadable file
        raise CoreError(f"{shard}: not a readable safetensors file: {exc}") from None


def _read(handle, shard: Path, name: str) -> torch.Tensor:  # noqa: ANN001 (safetensors' handle)
    try:
        return handle.get_tensor(name)
    except Exception as exc:
        raise CoreError(f"{shard}: cannot read tensor {name}: {exc}") from None


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise CoreError(f"{path}: missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CoreError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CoreError(f"{path}: expected a JSON object")
    return data


def token_ids(value: object) -> list[int]:
    """A config's `eos_token_id`, which may be one id, a list of ids or absent."""
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []
