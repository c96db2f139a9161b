"""Scale by need: the replicas a model's work needs when a replica submitted now arrives.

Rules
-----
* Pure: numbers in, a count out; no clock (the caller's ``cold_start_s`` is the horizon).
  Work is in replica-seconds: what one replica does fully busy in one second
  (``policy.ReplicaCapacity.work``), so a work *rate* is a number of fully busy replicas.
* A replica submitted now serves from ``cold_start_s`` on. What it meets then (``Need``):

  - **rate**: the work per second expected at that time (the forecast's, with its headroom);
  - **backlog left**: the queued work (requests waiting at the replicas, each the mean
    request's work) still there when it arrives if the demand stays what it is now: the
    serving replicas drain the queue meanwhile with what the current demand leaves them
    (``spare``: serving replicas minus the work rate now; negative while the queue grows, which
    it then does until the replica arrives). The rate now is the caller's measure (the
    policy's: the queue's growth on top of busy replicas, the forecast's level otherwise). A
    burst that has ended, its queue shrinking, leaves what the replicas there cannot drain
    before a new one arrives: often nothing, and then it asks for no replica (the queue, the
    hold queue, sleeping replicas and other sites absorb it).

  What is left is drained over ``drain_s`` (at least the cold start: a replica that arrives
  has that long to help before another could).
* ``replicas = ceil((rate + left / drain_s) / utilisation)``: several at once when that is the
  need, none when the queue drains by itself. The same arithmetic, at the scale-in band's
  utilisation, is what the policy's scale-in keeps (``policy``: hysteresis).
* Laws (tests/unit/elastic/test_need.py, Hypothesis): never negative; monotone in the rate and
  the backlog; never more with more spare capacity; with no backlog it is the rate's count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True)
class Need:
    """What a replica submitted now meets when it arrives (module docstring), in replicas."""

    rate: float  # work per second expected at the arrival time (fully busy replicas)
    backlog_left: float  # replica-seconds still queued at the arrival time
    drain_s: float  # over how long the backlog left is drained

    @property
    def work(self) -> float:
        """Fully busy replicas the arrival time needs."""
        return self.rate + self.backlog_left / self.drain_s


def at_arrival(
    *,
    rate: float,
    rate_now: float,
    backlog: float,
    serving: int,
    cold_start_s: float,
    drain_s: float,
) -> Need:
    """The need at the arrival of a replica submitted now: ``rate`` expected then (replicas
    fully busy), ``rate_now`` the demand now, ``backlog`` the queued work now
    (replica-seconds), ``serving`` replicas draining it meanwhile."""
    spare = serving - max(0.0, rate_now)
    left = max(0.0, backlog - spare * cold_start_s)
    return Need(max(0.0, rate), left, max(drain_s, cold_start_s, _EPS))


def replicas(need: Need, utilisation: float) -> int:
    """The fewest replicas that meet ``need`` with each at most ``utilisation`` busy."""
    return max(0, math.ceil(need.work / utilisation - _EPS))
