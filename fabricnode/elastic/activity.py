"""When each model was last in demand, for the idle rule: every kind of evidence the mesh shows.

Rules
-----
* Pure, in the manner of h11: no I/O, no clock. Evidence comes in with its time (unix seconds,
  the controller's wall clock, which is also Slurm's); a verdict is asked for at ``now``.
* A model was in demand at ``at`` when (``Evidence``):

  - ``WANTED``: an ingress holds requests for it (its ``fabric.wanted`` label);
  - ``BUSY``: a replica of it has requests running or waiting, or its agent requests in
    flight (the gossiped load). Requests are logged when they *end*: a burst held while the
    model started and released to the new replica shows here, and nowhere else, until it
    ends;
  - ``LOGGED``: the agents' request logs counted requests for it within the idle time (the
    window's verdict: at the time of the check);
  - ``STARTED``: a job of it that is not a time-limit successor was submitted at ``at``
    (Slurm's submit time of the newest such job, ``vocab.Held.newest_at``): the acting
    controller started it for demand then.

* ``last(model)`` is the latest of all the evidence; the model goes idle ``idle_s`` after it
  (``idle_at``). Evidence only ever moves ``last`` later: the verdict does not depend on the
  order the evidence came in, and nothing the controller sees makes a model idle sooner.

Why ``STARTED`` and ``BUSY`` exist: a controller that takes over knows nothing of what its
predecessor saw. During a ramp from zero the held requests have gone to the new replica (the
wanted label is cleared) and none has ended (the logs count nothing): without these two, the
successor would find the model idle and cancel the replica that serves them. Slurm's list of
jobs and the gossiped load survive a takeover; what is rebuilt from them needs no memory.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field


class Evidence(enum.Enum):
    """What says a model was in demand (module docstring)."""

    WANTED = "wanted"
    BUSY = "busy"
    LOGGED = "logged"
    STARTED = "started"


@dataclass
class Activity:
    """Per model, the latest evidence of demand and what it was (module docstring)."""

    _last: dict[str, tuple[float, Evidence]] = field(default_factory=dict)

    def saw(self, model: str, evidence: Evidence, at: float) -> None:
        """``model`` was in demand at ``at`` (ignored unless later than what is known)."""
        if not math.isfinite(at):
            return
        known = self._last.get(model)
        if known is None or at > known[0]:
            self._last[model] = (at, evidence)

    def last(self, model: str) -> float | None:
        """The latest time ``model`` was seen in demand, None if never."""
        known = self._last.get(model)
        return None if known is None else known[0]

    def why(self, model: str) -> Evidence | None:
        """What the latest evidence was."""
        known = self._last.get(model)
        return None if known is None else known[1]

    def idle_at(self, model: str, idle_s: float) -> float:
        """When ``model`` goes idle if nothing more is seen (-inf: it never was in demand)."""
        last = self.last(model)
        return -math.inf if last is None else last + idle_s

    def idle(self, model: str, idle_s: float, now: float) -> bool:
        return now >= self.idle_at(model, idle_s)

    def keep(self, models: Iterable[str]) -> None:
        """Forget every model not in ``models`` (no longer declared)."""
        wanted = set(models)
        for model in [m for m in self._last if m not in wanted]:
            del self._last[model]
