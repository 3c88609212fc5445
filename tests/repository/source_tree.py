"""The repository's own files, read as text: its Python modules with the project modules each imports, and its docs."""

from __future__ import annotations

import ast
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "frontend", "engine", "ignition", "bench", "tests")


@cache
def tracked_files() -> tuple[str, ...]:
    """Every file git tracks, plus new ones it does not ignore."""
    listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    return tuple(path for path in listing.splitlines() if (ROOT / path).is_file())


def module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


@cache
def modules() -> dict[str, Path]:
    """The project's Python modules by dotted name (tests' data folder aside)."""
    return {module_name(path): ROOT / path for path in tracked_files()
            if path.endswith(".py") and path.split("/")[0] in PACKAGES and not path.startswith("tests/data/")}


def _project_module(name: str) -> str | None:
    """The project module an imported name lives in (`a.b.c` may be module a.b's attribute c), or None."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@cache
def imported_names(module: str) -> frozenset[str]:
    """Every name `module` imports anywhere in its text (at the top, in functions, under TYPE_CHECKING): `a.b` for
    `import a.b`, and both `a.b` and `a.b.c` for `from a.b import c`."""
    names = set()
    for node in ast.walk(ast.parse(modules()[module].read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


@cache
def imports(module: str) -> frozenset[str]:
    """The project modules `module` imports."""
    found = set()
    for name in imported_names(module):
        target = _project_module(name)
        # A module importing its own package's __init__ (as `import a.b.c` does) is no dependency on it.
        if target is not None and target != module and not module.startswith(target + "."):
            found.add(target)
    return frozenset(found)
