"""Failover: how many nodes a request may still try, for how long, and when to stop.

The ingress tries a request's candidates in turn until one answers (``Ingress._dispatch``).
This machine keeps the account of those attempts and says when trying stops, so that the loop
holds no policy:

* at most ``max_attempts`` nodes within ``retry_budget_s`` of the request's start (the time a
  batch request waited in the gate does not count: ``restart_clock``);
* a connection refused at once sent nothing, and costs no attempt (at most
  ``MAX_REFUSED_SKIPS`` of them: phantom or freshly dead entries must not use up a request's
  failover);
* a stream that broke mid-answer and is continued elsewhere gets attempts and time of its own
  (``resumed``), on the nodes not tried yet;
* an attempt taken back by the batch gate under pressure is not the node's failure and uses no
  attempt (``preempted``);
* **the poison-request guard**: an attempt whose outcome says an engine failed on the request
  itself (``failure.Failed.engine_failure``: broken, no answer, the node went down, the
  serving agent said 502 or 504) counts; at ``max_engine_failures`` of them the request is not
  tried on another node (``poisoned``), since one failure is an engine's bad luck and two are
  likely the request, which would otherwise take down every replica of its model in turn.

Pure: no I/O; the times are passed in.
"""

from __future__ import annotations

from fabricnode.dataplane.failure import REFUSED, Failed

MAX_REFUSED_SKIPS = 8  # refused connections per request that do not count as attempts


class Failover:
    __slots__ = (
        "budget_s",
        "deadline",
        "engine_failures",
        "last_error",
        "limit",
        "max_attempts",
        "max_engine_failures",
        "poisoned",
        "refused",
        "tried",
    )

    def __init__(
        self, started: float, max_attempts: int, retry_budget_s: float, max_engine_failures: int
    ) -> None:
        self.max_attempts = max_attempts
        self.budget_s = retry_budget_s
        self.max_engine_failures = max_engine_failures
        self.tried: set[str] = set()  # session ids of the nodes tried
        self.limit = max_attempts  # raised by refused connects and resumed streams
        self.deadline = started + retry_budget_s
        self.refused = 0
        self.engine_failures = 0
        self.poisoned = False
        self.last_error = "no eligible node"

    def may_try(self, now: float) -> bool:
        """Whether another node may be tried at ``now``."""
        if self.poisoned or len(self.tried) >= self.limit:
            return False
        return not (self.tried and now >= self.deadline)

    def restart_clock(self, now: float) -> None:
        """The request waited (in the batch gate) before its first attempt: that time is not
        failover time."""
        if not self.tried:
            self.deadline = now + self.budget_s

    def picked(self, sid: str) -> None:
        self.tried.add(sid)

    def preempted(self, sid: str) -> None:
        """Taken back under pressure: not the node's failure, and no attempt used."""
        self.tried.discard(sid)

    def resumed(self, now: float) -> None:
        """A stream broke mid-answer and a continuation is ready: attempts and time of its own."""
        self.last_error = "no node left to try"
        self.limit = len(self.tried) + self.max_attempts
        self.deadline = now + self.budget_s

    def failed(self, outcome: Failed) -> bool:
        """An attempt failed before the first byte with ``outcome``; True when that makes the
        request poisoned (stop: not tried on another node)."""
        self.last_error = outcome.text
        if outcome.engine_failure:
            self.engine_failures += 1
            if self.engine_failures >= self.max_engine_failures:
                self.poisoned = True
                return True
        if outcome.kind == REFUSED and self.refused < MAX_REFUSED_SKIPS:
            self.refused += 1
            self.limit += 1
        return False

    def poison_message(self) -> str:
        return (
            f"the request failed on {self.engine_failures} nodes (last: {self.last_error}); it "
            "is not tried on another, as it may be what makes them fail"
        )
