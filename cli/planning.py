"""``fabric plan``: inventory and workload from files or the live mesh, the placement, ``--apply``.

The typer command lives in ``cli.plan_cmd``; this module does the work it needs besides solving:

* inventory from the mesh: alive JOIN and SERVING nodes, GPU types resolved in the catalog;
* workload from the mesh: every alive agent's request log over the last ``window`` seconds
  (``GET /fabric/v1/workload`` returns mergeable sums), merged into per-model rates;
* apply: the plan's engines on the mesh's nodes become assignments (``scheduler.node_assign``),
  sign one assignment per JOIN
  node with the operator key, hand them to the agent, and follow the targets until each serves,
  fails, or the wait runs out.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError, ConfigError
from fabricnode.mesh.assignment import AssignmentBody, SignedAssignment
from fabricnode.mesh.identity import OperatorKey
from fabricnode.mesh.schema import PLAN_LABEL, PLAN_STATUS_LABEL
from fabricnode.requestlog.sums import merge_workload_sums
from scheduler.catalog import Catalog, is_local_path
from scheduler.errors import CatalogError, WorkloadError
from scheduler.inventory import NodeGroup
from scheduler.node_assign import MeshNode, NodeAssignment, NodePlan
from scheduler.workload import Workload

Json = dict[str, Any]

# Terminal outcomes of an assignment as its target's entry shows them.
SERVING = "serving"
FAILED = "failed"
REFUSED = "refused"
GONE = "gone"
TERMINAL = (SERVING, FAILED, REFUSED, GONE)


@dataclass(frozen=True)
class MeshView:
    inventory: dict[str, int]
    nodes: tuple[MeshNode, ...]
    notes: tuple[str, ...]

    @property
    def groups(self) -> list[NodeGroup]:
        """The mesh as the planner's inventory: every agent one exclusive node (it runs one
        engine), named by its session id, with the model it serves."""
        return [
            NodeGroup(
                n.gpu, 1, n.gpus, names=(n.session_id,), serving=(n.models[0] if n.models else "",)
            )
            for n in self.nodes
        ]


def mesh_view(nodes: Iterable[Json], catalog: Catalog) -> MeshView:
    """Inventory and plannable nodes from ``/fabric/v1/nodes`` rows (alive JOIN/SERVING)."""
    inventory: dict[str, int] = {}
    plannable: list[MeshNode] = []
    notes: list[str] = []
    unknown_types: dict[str, int] = {}
    outside = 0
    for n in nodes:
        if n.get("liveness") != "alive" or n.get("state") not in ("join", "serving"):
            continue
        hw = n.get("hardware") or {}
        count = int(hw.get("gpu_count") or 0)
        if count <= 0:
            continue
        try:
            gpu = catalog.gpu(str(hw.get("gpu_type") or "")).name
        except CatalogError:
            name = str(hw.get("gpu_type") or "?")
            unknown_types[name] = unknown_types.get(name, 0) + count
            continue
        models: list[str] = []
        if n["state"] == "serving":
            try:
                models = [catalog.model(str(m["id"])).name for m in n.get("models", [])]
            except CatalogError as exc:
                outside += count  # its GPUs are taken by a model the planner does not know
                if any(_on_disk(str(m["id"])) for m in n.get("models", [])):
                    notes.append(f"{count} GPUs left out: {exc}")  # e.g. a broken config.json
                continue
        inventory[gpu] = inventory.get(gpu, 0) + count
        plannable.append(MeshNode(str(n["session_id"]), gpu, count, n["state"], tuple(models)))
    for name, count in sorted(unknown_types.items()):
        notes.append(f"{count} GPUs of type {name!r} left out: not in the catalog (--catalog FILE)")
    if outside:
        notes.append(f"{outside} GPUs left out: their nodes serve models not in the catalog")
    return MeshView(inventory, tuple(plannable), tuple(notes))


def _on_disk(model: str) -> bool:
    """A served model id that is a path here: its catalog error (a broken config.json) is worth
    showing as it is."""
    return is_local_path(model) and os.path.exists(os.path.expanduser(model))


def mesh_workloads(
    nodes: Iterable[Json],
    window_s: float,
    catalog: Catalog,
    *,
    client_for: Callable[[str], AdminClient] = AdminClient,
) -> tuple[list[Workload], list[str]]:
    """Per-model workload from the request logs of every alive agent (see module doc)."""
    parts: list[dict[str, dict[str, float]]] = []
    notes: list[str] = []
    asked = 0
    for n in nodes:
        url = (n.get("addresses") or {}).get("http")
        if n.get("liveness") != "alive" or n.get("state") == "left" or not url:
            continue
        asked += 1
        try:
            with client_for(url) as client:
                doc = client.workload(window_s)
        except AgentApiError as exc:
            notes.append(f"no request log from {str(n['session_id'])[:12]}: {exc}")
            continue
        models = doc.get("models")
        if isinstance(models, dict):
            parts.append(models)
    summary = merge_workload_sums(parts, window_s)
    workloads: list[Workload] = []
    merged: dict[str, dict[str, float]] = {}
    for served, row in summary.items():
        try:
            name = catalog.model(served).name
        except CatalogError as exc:
            why = str(exc) if _on_disk(served) else "not in the catalog (--catalog FILE)"
            notes.append(f"traffic for {served!r} left out: {why}")
            continue
        if name in merged:  # two served names of one catalog model: add their traffic
            prev = merged[name]
            total = prev["rate"] + row["rate"]
            for key in ("input_mean", "output_mean", "input_std", "output_std"):
                prev[key] = (prev[key] * prev["rate"] + row[key] * row["rate"]) / total
            prev["rate"] = total
        else:
            merged[name] = dict(row)
    for name, row in sorted(merged.items()):
        if row["input_mean"] < 1 or row["output_mean"] < 1:
            notes.append(f"{name}: no token counts in the request logs; assuming 1 token each")
        workloads.append(
            Workload(
                name,
                row["rate"],
                max(1.0, row["input_mean"]),
                max(1.0, row["output_mean"]),
                row["input_std"],
                row["output_std"],
            )
        )
    if not workloads:
        why = "".join(f"; {n}" for n in notes if n.startswith("traffic for"))
        raise WorkloadError(
            f"no workload: the request logs of {asked} agents hold no request for a catalog "
            f"model in the last {window_s:g} s; pass --workload FILE or a longer --window{why}"
        )
    return workloads, notes


def new_plan_id() -> str:
    return time.strftime("%m%d%H%M") + "-" + secrets.token_hex(2)


def sign_assignments(
    node_plan: NodePlan, key: OperatorKey, plan_id: str, now: float, ttl_s: float
) -> list[SignedAssignment]:
    return [
        AssignmentBody(
            target=a.session_id,
            plan_id=plan_id,
            issued_at=now,
            expires_at=now + ttl_s,
            model=a.model,
            tp=a.tp,
            dp=a.dp,
            operator_key=key.public_key,
        ).sign(key)
        for a in node_plan.assignments
    ]


def target_status(entry: Json | None, plan_id: str) -> str:
    """Where one target is with ``plan_id``, from its registry entry."""
    if entry is None or entry.get("state") == "left":
        return GONE
    labels = entry.get("labels") or {}
    if labels.get(PLAN_LABEL) != plan_id:
        return "pending"
    status = str(labels.get(PLAN_STATUS_LABEL, ""))
    if entry.get("state") == "serving":
        return SERVING
    if entry.get("state") == "down" or entry.get("liveness") == "dead":
        return FAILED
    if status and status != "launching":
        return f"{REFUSED}: {status}"
    return "launching"


def is_terminal(status: str) -> bool:
    return status.split(":", 1)[0] in TERMINAL


def follow(
    client: AdminClient,
    targets: Iterable[NodeAssignment],
    plan_id: str,
    *,
    timeout_s: float,
    poll_s: float = 0.5,
    on_change: Callable[[str, str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Poll the registry until every target is terminal or ``timeout_s`` passed."""
    wanted = [t.session_id for t in targets]
    status = dict.fromkeys(wanted, "pending")
    deadline = clock() + timeout_s
    while True:
        by_id = {n["session_id"]: n for n in client.nodes()}
        for sid in wanted:
            now_status = target_status(by_id.get(sid), plan_id)
            if now_status != status[sid]:
                status[sid] = now_status
                if on_change is not None:
                    on_change(sid, now_status)
        if all(is_terminal(s) for s in status.values()) or clock() >= deadline:
            return status
        sleep(poll_s)


def check_window(window_s: float) -> float:
    if not 0 < window_s <= 366 * 86400:
        raise ConfigError(f"--window {window_s:g}: expected seconds, more than 0")
    return window_s
