"""The compiled data plane: used when built from the current sources, never when stale."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabricnode import native

SUFFIX = native.EXT_SUFFIX


@pytest.mark.skipif(
    os.environ.get(native.ENV) == "0", reason="FABRIC_NATIVE=0: the interpreted run"
)
def test_the_test_run_exercises_the_compiled_data_plane() -> None:
    # `make test` builds the data plane first, so the suite tests what agents run. If the build
    # is stale or missing, this says so instead of the suite silently testing the sources.
    assert native.status.startswith("native"), native.status
    names = [f"{native.PACKAGE}.{name}" for name in native.DATA_PLANE]
    names += [f"{c.package}.{name}" for c in native.COMPANIONS for name in c.modules]
    for name in names:
        module = importlib.import_module(name)
        assert native.is_compiled(module), f"{name} runs from {module.__file__}"


def test_a_companion_runs_compiled_when_imported_before_the_data_plane() -> None:
    # The request log's compiled modules load the data plane's shared library by name: a
    # process that imports the request log first (the CLI, the controller) must still get them.
    code = (
        "import fabricnode.requestlog.format as f, fabricnode.native as n;"
        " print(n.is_compiled(f), n.status)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split(" ", 1)
    assert out[0] == str(native.status.startswith("native")), out


def test_fabric_native_0_runs_the_sources() -> None:
    code = (
        "import fabricnode.dataplane.ingress as i, fabricnode.requestlog.format as f,"
        " fabricnode.native as n; print(i.__file__, f.__file__, n.status)"
    )
    env = {**os.environ, native.ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split(" ", 2)
    assert out[0].endswith("ingress.py") and out[1].endswith("format.py")
    assert out[2].strip() == "interpreted: FABRIC_NATIVE=0"


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A package with the data-plane sources and a build stamped with their digest."""
    monkeypatch.delenv(native.ENV, raising=False)  # the suite also runs with FABRIC_NATIVE=0
    package, build = tmp_path / "pkg", tmp_path / "build"
    package.mkdir()
    build.mkdir()
    for name in native.DATA_PLANE:
        (package / f"{name}.py").write_text(f"# {name}\n")
        (build / f"{name}{SUFFIX}").write_bytes(b"")
    (build / f"{native.SHARED_LIB}{SUFFIX}").write_bytes(b"")
    digest = native.sources_digest(package, companions=())
    stamp = {"digest": digest, "modules": list(native.DATA_PLANE)}
    (build / native.STAMP_NAME).write_text(json.dumps(stamp))
    return package, build


def test_a_current_build_is_used(fake_build: tuple[Path, Path]) -> None:
    package, build = fake_build
    use, why = native.check(build, package, companions=())
    assert use and why.startswith("native")


def test_an_edited_source_is_never_shadowed_by_its_old_build(
    fake_build: tuple[Path, Path],
) -> None:
    package, build = fake_build
    (package / "ingress.py").write_text("# edited\n")
    assert native.check(build, package, companions=()) == (
        False,
        "interpreted: sources changed since the last build (run `make native`)",
    )


def test_a_missing_or_partial_build_is_not_used(fake_build: tuple[Path, Path]) -> None:
    package, build = fake_build
    (build / f"routing{SUFFIX}").unlink()
    use, why = native.check(build, package, companions=())
    assert not use and "routing" in why
    (build / native.STAMP_NAME).unlink()
    assert native.check(build, package, companions=()) == (
        False,
        "interpreted: not built (run `make native`)",
    )


def test_an_edited_or_missing_companion_is_never_shadowed(tmp_path: Path) -> None:
    package, build, other = tmp_path / "pkg", tmp_path / "build", tmp_path / "other"
    for folder in (package, build, other, other / "_native"):
        folder.mkdir()
    for name in native.DATA_PLANE:
        (package / f"{name}.py").write_text(f"# {name}\n")
        (build / f"{name}{SUFFIX}").write_bytes(b"")
    (build / f"{native.SHARED_LIB}{SUFFIX}").write_bytes(b"")
    (other / "format.py").write_text("# format\n")
    (other / "_native" / f"format{SUFFIX}").write_bytes(b"")
    companions = (native.Companion("pkg2", other, ("format",)),)
    digest = native.sources_digest(package, companions=companions)
    (build / native.STAMP_NAME).write_text(json.dumps({"digest": digest}))
    assert native.check(build, package, honour_env=False, companions=companions)[0]
    (other / "_native" / f"format{SUFFIX}").unlink()
    use, why = native.check(build, package, honour_env=False, companions=companions)
    assert not use and "pkg2.format" in why
    (other / "format.py").write_text("# edited\n")
    assert native.check(build, package, honour_env=False, companions=companions) == (
        False,
        "interpreted: sources changed since the last build (run `make native`)",
    )


def test_an_unreadable_stamp_is_not_used(fake_build: tuple[Path, Path]) -> None:
    package, build = fake_build
    (build / native.STAMP_NAME).write_text("{not json")
    use, why = native.check(build, package, companions=())
    assert not use and why.startswith("interpreted: unreadable build stamp")


def test_the_environment_switch_wins_over_a_current_build(
    fake_build: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    package, build = fake_build
    monkeypatch.setenv(native.ENV, "0")
    assert native.check(build, package, companions=()) == (False, "interpreted: FABRIC_NATIVE=0")
    assert native.check(build, package, honour_env=False, companions=())[0]
