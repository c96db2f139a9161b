"""Whether a supervised engine is healthy, busy or hung: the supervisor's evidence in, a
verdict out.

An engine that does not answer ``/health`` is not necessarily dead. vLLM's API server stalls
for seconds under load (tokenizing a long prompt, a large batch of detokenization), and an
engine's event loop can be held by one request (the simulated engine tokenizing a 15 MiB
prompt for ~10 s). Stopping such an engine loses every request it holds and, when the same
request is retried elsewhere, the next replica too. So a missed health check is weighed against
evidence that the process is still making progress:

* its process group used CPU time since the last look (``cpu``; the supervisor reads
  ``/proc``), or
* its metrics moved (``counters``: the prompt and generation token counters, which only a
  working engine advances).

The verdict (``verdict(now)``):

* ``HEALTHY`` while fewer than ``unhealthy_after`` health checks in a row went unanswered;
* ``BUSY`` past that while progress was seen within ``progress_window_s``, for at most
  ``busy_limit_s`` of unanswered health checks: the node stays SERVING and nothing is stopped;
* ``HUNG`` otherwise: no answer and no progress (a deadlock, a stopped process), or busy
  without an answer for longer than ``busy_limit_s`` (a spin that never ends). Stopping the
  engine is the supervisor's last resort, and ``reason`` says which of the two it was.

A process that exits is not this machine's business: the supervisor sees the exit at once
(pidfd) and marks DOWN within the same bound as before.

Pure: no I/O, the time is passed in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Health(enum.Enum):
    HEALTHY = "healthy"
    BUSY = "busy"
    HUNG = "hung"


@dataclass(frozen=True, slots=True)
class Verdict:
    health: Health
    reason: str  # why, in words, for the log and the DOWN label ("" while healthy)


HEALTHY = Verdict(Health.HEALTHY, "")


class EngineLiveness:
    def __init__(
        self,
        *,
        unhealthy_after: int = 3,
        busy_limit_s: float = 120.0,
        progress_window_s: float = 3.0,
        min_cpu_s: float = 0.05,
    ) -> None:
        self.unhealthy_after = unhealthy_after
        self.busy_limit_s = busy_limit_s
        self.progress_window_s = progress_window_s
        self.min_cpu_s = min_cpu_s  # CPU seconds between two looks that count as progress
        self.failures = 0  # health checks unanswered in a row
        self.unanswered_since: float | None = None
        self.last_why = ""
        self.last_progress: float | None = None
        self.progress_by = ""
        self._cpu: float | None = None
        self._counters: float | None = None

    # -- evidence ------------------------------------------------------------------------------

    def answered(self, now: float) -> None:
        """``/health`` answered 200."""
        self.failures = 0
        self.unanswered_since = None
        self._cpu = None  # the next episode measures its CPU from its own first look

    def unanswered(self, now: float, why: str) -> None:
        """``/health`` did not answer 200 (``why``: a timeout, a status, a refused connect)."""
        self.failures += 1
        self.last_why = why
        if self.unanswered_since is None:
            self.unanswered_since = now

    def cpu(self, now: float, seconds: float | None) -> None:
        """The CPU time the engine's process group has used so far (None: unreadable)."""
        if seconds is None:
            return
        before, self._cpu = self._cpu, seconds
        if before is not None and seconds - before >= self.min_cpu_s:
            self._progress(now, "it keeps using CPU")

    def counters(self, now: float, total: float | None) -> None:
        """The sum of the engine's token counters from a metrics scrape (None: none read)."""
        if total is None:
            return
        before, self._counters = self._counters, total
        if before is not None and total != before:
            self._progress(now, "its token counters move")

    def _progress(self, now: float, how: str) -> None:
        self.last_progress = now
        self.progress_by = how

    # -- verdict -------------------------------------------------------------------------------

    def verdict(self, now: float) -> Verdict:
        since = self.unanswered_since
        if self.failures < self.unhealthy_after or since is None:
            return HEALTHY
        quiet_s = now - since
        progress = self.last_progress
        busy = progress is not None and now - progress <= self.progress_window_s
        if busy and quiet_s <= self.busy_limit_s:
            return Verdict(
                Health.BUSY,
                f"not answering /health for {quiet_s:.0f} s ({self.last_why}), but "
                f"{self.progress_by}: busy, not dead",
            )
        if busy:
            return Verdict(
                Health.HUNG,
                f"busy without answering /health for {quiet_s:.0f} s, over the "
                f"{self.busy_limit_s:g} s an engine may be ({self.last_why})",
            )
        return Verdict(
            Health.HUNG,
            f"stopped answering /health ({self.last_why}) and made no progress for {quiet_s:.0f} s",
        )
