"""The docs name what exists: every relative link and every repository path or module named in README.md and the
docs resolves in the tree, and README's "Where things are" lists every package folder and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.repository.source_tree import PACKAGES, ROOT, modules, tracked_files

DOCS = sorted(["README.md", *(path for path in tracked_files()
                              if path.endswith(".md") and path.startswith(("docs/", "bench/")))])
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:%s|docs)/[\w./-]*)" % "|".join(PACKAGES))
MODULE = re.compile(r"python3? -m ((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES))


def _exists(path: str) -> bool:
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc: str) -> None:
    base = (ROOT / doc).parent
    targets = [target.split("#")[0] for target in LINK.findall((ROOT / doc).read_text())
               if not re.match(r"[a-z]+:|#", target)]
    assert [target for target in targets if not (base / target).exists()] == []


@pytest.mark.parametrize("doc", DOCS)
def test_repository_paths_and_modules_exist(doc: str) -> None:
    text = (ROOT / doc).read_text()
    paths = {path.rstrip(".") for path in PATH.findall(text)}
    assert sorted(path for path in paths if not _exists(path)) == []
    assert sorted(name for name in set(MODULE.findall(text)) if name not in modules()) == []


def _listed_folders() -> list[str]:
    """The first column of README's "Where things are" table."""
    section = (ROOT / "README.md").read_text().split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    return [match.rstrip("/") for match in re.findall(r"^\| `([^`]+)` \|", section, re.M)]


def test_where_things_are_matches_the_tree() -> None:
    listed = _listed_folders()
    packages = {str(Path(path).parent) for path in tracked_files()
                if path.endswith("__init__.py") and path.split("/")[0] in PACKAGES}
    assert sorted(folder for folder in listed if not (ROOT / folder).is_dir()) == []
    assert sorted(packages - set(listed)) == []
