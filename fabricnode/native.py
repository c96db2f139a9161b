"""The data plane compiled to C with mypyc, and the switch between it and the plain sources.

The ``/v1`` hot path (HTTP parsing glue, relay, routing, metrics and accounting) is every module
of ``fabricnode/dataplane/`` (``DATA_PLANE``). They are ordinary, strictly typed Python; mypyc
compiles the same files into extension modules that run the same code with less CPU per request
(docs/benchmarks.md has the figures). Nothing else changes: trio and httptools still run
underneath.

Its companions (``COMPANIONS``) are the few modules of other packages that the request path calls
for every request: the request log's line format, writer and TTFT buckets. They are compiled in
the same group, into their own package's ``_native`` folder.

The compiled modules live in ``fabricnode/dataplane/_native/`` next to a stamp naming the digest
of the sources they were built from (the companions' included). ``activate`` (called when
``fabricnode.dataplane``, or a companion's package, is imported) puts that package's build
directory first on its ``__path__`` only when the stamp matches the sources as they are now, so
an edited source is never shadowed by a stale build: it runs interpreted until ``make native``
(``python -m fabricnode.native_build``, see there) compiles it again.

``FABRIC_NATIVE=0`` forces the interpreted sources (for debugging, or a machine without a C
compiler); ``python -m fabricnode.native_build status`` says which is in use and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Companion:
    """Modules of another package compiled in the data plane's group, because the request path
    calls them for every request. Their extension modules live in that package's own
    ``_native`` folder (its ``__init__`` calls ``activate`` with its ``__path__``); they load
    the group's shared library, ``fabricnode.dataplane._compiled__mypyc``, by its name, so
    importing one imports ``fabricnode.dataplane``'s ``__init__`` (which imports nothing but
    this module). The data plane's stamp covers their sources too: one build, one verdict."""

    package: str
    package_dir: Path
    modules: tuple[str, ...]

    @property
    def build_dir(self) -> Path:
        return self.package_dir / "_native"


# The request log's line format, its writer and the TTFT buckets: the settler appends a record
# and buckets its TTFT per answered request, and the flush thread formats every line (holding
# the interpreter lock while it does). Interpreted, they cost a JSON request at c=32 about 3%
# more CPU than compiled (docs/benchmarks.md, router_ab). The rest of requestlog (reading,
# cursors, sums) runs in the admin API and the controller, off the request path.
COMPANIONS = (
    Companion(
        "fabricnode.requestlog", PACKAGE_DIR.parent / "requestlog", ("format", "ttft", "writer")
    ),
)

# Why the data plane runs as it does: set by activate() at import.
status = "interpreted: not activated"


def sources_digest(
    package_dir: Path = PACKAGE_DIR,
    modules: tuple[str, ...] = DATA_PLANE,
    companions: tuple[Companion, ...] = COMPANIONS,
) -> str:
    """What a build depends on: the sources (the data plane's and its companions') and the
    interpreter's ABI."""
    h = hashlib.sha256()
    h.update(sys.implementation.cache_tag.encode())
    for name in modules:
        h.update(name.encode() + b"\0")
        h.update((package_dir / f"{name}.py").read_bytes())
    for companion in companions:
        for name in companion.modules:
            h.update(f"{companion.package}.{name}".encode() + b"\0")
            h.update((companion.package_dir / f"{name}.py").read_bytes())
    return h.hexdigest()


def check(
    build_dir: Path = BUILD_DIR,
    package_dir: Path = PACKAGE_DIR,
    *,
    honour_env: bool = True,
    companions: tuple[Companion, ...] = COMPANIONS,
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
    digest = sources_digest(package_dir, companions=companions)
    if not isinstance(stamp, dict) or stamp.get("digest") != digest:
        return False, "interpreted: sources changed since the last build (run `make native`)"
    # The digest covers the module names too: a match means the build is of DATA_PLANE.
    missing = [
        m for m in (*DATA_PLANE, SHARED_LIB) if not (build_dir / f"{m}{EXT_SUFFIX}").is_file()
    ]
    missing += [
        f"{c.package}.{m}"
        for c in companions
        for m in c.modules
        if not (c.build_dir / f"{m}{EXT_SUFFIX}").is_file()
    ]
    if missing:
        return False, f"interpreted: incomplete build (missing {', '.join(missing)})"
    compiled = len(DATA_PLANE) + sum(len(c.modules) for c in companions)
    return True, f"native: {compiled} data-plane modules compiled with mypyc"


def activate(package_path: list[str], build_dir: Path = BUILD_DIR) -> None:
    """Put the compiled modules first on a package's search path when they are current: the
    data plane's (the default) or a companion's (its ``build_dir``)."""
    global status
    try:
        use, status = check()
    except OSError as exc:  # a source unreadable: never fail the import over an optimization
        use, status = False, f"interpreted: {exc}"
    if use and str(build_dir) not in package_path:
        package_path.insert(0, str(build_dir))


def is_compiled(module: object) -> bool:
    """Is this module the compiled one (an extension, not a ``.py``)?"""
    return not str(getattr(module, "__file__", "")).endswith(".py")
