"""Reading a sentence-transformers layout (ignition/sentence_transformers.py): the pooling it records, and each
layout Flare cannot serve refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import CoreError
from common.manifest import Pooling
from ignition.sentence_transformers import read_pooling

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def layout(root: Path, modules: list[dict], **modes: bool) -> Path:
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir(exist_ok=True)
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_lasttoken": False, **{f"pooling_mode_{k}": v for k, v in modes.items()}}))
    return root


def test_the_pooling_and_normalize_modules_become_the_cores_pooling(tmp_path: Path) -> None:
    assert read_pooling(tmp_path, {}) is None  # no modules.json: a generation checkpoint
    assert read_pooling(layout(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], lasttoken=True), {}) == \
        Pooling("last", normalize=True)
    assert read_pooling(layout(tmp_path, [TRANSFORMER, POOLING], mean_tokens=True), {"is_matryoshka": True}) == \
        Pooling("mean", normalize=False, matryoshka=True)


@pytest.mark.parametrize(("modules", "modes", "named"), [
    ([TRANSFORMER, POOLING, DENSE], {"mean_tokens": True}, "models.Dense"),
    ([TRANSFORMER, POOLING], {"cls_token": True}, "pooling_mode_cls_token"),
    ([TRANSFORMER, POOLING], {"lasttoken": True, "mean_tokens": True}, "pooling_mode_mean_tokens, pooling_mode_"),
    ([POOLING, TRANSFORMER], {"lasttoken": True}, "the Transformer at the root"),
])
def test_layouts_flare_cannot_serve_are_refused_by_name(tmp_path: Path, modules: list[dict], modes: dict,
                                                         named: str) -> None:
    with pytest.raises(CoreError, match=named):
        read_pooling(layout(tmp_path, modules, **modes), {})
