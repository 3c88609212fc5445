"""A sentence-transformers layout (docs/design.md, Embeddings): `modules.json` lists the Transformer at the
checkpoint's root, then a Pooling module (its settings in e.g. `1_Pooling/config.json`) and, for normalised vectors,
a Normalize module. Export records them as the core's Pooling; any other module (Dense, a pooling mode Flare does not
compute) is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import CoreError
from common.manifest import Pooling

MODULES_FILE = "modules.json"
_MODULE = "sentence_transformers.models."
_TRANSFORMER, _POOLING, _NORMALIZE = (_MODULE + name for name in ("Transformer", "Pooling", "Normalize"))
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


def read_pooling(path: Path, config: dict[str, object]) -> Pooling | None:
    """The pooling of the checkpoint directory `path`, or None when it has no modules.json. A config that says it
    was trained for truncated vectors (`is_matryoshka`, `matryoshka_dimensions`, as vLLM reads them) marks it so."""
    modules_file = path / MODULES_FILE
    if not modules_file.is_file():
        return None
    modules = _read(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CoreError(f"{modules_file}: expected a list of modules")
    types = [str(m.get("type")) for m in modules]
    for module in modules:
        if module.get("type") not in (_TRANSFORMER, _POOLING, _NORMALIZE):
            raise CoreError(f"{modules_file}: unsupported sentence-transformers module {module.get('type')} "
                            "(Flare exports Transformer, Pooling and Normalize)")
    if types[:2] != [_TRANSFORMER, _POOLING] or str(modules[0].get("path", "")) not in ("", ".") \
            or types.count(_POOLING) != 1:
        raise CoreError(f"{modules_file}: expected the Transformer at the root, then one Pooling module")
    pooling_file = path / str(modules[1].get("path", "")) / "config.json"
    settings = _read(pooling_file)
    if not isinstance(settings, dict):
        raise CoreError(f"{pooling_file}: expected a JSON object")
    chosen = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value]
    if len(chosen) != 1 or chosen[0] not in _MODES:
        raise CoreError(f"{pooling_file}: unsupported pooling {', '.join(chosen) or 'none'} (Flare pools by "
                        f"{' or '.join(_MODES)})")
    if settings.get("include_prompt") is False:
        raise CoreError(f"{pooling_file}: unsupported pooling without the prompt (include_prompt: false)")
    return Pooling(_MODES[chosen[0]], normalize=_NORMALIZE in types,
                   matryoshka=bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions")))


def _read(file: Path) -> object:
    if not file.is_file():
        raise CoreError(f"{file}: missing")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CoreError(f"{file}: invalid JSON: {exc}") from None
