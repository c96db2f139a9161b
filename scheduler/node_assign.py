"""From a placement over GPU pools to one engine per node: what ``fabric plan --apply`` sends.

The solver places replicas on pools of GPUs by type; the mesh is made of nodes (one agent per
Slurm job), each with some GPUs of one type, each running at most one engine. This module maps
one onto the other:

1. GPUs of SERVING nodes already serving a model count as placed for it (apply never touches a
   running engine), so only the rest of each (model, GPU type) allocation is assigned.
2. The remaining replicas of each (model, GPU type) go to JOIN nodes of that type, largest TP
   first; the node that holds all remaining replicas with the fewest GPUs wins (best fit), else
   the biggest node. A node with fewer GPUs than the TP cannot host it. A node runs one model
   with ``dp = node GPUs // tp``: spare GPUs add replicas of its model (they would idle
   otherwise), so a model can get more replicas than the plan gave it, never fewer.
3. Replicas still without a node (the pools did not divide into nodes) are *substituted* when
   ``smallest_tp`` is given: each goes to the biggest JOIN node left, of any GPU type, that can
   hold the model, with the smallest TP that fits there. What still cannot be placed is
   reported, as are JOIN nodes that get nothing and GPUs a node's one engine leaves idle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class MeshNode:
    session_id: str
    gpu: str  # catalog GPU type
    gpus: int
    state: str  # "join" or "serving"
    models: tuple[str, ...] = ()  # catalog model ids it serves


@dataclass(frozen=True)
class PoolAllocation:
    model: str
    gpu: str
    tp: int
    dp: int


@dataclass(frozen=True)
class NodeAssignment:
    session_id: str
    model: str
    gpu: str
    tp: int
    dp: int
    node_gpus: int
    substitute: bool = False  # not the plan's GPU type or TP: placed where a node was left

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
                    "substitute": a.substitute,
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


def assign_nodes(
    allocations: Iterable[PoolAllocation],
    nodes: Iterable[MeshNode],
    smallest_tp: Callable[[str, str, int], int | None] | None = None,
) -> NodePlan:
    """Map pool allocations to JOIN nodes (see the module docstring).

    ``smallest_tp(model, gpu, node_gpus)``: the smallest memory-feasible TP for the model on a
    node of that GPU type and size, or None; enables substitution (step 3).
    """
    nodes = list(nodes)
    serving: dict[tuple[str, str], int] = {}
    for n in nodes:
        if n.state == "serving":
            for model in n.models:
                serving[(model, n.gpu)] = serving.get((model, n.gpu), 0) + n.gpus
    free = sorted(
        (n for n in nodes if n.state == "join" and n.gpus > 0),
        key=lambda n: (n.gpu, n.gpus, n.session_id),
    )
    demands: list[tuple[PoolAllocation, int]] = []
    for a in allocations:
        wanted = a.tp * a.dp - serving.get((a.model, a.gpu), 0)
        if wanted > 0:
            demands.append((a, math.ceil(wanted / a.tp)))
    demands.sort(key=lambda d: (-d[0].tp, -d[1], d[0].model, d[0].gpu))
    assignments: list[NodeAssignment] = []
    unplaced: list[Unplaced] = []
    for a, replicas in demands:
        while replicas > 0:
            hosts = [n for n in free if n.gpu == a.gpu and n.gpus >= a.tp]
            if not hosts:
                unplaced.append(Unplaced(a.model, a.gpu, a.tp, replicas))
                break
            whole = [n for n in hosts if n.gpus // a.tp >= replicas]
            node = whole[0] if whole else hosts[-1]  # free is sorted by GPU count
            dp = node.gpus // a.tp
            assignments.append(NodeAssignment(node.session_id, a.model, a.gpu, a.tp, dp, node.gpus))
            free.remove(node)
            replicas -= dp
    if smallest_tp is not None:
        unplaced = _substitute(unplaced, free, assignments, smallest_tp)
    return NodePlan(
        tuple(assignments),
        serving,
        tuple(unplaced),
        tuple(n.session_id for n in free),
    )


def _substitute(
    unplaced: list[Unplaced],
    free: list[MeshNode],
    assignments: list[NodeAssignment],
    smallest_tp: Callable[[str, str, int], int | None],
) -> list[Unplaced]:
    left: list[Unplaced] = []
    for u in unplaced:
        replicas = u.replicas
        while replicas > 0:
            fits = [(n, smallest_tp(u.model, n.gpu, n.gpus)) for n in free]
            hosts = [(n, tp) for n, tp in fits if tp is not None]
            if not hosts:
                left.append(Unplaced(u.model, u.gpu, u.tp, replicas))
                break
            node, tp = max(hosts, key=lambda h: (h[0].gpus, h[0].session_id))
            assert tp is not None
            dp = node.gpus // tp
            assignments.append(
                NodeAssignment(node.session_id, u.model, node.gpu, tp, dp, node.gpus, True)
            )
            free.remove(node)
            replicas -= dp
    return left
