"""Every package's ``__init__`` docstring is its map: it names every module and subpackage.

The rule: for each package of ``fabricnode``, ``scheduler`` and ``cli`` (a folder with an
``__init__.py``), every ``*.py`` module in it (but ``__init__`` and ``__main__``) and every
subpackage is named in the package docstring as a literal, ``name`` in double backquotes (a
dotted path ending in the name, ``dataplane.routing``, counts too). A new module fails this
test until its package's map says what it is; a removed one is caught by reading the map.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("fabricnode", "scheduler", "cli")
SKIPPED_DIRS = {"__pycache__", "_native"}


def packages() -> list[Path]:
    found = []
    for root in ROOTS:
        for init in sorted((REPO / root).rglob("__init__.py")):
            if not SKIPPED_DIRS.intersection(init.relative_to(REPO).parts):
                found.append(init.parent)
    return found


def members(package: Path) -> list[str]:
    names = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    names += [
        p.name
        for p in package.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in SKIPPED_DIRS
    ]
    return sorted(names)


def named_in(docstring: str) -> set[str]:
    """The last component of every ``literal`` of the docstring."""
    return {lit.split(".")[-1] for lit in re.findall(r"``([A-Za-z_][\w.]*)``", docstring)}


@pytest.mark.parametrize(
    "package", packages(), ids=lambda p: str(p.relative_to(REPO)).replace("/", ".")
)
def test_package_docstring_names_every_module(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [name for name in members(package) if name not in named_in(docstring)]
    assert not missing, (
        f"{package.relative_to(REPO)}/__init__.py's docstring does not name {missing}: "
        "say in its map what each module owns (``name``  what it is)"
    )
