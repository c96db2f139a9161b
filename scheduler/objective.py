"""The placement problem and its exact analytic cost, shared by every solver and baseline.

Rules:

* A ``Problem`` is an inventory (GPU type -> count), per-model workloads and, for every model, its
  *options*: the (GPU type, TP) replicas that are memory-feasible (C2), shard the model (C3) and
  fit the inventory (``tp <= count``), each with its analytic latency-vs-rate table
  (``analytic.replica_table``). A model with traffic and no option is *unservable* and reported
  with the reason per GPU type; a model without traffic gets nothing.
* The cost of one model's replicas is ``estimate_model``'s: its rate is split over the replicas
  in proportion to capacity, so every replica runs at the same utilisation ``u = served /
  capacity``. A model is *served* up to ``max_utilization`` of its capacity (the analytic model
  reads low near saturation, so we keep headroom): ``served = min(rate, max_utilization *
  capacity)``, the rest is *unserved*. Its latency term is the mean number of its requests in
  the system, ``served * E2E(u)`` (Little's law), so the sum over models divided by the served
  rate is the rate-weighted mean E2E of paper Eq. 1.
* The objective is lexicographic, by ``mode``:

  - ``"latency"`` (paper Eq. 1) and ``"throughput"``: (unserved req/s, requests in system).
    When the inventory can serve every model with headroom the first term is 0 and this is
    Eq. 1; otherwise it is throughput first (served req/s, then latency). The two names differ
    only in what a plan reports.
  - ``"fair"``: (-min served fraction over models, unserved req/s, requests in system): the
    max-min share first.

* Every model with traffic gets at least ``min_replicas`` replicas when the inventory allows it
  (solvers drop the requirement, with a note, when it cannot be met).

This module is pure (no OR-Tools); ``cost`` is what the exact baseline minimises, what the
solver's local search polishes and what a plan reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.analytic import ReplicaTable, replica_table
from scheduler.catalog import Catalog
from scheduler.errors import WorkloadError
from scheduler.placement import Allocation, Placement
from scheduler.replica import ReplicaPerf, ServingConfig, tp_options
from scheduler.roofline import RooflineConfig, check_tp
from scheduler.workload import Workload

MODES = ("latency", "throughput", "fair")
INF = math.inf


@dataclass(frozen=True)
class Option:
    """One replica type a model may use: ``tp`` GPUs of type ``gpu``, and its analytic table."""

    model: str
    gpu: str
    tp: int
    table: ReplicaTable = field(repr=False, compare=False)

    @property
    def capacity_rps(self) -> float:
        return self.table.max_rate_rps

    @property
    def per_gpu_rps(self) -> float:
        return self.table.max_rate_rps / self.tp

    def e2e_at(self, utilization: float) -> float:
        """Mean E2E of one replica at ``utilization`` of its capacity."""
        return self.table.e2e_s(utilization * self.table.max_rate_rps)

    def ttft_at(self, utilization: float) -> float:
        return self.table.ttft_s(utilization * self.table.max_rate_rps)


@dataclass(frozen=True)
class Unservable:
    """A model with traffic that no GPU type of the inventory can hold (reason per type)."""

    model: str
    rate_rps: float
    reasons: tuple[str, ...]

    def message(self) -> str:
        return f"{self.model} cannot be served on this inventory: " + "; ".join(self.reasons)


@dataclass(frozen=True)
class ModelCost:
    """Analytic prediction for one model's replicas (times in seconds, rates in req/s)."""

    model: str
    rate_rps: float
    capacity_rps: float
    served_rps: float
    utilization: float  # served / capacity (inf without replicas)
    in_system: float  # served * E2E: mean requests of this model in the system
    e2e_s: float  # mean over served requests (nan when nothing is served)
    ttft_s: float
    replicas: int

    @property
    def unserved_rps(self) -> float:
        return max(0.0, self.rate_rps - self.served_rps)

    @property
    def fraction(self) -> float:
        """Served fraction of the offered rate (1 without traffic)."""
        return 1.0 if self.rate_rps <= 0 else self.served_rps / self.rate_rps


Key = tuple[float, ...]
Rows = Mapping[str, tuple[int, int]]  # GPU type -> (tp, dp) for one model


@dataclass(frozen=True)
class Cost:
    """A placement's analytic cost: per model, totals and the mode's lexicographic key."""

    models: tuple[ModelCost, ...]
    key: Key
    offered_rps: float
    served_rps: float
    in_system: float
    min_fraction: float

    @property
    def unserved_rps(self) -> float:
        return sum(m.unserved_rps for m in self.models)

    @property
    def e2e_s(self) -> float:
        """Rate-weighted mean E2E over served requests (nan when nothing is served)."""
        return self.in_system / self.served_rps if self.served_rps > 0 else math.nan

    @property
    def ttft_s(self) -> float:
        total = sum(m.ttft_s * m.served_rps for m in self.models if m.served_rps > 0)
        return total / self.served_rps if self.served_rps > 0 else math.nan


class Problem:
    """An instance: inventory, workloads, feasible options and the cost model (module doc)."""

    def __init__(
        self,
        inventory: Mapping[str, int],
        workloads: Iterable[Workload],
        catalog: Catalog,
        *,
        max_utilization: float = 0.9,
        min_replicas: int = 1,
        roofline: RooflineConfig | None = None,
        serving: ServingConfig | None = None,
        table_points: int = 40,
        max_tp: Mapping[str, int] | None = None,
    ) -> None:
        if not 0 < max_utilization <= 0.99:
            raise WorkloadError(f"max_utilization must be in (0, 0.99], got {max_utilization}")
        if min_replicas < 0:
            raise WorkloadError("min_replicas must be zero or more")
        self.catalog = catalog
        self.roofline = roofline
        self.serving = serving
        self.max_utilization = max_utilization
        self.min_replicas = min_replicas
        counts: dict[str, int] = {}
        for name, count in inventory.items():
            gpu = catalog.gpu(name).name
            if count < 0:
                raise WorkloadError(f"inventory: {gpu} count must be zero or more")
            counts[gpu] = counts.get(gpu, 0) + count
        self.inventory: dict[str, int] = {g: n for g, n in counts.items() if n > 0}
        self.gpus: tuple[str, ...] = tuple(self.inventory)
        self.workloads: dict[str, Workload] = {}
        for w in workloads:
            name = catalog.model(w.model).name
            if name in self.workloads:
                raise WorkloadError(f"{name} has two workloads")
            self.workloads[name] = w
        self.rates: dict[str, float] = {m: w.rate_rps for m, w in self.workloads.items()}
        self.options: dict[str, tuple[Option, ...]] = {}
        unservable: list[Unservable] = []
        for name, w in self.workloads.items():
            model = catalog.model(name)
            lengths = w.lengths(model.max_context)
            options: list[Option] = []
            reasons: list[str] = []
            for gpu_name in self.gpus:
                spec = catalog.gpu(gpu_name)
                have = self.inventory[gpu_name]
                # A replica lives in one node: a mesh inventory caps TP at its biggest node.
                cap = None if max_tp is None else max_tp.get(gpu_name)
                tps = tp_options(model, spec, lengths, roofline, serving, max_tp=cap)
                usable = [tp for tp in tps if tp <= have]
                for tp in usable:
                    perf = ReplicaPerf(model, spec, tp, roofline, serving)
                    table = replica_table(perf, lengths, table_points)
                    if table.max_rate_rps > 0:
                        options.append(Option(name, gpu_name, tp, table))
                if not usable:
                    reasons.append(_why_not(model.name, gpu_name, have, tps, catalog, w, self))
            if w.rate_rps <= 0:
                continue
            if options:
                self.options[name] = tuple(options)
            else:
                why = tuple(reasons) or ("the inventory has no GPUs",)
                unservable.append(Unservable(name, w.rate_rps, why))
        self.unservable: tuple[Unservable, ...] = tuple(unservable)
        # the models the solvers place: traffic and at least one option
        self.models: tuple[str, ...] = tuple(self.options)

    # -- cost ---------------------------------------------------------------------------------

    def option(self, model: str, gpu: str, tp: int) -> Option:
        for o in self.options.get(model, ()):
            if o.gpu == gpu and o.tp == tp:
                return o
        raise WorkloadError(f"{model} cannot run on {tp}x{gpu} in this problem")

    def model_cost(self, model: str, rows: Rows) -> ModelCost:
        """The analytic prediction for ``model`` on ``rows`` (GPU type -> (tp, dp))."""
        rate = self.rates.get(model, 0.0)
        groups = [(self.option(model, g, tp), dp) for g, (tp, dp) in rows.items() if dp > 0]
        return self._model_cost(model, rate, groups)

    def _model_cost(
        self, model: str, rate: float, groups: Sequence[tuple[Option, int]]
    ) -> ModelCost:
        capacity = sum(o.capacity_rps * dp for o, dp in groups)
        replicas = sum(dp for _, dp in groups)
        if rate <= 0:
            return ModelCost(model, 0.0, capacity, 0.0, 0.0, 0.0, math.nan, math.nan, replicas)
        if capacity <= 0:
            return ModelCost(model, rate, 0.0, 0.0, INF, 0.0, math.nan, math.nan, replicas)
        served = min(rate, self.max_utilization * capacity)
        u = served / capacity
        in_system = ttft = 0.0
        for o, dp in groups:
            r = o.capacity_rps * u * dp
            in_system += r * o.e2e_at(u)
            ttft += r * o.ttft_at(u)
        return ModelCost(
            model, rate, capacity, served, u, in_system, in_system / served, ttft / served, replicas
        )

    def cost(self, placement: Placement | Mapping[str, Rows], mode: str = "latency") -> Cost:
        """The analytic cost of a placement (models outside the problem are ignored)."""
        rows = placement_rows(placement) if isinstance(placement, Placement) else placement
        models = tuple(self.model_cost(m, rows.get(m, {})) for m in self.models)
        return self.combine(models, mode)

    def combine(self, models: Sequence[ModelCost], mode: str) -> Cost:
        offered = sum(m.rate_rps for m in models)
        served = sum(m.served_rps for m in models)
        in_system = sum(m.in_system for m in models)
        min_fraction = min((m.fraction for m in models), default=1.0)
        return Cost(tuple(models), self.key(models, mode), offered, served, in_system, min_fraction)

    @staticmethod
    def key(models: Sequence[ModelCost], mode: str) -> Key:
        check_mode(mode)
        unserved = sum(m.unserved_rps for m in models)
        in_system = sum(m.in_system for m in models)
        if mode == "fair":
            return (-min((m.fraction for m in models), default=1.0), unserved, in_system)
        return (unserved, in_system)

    def lacks_replicas(self, rows: Mapping[str, Rows]) -> list[str]:
        """Models below ``min_replicas`` replicas."""
        return [
            m
            for m in self.models
            if sum(dp for _, dp in rows.get(m, {}).values()) < self.min_replicas
        ]

    def placement(self, rows: Mapping[str, Rows]) -> Placement:
        return Placement.of(
            Allocation(m, g, tp, dp) for m, r in rows.items() for g, (tp, dp) in r.items()
        )


def _why_not(
    model: str,
    gpu: str,
    have: int,
    tps: Sequence[int],
    catalog: Catalog,
    workload: Workload,
    problem: Problem,
) -> str:
    if tps:
        return f"{gpu}: needs {tps[0]} GPUs per replica, the inventory has {have}"
    spec = catalog.model(model)
    g = catalog.gpu(gpu)
    tp = 1
    while tp * 2 <= g.gpus_per_node:
        tp *= 2
    while tp > 1 and check_tp(spec, tp) is not None:
        tp //= 2
    perf = ReplicaPerf(spec, g, tp, problem.roofline, problem.serving)
    reason = perf.infeasible_reason(workload.lengths(spec.max_context))
    return f"{gpu}: {reason or 'no TP degree shards the model'}"


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise WorkloadError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def placement_rows(placement: Placement) -> dict[str, dict[str, tuple[int, int]]]:
    """model -> GPU type -> (tp, dp); C3 (one TP per model and GPU type) is assumed."""
    rows: dict[str, dict[str, tuple[int, int]]] = {}
    for a in placement.allocations:
        if a.dp <= 0:
            continue
        mine = rows.setdefault(a.model, {})
        if a.gpu in mine:
            raise WorkloadError(f"C3: {a.model} has two rows for {a.gpu}")
        mine[a.gpu] = (a.tp, a.dp)
    return rows


def improves(new: Key, old: Key, rel: float = 1e-9) -> bool:
    """Whether key ``new`` is lexicographically better than ``old`` beyond rounding noise."""
    for a, b in zip(new, old, strict=True):
        tol = rel * (1.0 + abs(b))
        if a < b - tol:
            return True
        if a > b + tol:
            return False
    return False
