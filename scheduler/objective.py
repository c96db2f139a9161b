"""The placement problem and its exact analytic cost, shared by every solver and baseline.

Rules:

* A ``Problem`` is an inventory of pools (``scheduler.inventory``: nodes of one GPU type, shared
  or exclusive), per-model workloads and, for every model, its *options*: the (pool, TP) units
  that are memory-feasible (C2), shard the model (C3) and fit a node (``tp <=`` node size), each
  with the analytic latency-vs-rate table of one replica (``analytic.replica_table``). A unit
  is one replica on a shared pool and one node's engine (``node GPUs // tp`` replicas) on an
  exclusive one; rows count units. A model with traffic and no option is *unservable* and reported
  with the reason per GPU type; a model without traffic gets nothing.
* The cost of one model's replicas is ``estimate_model``'s: its rate is split over the replicas
  in proportion to capacity, so every replica runs at the same utilisation ``u = served /
  capacity``. A model is *served* up to ``max_utilization`` of its capacity (the analytic model
  reads low near saturation, so we keep headroom): ``served = min(rate, max_utilization *
  capacity)``, the rest is *unserved*. Its latency term is the mean number of its requests in
  the system, ``served * E2E(u)`` (Little's law), so the sum over models divided by the served
  rate is the rate-weighted mean E2E of paper Eq. 1.
* The objective is lexicographic, by ``mode``:

  - ``"fair"`` (the default of ``plan``): (-fair level, unserved req/s, requests in system).
    The fair level is the largest ``phi <= 1`` with every model served at least
    ``min(1, priority * phi)`` of its rate, priorities scaled to a maximum of 1
    (``fair_level``): under overload the max-min share first, weighted by priority; when
    everything fits it is 1 and this is Eq. 1.
  - ``"latency"`` (paper Eq. 1) and ``"throughput"``: (unserved req/s, requests in system).
    When the inventory can serve every model with headroom the first term is 0 and this is
    Eq. 1; otherwise it is throughput first (served req/s, then latency), which favours the
    models with the cheapest requests. The two names differ only in what a plan reports.

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
from scheduler.inventory import Inventory, NodeGroup, Pool
from scheduler.placement import Allocation, Placement
from scheduler.replica import ReplicaPerf, ServingConfig, tp_options
from scheduler.roofline import RooflineConfig, check_tp
from scheduler.workload import Workload

MODES = ("latency", "throughput", "fair")
INF = math.inf


@dataclass(frozen=True)
class Option:
    """One placement unit a model may use in pool ``gpu``: replicas of ``tp`` GPUs, and the
    analytic table of one replica. A unit is one replica on a shared pool, one node's engine
    (``replicas`` = node GPUs // tp replicas) on an exclusive one; it takes ``gpus`` GPUs."""

    model: str
    gpu: str  # pool name (the GPU type's name unless the inventory has several node shapes)
    tp: int
    table: ReplicaTable = field(repr=False, compare=False)
    gpus: int = 0  # GPUs one unit takes (default tp)
    replicas: int = 1  # replicas in one unit

    def __post_init__(self) -> None:
        if self.gpus == 0:
            object.__setattr__(self, "gpus", self.tp)

    @property
    def replica_capacity_rps(self) -> float:
        return self.table.max_rate_rps

    @property
    def capacity_rps(self) -> float:
        """Capacity of one unit."""
        return self.table.max_rate_rps * self.replicas

    @property
    def per_gpu_rps(self) -> float:
        return self.capacity_rps / self.gpus

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
        inventory: Inventory | Mapping[str, int] | Iterable[NodeGroup],
        workloads: Iterable[Workload],
        catalog: Catalog,
        *,
        max_utilization: float = 0.9,
        min_replicas: int = 1,
        roofline: RooflineConfig | None = None,
        serving: ServingConfig | None = None,
        table_points: int = 40,
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
        self.nodes = Inventory.of(inventory, catalog)
        self.pools: dict[str, Pool] = self.nodes.pools
        # pool name -> GPUs; the solvers' "GPU types" are these pools
        self.inventory: dict[str, int] = self.nodes.counts()
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
        tables: dict[tuple[str, str, int], ReplicaTable] = {}
        for name, w in self.workloads.items():
            model = catalog.model(name)
            lengths = w.lengths(model.max_context)
            options: list[Option] = []
            reasons: list[str] = []
            for pool in self.pools.values():
                spec = catalog.gpu(pool.gpu)
                # a replica lives in one node
                tps = tp_options(model, spec, lengths, roofline, serving, max_tp=pool.node_gpus)
                for tp in tps:
                    table = tables.get((name, pool.gpu, tp))
                    if table is None:
                        perf = ReplicaPerf(model, spec, tp, roofline, serving)
                        table = replica_table(perf, lengths, table_points)
                        tables[(name, pool.gpu, tp)] = table
                    if table.max_rate_rps > 0:
                        options.append(
                            Option(
                                name,
                                pool.name,
                                tp,
                                table,
                                pool.unit_gpus(tp),
                                pool.replicas_per_unit(tp),
                            )
                        )
                if not tps:
                    reasons.append(_why_not(model.name, pool, catalog, w, self))
            if w.rate_rps <= 0:
                continue
            if options:
                self.options[name] = tuple(options)
            else:
                why = tuple(dict.fromkeys(reasons)) or ("the inventory has no GPUs",)
                unservable.append(Unservable(name, w.rate_rps, why))
        self.unservable: tuple[Unservable, ...] = tuple(unservable)
        # Priorities scaled so the highest is 1: a model's fair share is its priority times
        # the common level (``key``).
        top = max((self.workloads[m].priority for m in self.options), default=1.0)
        self.priority: dict[str, float] = {
            m: self.workloads[m].priority / top for m in self.options
        }
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
        replicas = sum(dp * o.replicas for o, dp in groups)
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
        rows = self.rows_of(placement) if isinstance(placement, Placement) else placement
        models = tuple(self.model_cost(m, rows.get(m, {})) for m in self.models)
        return self.combine(models, mode)

    def combine(self, models: Sequence[ModelCost], mode: str) -> Cost:
        offered = sum(m.rate_rps for m in models)
        served = sum(m.served_rps for m in models)
        in_system = sum(m.in_system for m in models)
        min_fraction = min((m.fraction for m in models), default=1.0)
        return Cost(tuple(models), self.key(models, mode), offered, served, in_system, min_fraction)

    def key(self, models: Sequence[ModelCost], mode: str) -> Key:
        check_mode(mode)
        unserved = sum(m.unserved_rps for m in models)
        in_system = sum(m.in_system for m in models)
        if mode == "fair":
            return (-self.fair_level(models), unserved, in_system)
        return (unserved, in_system)

    def fair_level(self, models: Sequence[ModelCost]) -> float:
        """The weighted max-min level: the largest ``phi <= 1`` with every model served at
        least ``min(1, priority * phi)`` of its rate (priorities scaled to a maximum of 1)."""
        level = 1.0
        for m in models:
            if m.rate_rps > 0 and m.fraction < 1.0:
                level = min(level, m.fraction / self.priority.get(m.model, 1.0))
        return level

    def lacks_replicas(self, rows: Mapping[str, Rows]) -> list[str]:
        """Models below ``min_replicas`` replicas."""
        return [
            m
            for m in self.models
            if sum(dp for _, dp in rows.get(m, {}).values()) < self.min_replicas
        ]

    def placement(self, rows: Mapping[str, Rows]) -> Placement:
        """Rows (pool -> (tp, units)) as allocations of replicas on catalog GPU types."""
        out: list[Allocation] = []
        for m, r in rows.items():
            for g, (tp, units) in r.items():
                pool = self.pools[g]
                out.append(Allocation(m, pool.gpu, tp, units * pool.replicas_per_unit(tp), g))
        return Placement.of(out)

    def rows_of(self, placement: Placement) -> dict[str, dict[str, tuple[int, int]]]:
        """The inverse of ``placement``: model -> pool -> (tp, units); C3 (one TP per model and
        pool) is assumed."""
        rows: dict[str, dict[str, tuple[int, int]]] = {}
        for a in placement.allocations:
            if a.dp <= 0:
                continue
            name = a.pool or a.gpu
            pool = self.pools.get(name)
            if pool is None:
                raise WorkloadError(f"{a.model}: no pool {name!r} in this inventory")
            mine = rows.setdefault(a.model, {})
            if name in mine:
                raise WorkloadError(f"C3: {a.model} has two rows for {name}")
            per = pool.replicas_per_unit(a.tp)
            mine[name] = (a.tp, -(-a.dp // per))
        return rows

    def unit_gpus(self, pool: str, tp: int) -> int:
        return self.pools[pool].unit_gpus(tp)


def _why_not(model: str, pool: Pool, catalog: Catalog, workload: Workload, problem: Problem) -> str:
    spec = catalog.model(model)
    g = catalog.gpu(pool.gpu)
    limit = min(g.gpus_per_node, pool.node_gpus)
    tp = 1
    while tp * 2 <= limit:
        tp *= 2
    while tp > 1 and check_tp(spec, tp) is not None:
        tp //= 2
    perf = ReplicaPerf(spec, g, tp, problem.roofline, problem.serving)
    reason = perf.infeasible_reason(workload.lengths(spec.max_context))
    where = pool.gpu if pool.name == pool.gpu else f"{pool.name} ({pool.node_gpus}-GPU nodes)"
    if reason and tp < g.gpus_per_node and tp == pool.node_gpus:
        plural = "s" if pool.node_gpus > 1 else ""
        reason += f" (a replica cannot span nodes of {pool.node_gpus} GPU{plural})"
    return f"{where}: {reason or 'no TP degree shards the model'}"


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise WorkloadError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def improves(new: Key, old: Key, rel: float = 1e-9) -> bool:
    """Whether key ``new`` is lexicographically better than ``old`` beyond rounding noise."""
    for a, b in zip(new, old, strict=True):
        tol = rel * (1.0 + abs(b))
        if a < b - tol:
            return True
        if a > b + tol:
            return False
    return False
