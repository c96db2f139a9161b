"""Running a short host command (``nvidia-smi``, ``scontrol``) and tolerating its absence.

The discovery modules (``hardware``, ``slurm_env``) parse text and take a ``Runner`` so they can
be tested without GPUs or Slurm; ``run_command`` is the one real runner. It blocks (for at most
``timeout_s``): call it at start-up, or from ``trio.to_thread.run_sync`` inside the event loop.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

# argv -> stdout, or None when the command is missing, fails or times out.
Runner = Callable[[Sequence[str]], str | None]

DEFAULT_TIMEOUT_S = 10.0


def run_command(argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """``argv``'s standard output, or None if it cannot be run, exits non-zero or times out."""
    try:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout
