"""Third-party routers for the benchmarks, each in its own venv outside the repository.

``ensure(name)`` installs the named tool from PyPI on first use into
``$FABRIC_BENCH_VENVS/NAME`` (default ``/var/cache/fabricnode/bench-venvs/NAME``) and reuses it
afterwards. A marker file is written only when the install succeeded, so an interrupted install
never leaves a half-built venv that looks ready (the next run rebuilds it).
A lock file serialises concurrent installs of the same tool. Any failure raises
``VenvUnavailable`` with a one-line reason, which the bench reports as "unavailable: <reason>";
a failure is remembered for ``FAILURE_TTL_S`` so that repeated bench runs do not retry a
broken install every time (delete the ``NAME.failed`` file to retry at once).

    python bench/_venvs.py vllm-router litellm     # install (or show) both, print timings
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/var/cache/fabricnode/bench-venvs")
INSTALL_TIMEOUT_S = 1500.0
FAILURE_TTL_S = 3600.0

# name -> (pip requirements, executable that must exist in the venv's bin/ afterwards)
TOOLS: dict[str, tuple[list[str], str]] = {
    "vllm-router": (["vllm-router"], "vllm-router"),
    "litellm": (["litellm[proxy]"], "litellm"),
    # bench/aiohttp_backend.py, the notes' fake backend (bench/router.py --backend aiohttp)
    "aiohttp-backend": (["aiohttp", "orjson", "httptools"], "python"),
}


class VenvUnavailable(Exception):
    """The tool could not be installed or found; the message is a one-line reason."""


@dataclass(frozen=True)
class ToolVenv:
    name: str
    path: Path
    executable: Path
    version: str
    install_s: float  # how long the first install took (0 when unknown)
    installed_now: bool  # True when this call installed it

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def venv_root() -> Path:
    return Path(os.environ.get("FABRIC_BENCH_VENVS") or DEFAULT_ROOT)


def _read_marker(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads((path / ".bench-installed").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ready(name: str, path: Path, installed_now: bool) -> ToolVenv | None:
    marker = _read_marker(path)
    exe = path / "bin" / TOOLS[name][1]
    if marker is None or not exe.exists():
        return None
    return ToolVenv(
        name=name,
        path=path,
        executable=exe,
        version=str(marker.get("version", "?")),
        install_s=float(marker.get("install_s", 0.0)),  # type: ignore[arg-type]
        installed_now=installed_now,
    )


def _one_line(text: str, limit: int = 200) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    line = (errors or lines or ["(no output)"])[-1]
    return line[:limit]


def _run(cmd: list[str], timeout_s: float) -> None:
    try:
        done = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        raise VenvUnavailable(f"{' '.join(cmd[:3])}... timed out after {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise VenvUnavailable(f"{cmd[0]}: {exc}") from exc
    if done.returncode != 0:
        raise VenvUnavailable(
            f"{' '.join(cmd[:4])} exited {done.returncode}: {_one_line(done.stderr + done.stdout)}"
        )


def _base_python() -> str:
    """The interpreter the venv is made from: the one running us, outside any venv."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _install(name: str, path: Path) -> ToolVenv:
    """Build the venv in place; the marker is written last, so a partial venv is rebuilt."""
    requirements, exe = TOOLS[name]
    shutil.rmtree(path, ignore_errors=True)
    started = time.monotonic()
    try:
        _run([_base_python(), "-m", "venv", str(path)], 120.0)
        python = str(path / "bin" / "python")
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, *requirements], INSTALL_TIMEOUT_S)
        dist = requirements[0].split("[", 1)[0]
        probe = f"import importlib.metadata as m; print(m.version({dist!r}))"
        version = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=60
        ).stdout.strip()
        if not (path / "bin" / exe).exists():
            raise VenvUnavailable(f"{name}: installed, but bin/{exe} is missing")
        marker = {
            "requirements": requirements,
            "version": version or "?",
            "install_s": round(time.monotonic() - started, 1),
        }
        (path / ".bench-installed").write_text(json.dumps(marker))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    ready = _ready(name, path, installed_now=True)
    assert ready is not None
    return ready


def ensure(name: str, *, install: bool = True) -> ToolVenv:
    """The venv for ``name``, installing it first if needed; VenvUnavailable if it cannot be."""
    if name not in TOOLS:
        raise VenvUnavailable(f"unknown tool {name!r}")
    root = venv_root()
    path = root / name
    ready = _ready(name, path, installed_now=False)
    if ready is not None:
        return ready
    if not install:
        raise VenvUnavailable(f"not installed in {path} (run: python bench/_venvs.py {name})")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VenvUnavailable(f"cannot create {root}: {exc}") from exc
    failed = root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = _ready(name, path, installed_now=False)  # another process may have finished it
        if ready is not None:
            return ready
        try:
            if time.time() - failed.stat().st_mtime < FAILURE_TTL_S:
                raise VenvUnavailable(
                    f"install failed recently ({failed.read_text().strip()}); "
                    f"delete {failed} to retry"
                )
        except FileNotFoundError:
            pass
        try:
            ready = _install(name, path)
        except VenvUnavailable as exc:
            failed.write_text(str(exc) + "\n")
            raise
        failed.unlink(missing_ok=True)
        return ready


def vllm_router_argv(
    venv: ToolVenv, port: int, worker_urls: Sequence[str], policy: str, prometheus_port: int
) -> list[str]:
    """vllm-router's command line as the benches run it: on 127.0.0.1:``port`` in front of
    ``worker_urls`` with ``policy``, its Prometheus endpoint on loopback too (``prometheus_port``:
    its default port would clash between runs), warnings only."""
    return [
        str(venv.executable),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warning",
    ]


def main(argv: list[str]) -> int:
    status = 0
    for name in argv or list(TOOLS):
        t0 = time.monotonic()
        try:
            venv = ensure(name)
        except VenvUnavailable as exc:
            print(f"{name}: unavailable: {exc}")
            status = 1
            continue
        took = time.monotonic() - t0
        how = f"installed in {took:.0f} s" if venv.installed_now else "already installed"
        first = f"first install {venv.install_s:.0f} s"
        print(f"{name} {venv.version}: {venv.executable} ({how}; {first})")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
