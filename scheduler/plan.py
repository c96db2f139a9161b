"""``plan``: the placement a ``fabric plan`` prints, with its prediction and memP's for comparison.

One call builds the problem (analytic tables for every feasible (model, GPU type, TP)), solves
it (CP-SAT by default; ``solver="exact"`` for the DP optimum on small instances, ``"greedy"`` for
greedy + local search without OR-Tools), checks C1-C3 on the result, and predicts it and the
memP baseline with the same analytic model. ``PlanResult.to_json()`` is ``fabric plan --json``'s
shape (docs/admin-guide.md):
``{"allocations": [{"model", "gpu", "gpus", "tp", "dp"}], "predicted": {...}, "memp": {...}}``
plus ``mode``, ``notes``, ``unservable`` and ``solver``. Non-finite numbers become ``null``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from scheduler.baselines import exact, memp
from scheduler.catalog import Catalog, builtin_catalog
from scheduler.errors import SchedulerError
from scheduler.inventory import Inventory, NodeGroup
from scheduler.objective import Cost, Problem, Unservable, check_mode
from scheduler.placement import Placement, check_placement
from scheduler.realise import Layout, realise
from scheduler.replica import ServingConfig
from scheduler.roofline import RooflineConfig
from scheduler.search import greedy, local_search
from scheduler.solver import PhaseStats, Progress, solve
from scheduler.workload import Workload

SOLVERS = ("cpsat", "exact", "greedy")


@dataclass(frozen=True)
class ModelPrediction:
    """Analytic prediction for one model (rates in req/s, times in seconds)."""

    model: str
    gpus: int
    replicas: int
    rate_rps: float
    capacity_rps: float
    served_rps: float
    utilization: float
    e2e_s: float  # mean over served requests; nan when nothing is served
    ttft_s: float

    @property
    def overloaded(self) -> bool:
        """Part of the traffic is not served: that queue grows without bound."""
        return self.served_rps < self.rate_rps * (1 - 1e-9)


@dataclass(frozen=True)
class Prediction:
    models: tuple[ModelPrediction, ...]
    offered_rps: float
    served_rps: float  # predicted throughput
    min_fraction: float  # smallest served share of a model's rate
    e2e_s: float  # rate-weighted mean E2E over served requests
    ttft_s: float

    @staticmethod
    def of(cost: Cost, placement: Placement, unservable: Iterable[Unservable] = ()) -> Prediction:
        """The prediction of a placement; unservable models count as offered, never served."""
        rows = []
        for m in cost.models:
            mine = placement.for_model(m.model)
            rows.append(
                ModelPrediction(
                    m.model,
                    sum(a.gpus for a in mine),
                    m.replicas,
                    m.rate_rps,
                    m.capacity_rps,
                    m.served_rps,
                    m.utilization,
                    m.e2e_s,
                    m.ttft_s,
                )
            )
        lost = list(unservable)
        for u in lost:
            rows.append(
                ModelPrediction(u.model, 0, 0, u.rate_rps, 0.0, 0.0, math.inf, math.nan, math.nan)
            )
        return Prediction(
            tuple(rows),
            cost.offered_rps + sum(u.rate_rps for u in lost),
            cost.served_rps,
            0.0 if lost else cost.min_fraction,
            cost.e2e_s,
            cost.ttft_s,
        )

    def to_json(self) -> dict[str, object]:
        return {
            "offered_rps": _num(self.offered_rps),
            "throughput_rps": _num(self.served_rps),
            "served_fraction": _num(
                self.served_rps / self.offered_rps if self.offered_rps else 1.0
            ),
            "min_fraction": _num(self.min_fraction),
            "e2e_s": _num(self.e2e_s),
            "ttft_s": _num(self.ttft_s),
            "models": [
                {
                    "model": m.model,
                    "gpus": m.gpus,
                    "replicas": m.replicas,
                    "rate_rps": _num(m.rate_rps),
                    "capacity_rps": _num(m.capacity_rps),
                    "throughput_rps": _num(m.served_rps),
                    "utilization": _num(m.utilization),
                    "e2e_s": _num(m.e2e_s),
                    "ttft_s": _num(m.ttft_s),
                    "overloaded": m.overloaded,
                }
                for m in self.models
            ],
        }


@dataclass(frozen=True)
class SolverInfo:
    name: str  # "cpsat", "exact" or "greedy"
    seconds: float  # solving, after the tables were built
    tables_s: float  # building the analytic tables
    proven_optimal: bool  # exact, or every CP-SAT level proved optimal (linearised model)
    phases: tuple[PhaseStats, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 3),
            "tables_s": round(self.tables_s, 3),
            "proven_optimal": self.proven_optimal,
            "phases": [
                {
                    "phase": p.phase,
                    "status": p.status,
                    "seconds": round(p.seconds, 3),
                    "objective": _num(p.objective),
                    "bound": _num(p.bound),
                }
                for p in self.phases
            ],
        }


@dataclass(frozen=True)
class PlanResult:
    mode: str
    inventory: Mapping[str, int]  # pool -> GPUs
    placement: Placement  # realised on nodes (``layout``)
    predicted: Prediction
    memp: Placement
    memp_predicted: Prediction
    unservable: tuple[Unservable, ...]
    notes: tuple[str, ...]
    solver: SolverInfo
    layout: Layout | None = None
    pools: tuple[dict[str, object], ...] = ()
    overload: str | None = None  # one line when the inventory cannot serve every rate

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "inventory": dict(self.inventory),
            "pools": list(self.pools),
            "allocations": allocations_json(self.placement, self.layout),
            "nodes": [] if self.layout is None else [e.to_json() for e in self.layout.engines],
            "overload": self.overload,
            "predicted": self.predicted.to_json(),
            "memp": {
                "allocations": allocations_json(self.memp),
                "predicted": self.memp_predicted.to_json(),
            },
            "unservable": [
                {"model": u.model, "rate_rps": _num(u.rate_rps), "reasons": list(u.reasons)}
                for u in self.unservable
            ],
            "notes": list(self.notes),
            "solver": self.solver.to_json(),
        }


def allocations_json(placement: Placement, layout: Layout | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for a in placement.allocations:
        row: dict[str, object] = {
            "model": a.model, "gpu": a.gpu, "pool": a.where, "gpus": a.gpus, "tp": a.tp,
            "dp": a.dp,
        }  # fmt: skip
        if layout is not None:
            row["nodes"] = layout.nodes_of(a.model, a.where)
        rows.append(row)
    return rows


def _num(value: float) -> float | None:
    return value if math.isfinite(value) else None


def plan(
    inventory: Inventory | Mapping[str, int] | Iterable[NodeGroup],
    workloads: Iterable[Workload],
    *,
    catalog: Catalog | None = None,
    mode: str = "fair",
    solver: str = "cpsat",
    time_limit_s: float = 10.0,
    num_workers: int | None = None,
    max_utilization: float = 0.9,
    min_replicas: int = 1,
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
    seed: int = 0,
    progress: Callable[[Progress], None] | None = None,
) -> PlanResult:
    """Place ``workloads`` on ``inventory`` (GPU type -> count, or node groups; see
    ``scheduler.inventory``); see the module docstring.

    Raises ``WorkloadError``/``CatalogError`` for bad input and ``SchedulerError`` when the
    chosen solver is unavailable (OR-Tools or numpy missing) or intractable (``exact``)."""
    catalog = catalog or builtin_catalog()
    started = time.monotonic()
    problem = Problem(
        inventory,
        workloads,
        catalog,
        max_utilization=max_utilization,
        min_replicas=min_replicas,
        roofline=roofline,
        serving=serving,
    )
    return plan_problem(
        problem,
        mode=mode,
        solver=solver,
        time_limit_s=time_limit_s,
        num_workers=num_workers,
        seed=seed,
        progress=progress,
        tables_s=time.monotonic() - started,
    )


def plan_problem(
    problem: Problem,
    *,
    mode: str = "fair",
    solver: str = "cpsat",
    time_limit_s: float = 10.0,
    num_workers: int | None = None,
    seed: int = 0,
    progress: Callable[[Progress], None] | None = None,
    tables_s: float = 0.0,
) -> PlanResult:
    """``plan`` on an already built ``Problem`` (its tables are reused)."""
    check_mode(mode)
    if solver not in SOLVERS:
        raise SchedulerError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    notes: list[str] = [u.message() for u in problem.unservable]
    for name, w in problem.workloads.items():
        if w.rate_rps <= 0:
            notes.append(f"{name} has no traffic: it gets no GPUs")
    t0 = time.monotonic()
    phases: tuple[PhaseStats, ...] = ()
    if solver == "cpsat":
        solution = solve(
            problem,
            mode,
            time_limit_s=time_limit_s,
            num_workers=num_workers,
            seed=seed,
            progress=progress,
        )
        pooled = solution.placement
        notes += solution.notes
        phases = solution.phases
        optimal = solution.proven_optimal
    elif solver == "exact":
        result = exact(problem, mode)
        pooled = result.placement
        notes += result.notes
        optimal = True
    else:
        deadline = t0 + time_limit_s
        rows, _ = local_search(problem, greedy(problem, mode), mode, deadline)
        pooled = problem.placement(rows)
        optimal = False
        missing = problem.lacks_replicas(rows)
        if missing and problem.min_replicas > 0:
            notes.append(
                f"no replica for {', '.join(missing)}: the inventory cannot give every model "
                f"{problem.min_replicas} replica(s)"
            )
    seconds = time.monotonic() - t0
    layout = realise(problem, problem.rows_of(pooled))
    notes += layout.notes
    placement = problem.placement(layout.rows)
    cost = problem.cost(placement, mode)
    check_placement(
        placement,
        problem.inventory,
        problem.catalog,
        problem.workloads.values(),
        problem.roofline,
        problem.serving,
    )
    overload = overload_line(cost, problem) if cost.unserved_rps > 1e-9 else None
    for pool, count in problem.inventory.items():
        whole = not problem.pools[pool].shared  # an exclusive node is taken whole
        idle = count - sum(
            e.node_gpus if whole else e.gpus for e in layout.engines if e.pool == pool
        )
        if idle > 0:
            notes.append(f"{idle} of {count} {pool} left idle")
    for e in layout.engines:
        if e.gpus < e.node_gpus and not problem.pools[e.pool].shared:
            notes.append(
                f"{e.node}: {e.model} at TP {e.tp} leaves {e.node_gpus - e.gpus} of its "
                f"{e.node_gpus} GPUs idle"
            )
    base = memp(problem)
    return PlanResult(
        mode=mode,
        inventory=dict(problem.inventory),
        placement=placement,
        predicted=Prediction.of(cost, placement, problem.unservable),
        memp=base,
        memp_predicted=Prediction.of(problem.cost(base, mode), base, problem.unservable),
        unservable=problem.unservable,
        notes=tuple(notes),
        solver=SolverInfo(solver, seconds, tables_s, optimal, phases),
        layout=layout,
        pools=tuple(problem.nodes.to_json()),
        overload=overload,
    )


def overload_line(cost: Cost, problem: Problem) -> str:
    """One line: how far the plan falls short of the offered rates, per model."""
    parts = []
    for m in cost.models:
        if m.unserved_rps > 1e-9:
            parts.append(f"{m.model} {m.fraction:.0%} ({m.unserved_rps:.1f} req/s short)")
        else:
            parts.append(f"{m.model} 100%")
    return (
        f"overloaded: the inventory serves {cost.served_rps:.1f} of {cost.offered_rps:.1f} "
        f"req/s below {problem.max_utilization:.0%} utilisation; served share " + ", ".join(parts)
    )
