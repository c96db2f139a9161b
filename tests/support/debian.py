"""Installing Debian packages a test needs (Slurm and munge, Chromium and its driver), as
``make test`` must on a fresh machine: apt-get as root, one install at a time across processes
(a file lock), ``apt-get update`` once per attempt, retried with a pause, no service started by
the packages' scripts.

``install_packages`` raises ``Unavailable`` when it cannot be done here at all (not root, no
apt-get, no Debian mirror) and ``InstallError`` when apt itself fails; callers turn the first
into a skip off CI and a failure on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

INSTALL_LOCK = Path(tempfile.gettempdir()) / "fabricnode-apt-install.lock"
NO_NETWORK = re.compile(
    r"Failed to fetch|Temporary failure resolving|Could not (connect|resolve)|Unable to fetch"
    r"|Network is unreachable|Connection (refused|timed out)"
)


class Unavailable(Exception):
    """The packages cannot be installed here at all (not root, no apt, no Debian mirror)."""


class InstallError(Exception):
    """apt failed, or the lock stayed held; the message carries apt's last lines."""


def install_packages(
    packages: tuple[str, ...],
    missing: Callable[[], list[str]],
    *,
    attempts: int = 3,
    lock_timeout_s: float = 1200,
) -> float:
    """Install ``packages`` with apt if ``missing()`` names anything; the seconds it took."""
    if not missing():
        return 0.0
    if os.geteuid() != 0:
        raise Unavailable(f"{', '.join(missing())} missing, and installing needs root")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing())} missing, and there is no apt-get")
    t0 = time.monotonic()
    with file_lock(INSTALL_LOCK, lock_timeout_s):
        if not missing():  # another process installed them meanwhile
            return time.monotonic() - t0
        failures: list[str] = []
        for attempt in range(attempts):
            if attempt:
                time.sleep(5 * attempt)
            update = apt("update")
            install = apt("install", "-y", "--no-install-recommends", *packages)
            if install.returncode == 0 and not missing():
                return time.monotonic() - t0
            failures.append(tail(update.stdout + install.stdout, 6))
        if not apt_knows(packages[-1]) or NO_NETWORK.search(update.stdout + install.stdout):
            raise Unavailable(
                f"apt cannot fetch {' '.join(packages)} (no network to a Debian mirror?): "
                + failures[-1]
            )
        raise InstallError(f"apt-get install {' '.join(packages)} failed: {failures[-1]}")


def apt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    argv = [
        "apt-get",
        "-q",
        "-o",
        "DPkg::Lock::Timeout=600",
        "-o",
        "Dpkg::Options::=--force-confdef",
        "-o",
        "Dpkg::Options::=--force-confold",
        *args,
    ]
    # No service may start from the packages' scripts (there is no systemd; invoke-rc.d would
    # run the init scripts): a policy-rc.d that says no, unless the machine has its own.
    policy = Path("/usr/sbin/policy-rc.d")
    ours = args[0] == "install" and not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\n# fabricnode tests: installing packages\nexit 101\n")
        policy.chmod(0o755)
    try:
        return subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=900,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(argv, 124, f"timed out after {e.timeout} s", "")
    finally:
        if ours:
            policy.unlink(missing_ok=True)


def apt_knows(package: str) -> bool:
    shown = subprocess.run(
        ["apt-cache", "show", package], capture_output=True, timeout=60, check=False
    )
    return shown.returncode == 0 and bool(shown.stdout.strip())


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise InstallError(f"{path} is still locked after {timeout_s} s") from None
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tail(text: str, lines: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])
