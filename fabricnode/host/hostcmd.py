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


def run_full(argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, str, str]:
    """``argv``'s exit status, standard output and error; a command that cannot be run is 127
    (not found) or 1 (any other failure to start, or a timeout), its error the reason."""
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
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: command not found"
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return 1, "", f"{argv[0]}: {exc}"
    return done.returncode, done.stdout, done.stderr


def run_command(argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """``argv``'s standard output, or None if it cannot be run, exits non-zero or times out."""
    code, out, _ = run_full(argv, timeout_s)
    return out if code == 0 else None
