"""Which controller acts: exactly one of the agents started with ``--controller``, chosen from the
registry every agent already replicates, with no election messages of its own.

Rules
-----
* A controller agent announces itself with the label ``fabric.controller`` whose value is the
  unix time it became a candidate (``CONTROLLER_LABEL``).
* The acting controller is the candidate that has been one the longest (smallest time, then
  smallest session id), among the entries that are neither DOWN nor LEFT and that this agent
  does not know to be dead. A newcomer never displaces a working incumbent, so adding a
  standby changes nothing.
* A suspected incumbent keeps its place: suspicion is often a slow network, and two acting
  controllers are worse than a pass that waits a few seconds. Once the failure detector
  declares it dead (seconds, see docs/architecture.md) or it leaves, the next candidate acts.
* Every agent computes the same answer from the same registry, so standbys agree on who acts
  once gossip has converged. In a network partition each side may elect its own: a controller
  always starts from Slurm's list of the mesh's jobs (``reconcile``), and a side that finds more
  jobs than the service file allows cancels the extra ones, so a healed partition converges.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fabricnode.mesh.schema import CONTROLLER_LABEL


@dataclass(frozen=True)
class Candidate:
    session_id: str
    since: float
    dead: bool  # this agent's failure detector says so, or the entry is DOWN/LEFT
    http: str = ""  # its admin/HTTP address, where `fabric services` asks for its status


def candidate_since(labels: Iterable[tuple[str, str]]) -> float | None:
    for key, value in labels:
        if key == CONTROLLER_LABEL:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def acting(candidates: Iterable[Candidate]) -> Candidate | None:
    """The acting controller (module docstring), or None when no candidate is alive."""
    alive = [c for c in candidates if not c.dead]
    return min(alive, key=lambda c: (c.since, c.session_id), default=None)
