"""Build the compiled data plane: ``python -m fabricnode.native_build [build|status]``.

mypyc compiles the modules in ``native.DATA_PLANE`` into ``fabricnode/dataplane/_native/`` (and
its ``COMPANIONS`` into their packages' ``_native`` folders) and
stamps the build with the digest of its sources; ``native.activate`` uses the build only while that
digest matches. Needs mypy (which ships mypyc) and a C compiler with the Python headers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
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


class BuildError(Exception):
    pass


def build(*, force: bool = False, quiet: bool = True) -> str:
    """Compile the data plane into ``dataplane/_native`` unless current: "built"/"up to date"."""
    digest = native.sources_digest()
    if not force and native.check(honour_env=False)[0]:
        return "up to date"
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
        stamp = {"digest": digest, "modules": list(native.DATA_PLANE), "python": sys.version}
        staged = native.BUILD_DIR / (native.STAMP_NAME + ".new")
        staged.write_text(json.dumps(stamp, indent=1) + "\n")
        os.replace(staged, native.BUILD_DIR / native.STAMP_NAME)
    return "built"


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
