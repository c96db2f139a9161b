"""The data plane compiled to C with mypyc, and the switch between it and the plain sources.

The ``/v1`` hot path (HTTP parsing glue, relay, routing, metrics and accounting) is every module
of ``fabricnode/dataplane/`` (``DATA_PLANE``). They are ordinary, strictly typed Python; mypyc
compiles the same files into extension modules that run the same code with less CPU per request
(docs/benchmarks.md has the figures). Nothing else changes: trio and httptools still run
underneath.

The compiled modules live in ``fabricnode/dataplane/_native/`` next to a stamp naming the digest
of the sources they were built from. ``activate`` (called when ``fabricnode.dataplane`` is
imported) puts that directory first on that package's ``__path__`` only when the stamp matches
the sources as they are now, so an edited source is never shadowed by a stale build: it runs
interpreted until ``make native`` (``python -m fabricnode.native_build``, see there) compiles it
again.

``FABRIC_NATIVE=0`` forces the interpreted sources (for debugging, or a machine without a C
compiler); ``python -m fabricnode.native_build status`` says which is in use and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

PACKAGE = "fabricnode.dataplane"
PACKAGE_DIR = Path(__file__).resolve().parent / "dataplane"
BUILD_DIR = PACKAGE_DIR / "_native"
STAMP_NAME = "stamp.json"
GROUP = f"{PACKAGE}._compiled"  # mypyc's group: the modules share one library, SHARED_LIB
SHARED_LIB = GROUP.rpartition(".")[2] + "__mypyc"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
# The folder is the group: every module in it is compiled, none is listed by hand.
DATA_PLANE = tuple(sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__"))
ENV = "FABRIC_NATIVE"

# Why the data plane runs as it does: set by activate() at import.
status = "interpreted: not activated"


def sources_digest(package_dir: Path = PACKAGE_DIR, modules: tuple[str, ...] = DATA_PLANE) -> str:
    """What a build depends on: the sources and the interpreter's ABI."""
    h = hashlib.sha256()
    h.update(sys.implementation.cache_tag.encode())
    for name in modules:
        h.update(name.encode() + b"\0")
        h.update((package_dir / f"{name}.py").read_bytes())
    return h.hexdigest()


def check(
    build_dir: Path = BUILD_DIR, package_dir: Path = PACKAGE_DIR, *, honour_env: bool = True
) -> tuple[bool, str]:
    """(use the build?, why): the compiled modules are used only if built from these sources."""
    if honour_env and os.environ.get(ENV, "").strip() == "0":
        return False, f"interpreted: {ENV}=0"
    try:
        stamp = json.loads((build_dir / STAMP_NAME).read_text())
    except FileNotFoundError:
        return False, "interpreted: not built (run `make native`)"
    except (OSError, ValueError) as exc:
        return False, f"interpreted: unreadable build stamp ({exc})"
    if not isinstance(stamp, dict) or stamp.get("digest") != sources_digest(package_dir):
        return False, "interpreted: sources changed since the last build (run `make native`)"
    # The digest covers the module names too: a match means the build is of DATA_PLANE.
    missing = [
        m for m in (*DATA_PLANE, SHARED_LIB) if not (build_dir / f"{m}{EXT_SUFFIX}").is_file()
    ]
    if missing:
        return False, f"interpreted: incomplete build (missing {', '.join(missing)})"
    return True, f"native: {len(DATA_PLANE)} data-plane modules compiled with mypyc"


def activate(package_path: list[str]) -> None:
    """Put the compiled modules first on the package's search path when they are current."""
    global status
    try:
        use, status = check()
    except OSError as exc:  # a source unreadable: never fail the import over an optimization
        use, status = False, f"interpreted: {exc}"
    if use and str(BUILD_DIR) not in package_path:
        package_path.insert(0, str(BUILD_DIR))


def is_compiled(module: object) -> bool:
    """Is this module the compiled one (an extension, not a ``.py``)?"""
    return not str(getattr(module, "__file__", "")).endswith(".py")
