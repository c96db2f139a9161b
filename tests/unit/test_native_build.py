"""The compiled build's cache (``fabricnode.native_build``): a build is kept whole or not at all,
copied back byte for byte, trimmed to the newest few, and off when asked; on stand-in files (a
real build takes minutes: make test does one)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fabricnode import native, native_build

SUFFIX = native.EXT_SUFFIX


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in package of two compiled modules and its shared library; returns a build-lib
    folder holding their outputs, as setup leaves them."""
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(native, "PACKAGE", "pkg")
    monkeypatch.setattr(native, "DATA_PLANE", ("a", "b"))
    monkeypatch.setattr(native, "SHARED_LIB", "lib__mypyc")
    monkeypatch.setattr(native, "COMPANIONS", ())
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path / "tree" / "pkg" / "_native")
    native.BUILD_DIR.parent.mkdir(parents=True)
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    for name in ("a", "b", "lib__mypyc"):
        (lib / "pkg" / f"{name}{SUFFIX}").write_bytes(f"compiled {name}".encode())
    return lib


def test_a_cached_build_is_installed_as_it_was_built(fake: Path) -> None:
    assert not native_build._from_cache("k1")  # nothing cached yet
    native_build._to_cache("k1", fake)
    assert native_build._from_cache("k1")
    for name in ("a", "b", "lib__mypyc"):
        assert (native.BUILD_DIR / f"{name}{SUFFIX}").read_bytes() == f"compiled {name}".encode()


def test_an_incomplete_cached_build_is_not_used(fake: Path) -> None:
    native_build._to_cache("k1", fake)
    cache = native_build.cache_dir()
    assert cache is not None
    (cache / "k1" / "pkg" / f"b{SUFFIX}").unlink()
    assert not native_build._from_cache("k1")
    assert not (native.BUILD_DIR / f"a{SUFFIX}").exists()  # nothing half-installed


def test_the_cache_keeps_the_newest_builds_only(fake: Path) -> None:
    for i in range(native_build.CACHE_KEEP + 2):
        native_build._to_cache(f"k{i}", fake)
        cache = native_build.cache_dir()
        assert cache is not None
        stamp = cache / f"k{i}" / "complete"
        then = time.time() - 100 + i  # each newer than the one before, all older than now
        os.utime(stamp, (then, then))
    kept = sorted(p.name for p in cache.iterdir())
    assert len(kept) == native_build.CACHE_KEEP and "k0" not in kept and "k1" not in kept


def test_an_empty_setting_turns_the_cache_off(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_build.CACHE_ENV, "")
    assert native_build.cache_dir() is None
    native_build._to_cache("k1", fake)
    assert not native_build._from_cache("k1")


def test_the_key_names_the_sources_and_the_compiler() -> None:
    key = native_build.cache_key("ab" * 32)
    assert key.startswith("ab" * 16 + "-mypy")
