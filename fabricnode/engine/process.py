"""Engine child process: spawn, forward output, probe readiness, stop without orphans.

The engine command is run exactly as given (argv, no shell) in its own process group, so that
stopping it reaches every process it started (vLLM and SGLang fork workers). Three paths end it:

* we stop it: SIGTERM to the whole group, SIGKILL to the group after ``kill_after_s`` (the
  engine's own shutdown grace and a margin: ``service.stop_timeout_s``), or after at most
  ``SHORT_KILL_AFTER_S`` when there is nothing to wait for: the task running it is cancelled
  (a second signal: at once), or the engine is hung;
* it exits by itself: the caller learns the exit code from ``wait``;
* the agent dies without cleaning up (kill -9, OOM): the child was started with the Linux
  parent-death signal (``PR_SET_PDEATHSIG`` = SIGKILL), so the kernel kills it; its own
  children then lose their parent and, for the engines we wrap, exit with it.

The parent-death signal fires when the *thread* that forked the child exits, not the process.
``trio.lowlevel.open_process`` forks from a worker thread that trio retires after a few idle
seconds, which would kill a healthy engine; so we fork from the thread running trio (it lives
as long as the agent) with a plain ``subprocess.Popen`` — fork/exec takes milliseconds — and
wait for the exit through a pidfd, readable when the child ends.

Output (stdout and stderr, merged) is forwarded line by line to the agent's log with an
``[engine]`` prefix and appended to a log file, so a job's engine log survives the job.

Readiness: ``wait_ready`` polls ``/health`` and then ``/v1/models`` with capped exponential
backoff while the engine loads (that can take many minutes for a large model), logs progress,
and returns the served models.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import httpx
import orjson
import trio

from fabricnode.engine.models import ServedModel, parse_models
from fabricnode.errors import FabricError

log = logging.getLogger("fabricnode.engine.service")

PR_SET_PDEATHSIG = 1
MAX_LINE_BYTES = 64 * 1024
SHORT_KILL_AFTER_S = 10.0
TAIL_LINES = 20  # the engine's last output lines, kept for its error (``last_error``)
MAX_TAIL_CHARS = 400


def group_cpu_seconds(pgid: int, proc: Path = Path("/proc")) -> float | None:
    """The user and system CPU time used so far by the live processes of group ``pgid`` (an
    engine and the workers it started: vLLM's API server and engine core), from
    ``/proc/<pid>/stat``; None when ``/proc`` cannot be read (not Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    try:
        entries = list(proc.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        # pid (comm) state ppid pgrp ... : comm may hold spaces and parentheses, so the fields
        # are counted from the last ")".
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 12 and fields[2] == str(pgid).encode():
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


class EngineError(FabricError):
    """The engine could not be started or stopped."""


# Resolved once, in the parent: between fork and exec the child may only make plain calls
# (no imports, no subprocesses, no locks other threads might hold).
_LIBC = ctypes.CDLL(None, use_errno=True)


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class EngineProcess:
    """One running engine child."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        kill_after_s: float = 10.0,
        pass_fds: Sequence[int] = (),
    ) -> None:
        if not argv:
            raise EngineError("empty engine command")
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.kill_after_s = kill_after_s
        self.pass_fds = tuple(pass_fds)  # inherited by the child at the same numbers
        self._process: subprocess.Popen[bytes] | None = None
        self._stdout: trio.lowlevel.FdStream | None = None
        self._log_file: IO[bytes] | None = None
        self.exited = trio.Event()
        self._pumped = trio.Event()
        self.returncode: int | None = None
        self.lines = 0
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> int:
        """Start the child, forward its output until it exits; returns its exit code.

        Cancelling this task stops the child (group SIGTERM, then SIGKILL).
        """
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in finally
        try:
            try:
                self._process = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_set_parent_death_signal,
                    env=self.env,
                    pass_fds=self.pass_fds,
                )
            except OSError as exc:
                raise EngineError(f"cannot start engine {self.argv[0]!r}: {exc.strerror}") from exc
            assert self._process.stdout is not None
            self._stdout = trio.lowlevel.FdStream(os.dup(self._process.stdout.fileno()))
            self._process.stdout.close()
            log.info("engine started: pid %d: %s", self._process.pid, " ".join(self.argv))
            task_status.started(self._process.pid)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_output)
                    code = await self._wait()
                    self._finish(code)
                    # The leader is gone; workers it forked must not outlive it (they also
                    # hold our output pipe open). Then drain what is left of the output.
                    self._kill_group()
                    with trio.move_on_after(2.0):
                        await self._pumped.wait()
                    nursery.cancel_scope.cancel()
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self.stop(min(self.kill_after_s, SHORT_KILL_AFTER_S))
                raise
            return code
        finally:
            if self._stdout is not None:
                await self._stdout.aclose()
                self._stdout = None
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    async def _wait(self) -> int:
        """Wait for the child without a thread: its pidfd turns readable when it exits."""
        proc = self._process
        assert proc is not None
        if proc.returncode is not None:
            return proc.returncode
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # kernel < 5.3: poll instead
            while proc.poll() is None:
                await trio.sleep(0.05)
            return proc.wait()
        try:
            await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        return proc.wait()

    def _finish(self, code: int) -> None:
        self.returncode = code
        self.exited.set()
        log.info("engine exited with status %d", code)

    async def _pump_output(self) -> None:
        assert self._stdout is not None
        stream = self._stdout
        pending = b""
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            if self._log_file is not None:
                self._log_file.write(chunk)
                self._log_file.flush()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._log_line(line)
            if len(pending) > MAX_LINE_BYTES:
                self._log_line(pending)
                pending = b""
        if pending:
            self._log_line(pending)
        self._pumped.set()

    def _log_line(self, line: bytes) -> None:
        self.lines += 1
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        if text.strip():
            self.tail.append(text[:MAX_TAIL_CHARS])
        log.info("[engine] %s", text)

    def last_error(self) -> str:
        """The engine's own words for why it failed: its last output line that reads like an
        error (``Error``, ``error:``, ``Exception``, ``Traceback`` excluded), else its last line."""
        words = ("Error", "error:", "Exception", "FAILED", "fatal")
        for text in reversed(self.tail):
            if any(w in text for w in words) and not text.startswith("Traceback"):
                return text.strip()
        return self.tail[-1].strip() if self.tail else ""

    def signal_group(self, sig: int) -> None:
        if self._process is None or self._process.returncode is not None:
            return
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            pass

    def _kill_group(self) -> None:
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def stop(self, kill_after_s: float | None = None) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``kill_after_s`` (default: the
        process's); returns the exit code."""
        proc = self._process
        if proc is None:
            return None
        if kill_after_s is None:
            kill_after_s = self.kill_after_s
        if proc.returncode is None:
            self.signal_group(signal.SIGTERM)
            with trio.move_on_after(kill_after_s):
                await self._wait()
            if proc.returncode is None:
                log.warning("engine ignored SIGTERM for %.0f s: SIGKILL", kill_after_s)
        self._kill_group()  # whatever the leader did, no member of its group may outlive it
        with trio.CancelScope(shield=True):
            code = await self._wait()
        if not self.exited.is_set():
            self._finish(code)
        return code


async def wait_ready(
    base_url: str,
    *,
    client: httpx.AsyncClient,
    exited: trio.Event | None = None,
    initial_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
    progress_every_s: float = 15.0,
    clock: Callable[[], float] = time.monotonic,
) -> list[ServedModel]:
    """Poll until the engine answers /health and lists models; returns them.

    Never gives up by itself (loading can take very long): cancel it, or set ``exited`` when
    the child dies, which raises EngineError.
    """
    delay = initial_delay_s
    started = clock()
    last_progress = started
    last_error = "no answer yet"
    while True:
        if exited is not None and exited.is_set():
            raise EngineError("the engine exited before it was ready")
        try:
            health = await client.get(f"{base_url}/health", timeout=5.0)
            if health.status_code == 200:
                models = await client.get(f"{base_url}/v1/models", timeout=10.0)
                if models.status_code == 200:
                    # orjson: a deeply nested answer is a ValueError, not a RecursionError
                    served = parse_models(orjson.loads(models.content))
                    if served:
                        return served
                    last_error = "/v1/models lists no model yet"
                else:
                    last_error = f"/v1/models answered {models.status_code}"
            else:
                last_error = f"/health answered {health.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            last_error = type(exc).__name__
        now = clock()
        if now - last_progress >= progress_every_s:
            last_progress = now
            log.info(
                "engine loading: %.0f s so far, not ready at %s (%s)",
                now - started,
                base_url,
                last_error,
            )
        if exited is not None:
            with trio.move_on_after(delay):
                await exited.wait()
        else:
            await trio.sleep(delay)
        delay = min(delay * 2, max_delay_s)
