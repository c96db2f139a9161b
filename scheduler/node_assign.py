"""From engines on named nodes (``scheduler.realise``) to what ``fabric plan --apply`` sends.

The planner places on the mesh's nodes themselves (each agent's hardware is one node of the
inventory, named by its session id), so applying a plan is bookkeeping:

* an engine on a JOIN node becomes one ``NodeAssignment`` (the agent launches it);
* an engine on a SERVING node that already serves its model needs nothing (its GPUs are
  reported under ``serving_gpus``);
* an engine on a SERVING node that serves another model is *not* applied (apply never stops a
  running engine): it is reported as ``Unplaced``;
* JOIN nodes without an engine stay idle (``idle_nodes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.realise import NodeEngine


@dataclass(frozen=True)
class MeshNode:
    session_id: str
    gpu: str  # catalog GPU type
    gpus: int
    state: str  # "join" or "serving"
    models: tuple[str, ...] = ()  # catalog model ids it serves


@dataclass(frozen=True)
class NodeAssignment:
    session_id: str
    model: str
    gpu: str
    tp: int
    dp: int
    node_gpus: int

    @property
    def idle_gpus(self) -> int:
        return self.node_gpus - self.tp * self.dp


@dataclass(frozen=True)
class Unplaced:
    model: str
    gpu: str
    tp: int
    replicas: int


@dataclass(frozen=True)
class NodePlan:
    assignments: tuple[NodeAssignment, ...]
    serving_gpus: dict[tuple[str, str], int]  # (model, gpu) -> GPUs SERVING nodes provide
    unplaced: tuple[Unplaced, ...]
    idle_nodes: tuple[str, ...]  # JOIN nodes that get no assignment

    def to_json(self) -> dict[str, object]:
        return {
            "assignments": [
                {
                    "session_id": a.session_id,
                    "model": a.model,
                    "gpu": a.gpu,
                    "tp": a.tp,
                    "dp": a.dp,
                    "idle_gpus": a.idle_gpus,
                }
                for a in self.assignments
            ],
            "already_serving": [
                {"model": m, "gpu": g, "gpus": n} for (m, g), n in sorted(self.serving_gpus.items())
            ],
            "unplaced": [
                {"model": u.model, "gpu": u.gpu, "tp": u.tp, "replicas": u.replicas}
                for u in self.unplaced
            ],
            "idle_nodes": list(self.idle_nodes),
        }


def assign_layout(engines: Iterable[NodeEngine], nodes: Iterable[MeshNode]) -> NodePlan:
    """The assignments that make the mesh run ``engines`` (module docstring)."""
    by_id = {n.session_id: n for n in nodes}
    serving: dict[tuple[str, str], int] = {}
    for n in by_id.values():
        if n.state == "serving":
            for model in n.models:
                serving[(model, n.gpu)] = serving.get((model, n.gpu), 0) + n.gpus
    assignments: list[NodeAssignment] = []
    unplaced: list[Unplaced] = []
    used: set[str] = set()
    for e in engines:
        node = by_id.get(e.node)
        if node is None:
            unplaced.append(Unplaced(e.model, e.gpu, e.tp, e.dp))
            continue
        used.add(node.session_id)
        if node.state == "join":
            assignments.append(
                NodeAssignment(node.session_id, e.model, e.gpu, e.tp, e.dp, node.gpus)
            )
        elif e.model not in node.models:
            unplaced.append(Unplaced(e.model, e.gpu, e.tp, e.dp))
    idle = tuple(
        n.session_id for n in by_id.values() if n.state == "join" and n.session_id not in used
    )
    return NodePlan(tuple(assignments), serving, tuple(unplaced), idle)
