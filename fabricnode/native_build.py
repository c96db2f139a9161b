"""Build the compiled data plane: ``python -m fabricnode.native_build [build|status]``.

mypyc compiles the modules in ``native.DATA_PLANE`` into ``fabricnode/dataplane/_native/`` (and
its ``COMPANIONS`` into their packages' ``_native`` folders) and
stamps the build with the digest of its sources; ``native.activate`` uses the build only while that
digest matches. Needs mypy (which ships mypyc) and a C compiler with the Python headers.

A build is cached outside the tree, by what it depends on (``cache_key``: the sources' digest,
which covers the interpreter's ABI, and the mypy that compiled them), in ``FABRIC_NATIVE_CACHE``
(default ``$XDG_CACHE_HOME/fabricnode/native``, else ``~/.cache/fabricnode/native``; empty: no
cache): a fresh clone of sources built before copies the modules instead of compiling them for
three minutes of a core, as pip's cache spares it the wheels. The newest ``CACHE_KEEP`` builds
are kept, the rest removed. A cached build is the same bytes the compiler made for those sources.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from fabricnode import native

_SETUP = """\
import sys
from setuptools import setup
from mypyc.build import mypycify

setup(
    name="fabricnode-dataplane",
    ext_modules=mypycify(sys.argv[3:], group_name={group!r}, opt_level="3"),
    script_args=["build_ext", "--build-lib", sys.argv[1], "--build-temp", sys.argv[2]],
)
"""


CACHE_ENV = "FABRIC_NATIVE_CACHE"
CACHE_KEEP = 3  # builds kept in the cache (a build is ~15 MB)


class BuildError(Exception):
    pass


def cache_dir() -> Path | None:
    """Where builds are cached (module docstring); None when ``FABRIC_NATIVE_CACHE`` is empty."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fabricnode" / "native"


def cache_key(digest: str) -> str:
    """What a build depends on: the sources' digest (the ABI included) and mypyc's version."""
    try:
        mypy_version = metadata.version("mypy")
    except metadata.PackageNotFoundError:
        mypy_version = "none"
    return f"{digest[:32]}-mypy{mypy_version}"


def _outputs() -> list[tuple[Path, Path]]:
    """(relative name in a cached build, installed path) of every module a build makes."""
    names = [f"{m}{native.EXT_SUFFIX}" for m in (*native.DATA_PLANE, native.SHARED_LIB)]
    out = [(Path(native.PACKAGE.replace(".", "/")) / n, native.BUILD_DIR / n) for n in names]
    for companion in native.COMPANIONS:
        for m in companion.modules:
            rel = Path(companion.package.replace(".", "/")) / f"{m}{native.EXT_SUFFIX}"
            out.append((rel, companion.build_dir / f"{m}{native.EXT_SUFFIX}"))
    return out


def _from_cache(key: str) -> bool:
    """Install the cached build of ``key`` if there is a whole one; whether it was."""
    root = cache_dir()
    if root is None:
        return False
    entry = root / key
    outputs = _outputs()
    if not (entry / "complete").is_file() or not all((entry / rel).is_file() for rel, _ in outputs):
        return False
    native.BUILD_DIR.mkdir(exist_ok=True)
    (native.BUILD_DIR / native.STAMP_NAME).unlink(missing_ok=True)  # invalid while replaced
    for rel, installed in outputs:
        installed.parent.mkdir(exist_ok=True)
        _install([entry / rel], installed.parent)
    (entry / "complete").touch()  # recently used: kept by the trim
    return True


def _to_cache(key: str, lib: Path) -> None:
    """Keep the build in ``lib`` (setup's build-lib) in the cache, whole or not at all; then
    trim the cache to the newest ``CACHE_KEEP`` builds. A cache that cannot be written is
    skipped: it only saves time."""
    root = cache_dir()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        for rel, _ in _outputs():
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lib / rel, staged / rel)
        (staged / "complete").write_text(f"{time.time():.0f}\n")
        try:
            os.replace(staged, root / key)
        except OSError:  # another build of the same sources got there first
            shutil.rmtree(staged, ignore_errors=True)
        builds = sorted(
            (p for p in root.iterdir() if (p / "complete").is_file()),
            key=lambda p: (p / "complete").stat().st_mtime,
            reverse=True,
        )
        for old in builds[CACHE_KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".*"):  # a build interrupted while staging
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
    except OSError:
        return


def build(*, force: bool = False, quiet: bool = True) -> str:
    """Compile the data plane into ``dataplane/_native`` unless current: "built"/"up to date"."""
    digest = native.sources_digest()
    if not force and native.check(honour_env=False)[0]:
        return "up to date"
    key = cache_key(digest)
    if not force and _from_cache(key):
        _stamp(digest)
        if native.check(honour_env=False)[0]:
            return "copied from the cache"
    with tempfile.TemporaryDirectory(prefix="fabric-native-") as tmp:
        work = Path(tmp)
        (work / "setup.py").write_text(_SETUP.format(group=native.GROUP))
        # Run from an empty directory: setuptools and mypy would otherwise read the project's
        # pyproject.toml; the mypy options a build needs are given here.
        cmd = [
            sys.executable,
            "setup.py",
            str(work / "lib"),
            str(work / "temp"),
            "--ignore-missing-imports",
            *(str(native.PACKAGE_DIR / f"{m}.py") for m in native.DATA_PLANE),
            *(str(c.package_dir / f"{m}.py") for c in native.COMPANIONS for m in c.modules),
        ]
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise BuildError(f"mypyc build failed (exit {proc.returncode}):\n{tail}")
        elif not quiet:
            print(proc.stdout[-2000:])
        built = sorted((work / "lib" / native.PACKAGE.replace(".", "/")).glob("*.so"))
        if not built:
            raise BuildError("mypyc build produced no extension modules")
        native.BUILD_DIR.mkdir(exist_ok=True)
        (native.BUILD_DIR / native.STAMP_NAME).unlink(
            missing_ok=True
        )  # invalid while files are replaced
        _install(built, native.BUILD_DIR)
        for companion in native.COMPANIONS:
            lib = work / "lib" / companion.package.replace(".", "/")
            companion.build_dir.mkdir(exist_ok=True)
            _install(
                [lib / f"{m}{native.EXT_SUFFIX}" for m in companion.modules], companion.build_dir
            )
        _stamp(digest)
        _to_cache(key, work / "lib")
    return "built"


def _stamp(digest: str) -> None:
    stamp = {"digest": digest, "modules": list(native.DATA_PLANE), "python": sys.version}
    staged = native.BUILD_DIR / (native.STAMP_NAME + ".new")
    staged.write_text(json.dumps(stamp, indent=1) + "\n")
    os.replace(staged, native.BUILD_DIR / native.STAMP_NAME)


def _install(built: list[Path], build_dir: Path) -> None:
    for so in built:
        if not so.is_file():
            raise BuildError(f"mypyc build produced no {so.name}")
        staged = build_dir / (so.name + ".new")
        shutil.copyfile(so, staged)
        os.replace(staged, build_dir / so.name)  # running agents keep their mapped copy


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "build":
        if os.environ.get(native.ENV, "").strip() == "0":
            print(f"fabricnode.native_build: {native.ENV}=0, not building")
            return 0
        try:
            outcome = build(force="--force" in argv, quiet="-v" not in argv)
        except BuildError as exc:
            print(f"fabricnode.native_build: {exc}", file=sys.stderr)
            print("fabricnode.native_build: the data plane stays interpreted", file=sys.stderr)
            return 1
        print(f"fabricnode.native_build: {outcome}; {native.check()[1]}")
        return 0
    if command == "status":
        print(native.check()[1])
        return 0
    print(
        "usage: python -m fabricnode.native_build [build [--force] [-v] | status]", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
