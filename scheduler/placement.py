"""A placement: for each model, how many GPUs of each type, as ``dp`` replicas of ``tp`` GPUs.

This is the decision of the paper's Eq. 1 (allocation matrix A and parallelism P): one
``Allocation`` per (model, GPU type) with ``a = tp * dp`` (C3). ``check_placement`` enforces C1
(capacity per GPU type), C3 (``tp`` shards the model; one row per pair) and, given workloads, C2
(every replica is memory-feasible).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.catalog import Catalog
from scheduler.errors import CatalogError, WorkloadError
from scheduler.replica import ReplicaPerf, ServingConfig
from scheduler.roofline import RooflineConfig, check_tp
from scheduler.workload import Workload


@dataclass(frozen=True)
class Allocation:
    """``dp`` replicas of ``model``, each on ``tp`` GPUs of type ``gpu`` (catalog names), in the
    inventory's pool ``pool`` (default: the pool named after the GPU type)."""

    model: str
    gpu: str
    tp: int
    dp: int
    pool: str = ""

    @property
    def where(self) -> str:
        return self.pool or self.gpu

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class Placement:
    allocations: tuple[Allocation, ...]

    @staticmethod
    def of(allocations: Iterable[Allocation]) -> Placement:
        """A placement without empty rows, in a canonical order."""
        rows = sorted((a for a in allocations if a.dp > 0), key=lambda a: (a.model, a.where))
        return Placement(tuple(rows))

    def gpus_used(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for a in self.allocations:
            used[a.gpu] = used.get(a.gpu, 0) + a.gpus
        return used

    def for_model(self, model: str) -> list[Allocation]:
        return [a for a in self.allocations if a.model == model]


def check_placement(
    placement: Placement,
    inventory: Mapping[str, int],
    catalog: Catalog,
    workloads: Iterable[Workload] = (),
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
) -> None:
    """Raise ``WorkloadError`` naming the first violated constraint (C1, C2 or C3).

    ``inventory`` is GPUs per pool (``Allocation.where``; a GPU type, an alias of one, or a
    pool name of ``scheduler.inventory``). Node shape (exclusive nodes, TP within a node) is
    ``objective.Problem``'s to check."""
    used: dict[str, int] = {}
    rows: dict[str, list[Allocation]] = {}
    for a in placement.allocations:
        try:
            model = catalog.model(a.model)
            gpu = catalog.gpu(a.gpu)
        except CatalogError as exc:
            raise WorkloadError(str(exc)) from None
        if any(
            _pool(catalog, b.where) == _pool(catalog, a.where) for b in rows.get(model.name, [])
        ):
            raise WorkloadError(f"C3: {model.name} has two rows for {a.where}")
        rows.setdefault(model.name, []).append(a)
        if a.dp < 0:
            raise WorkloadError(f"C3: {model.name} on {gpu.name}: dp must be >= 0")
        problem = check_tp(model, a.tp)
        if problem:
            raise WorkloadError(f"C3: {problem}")
        if a.tp > gpu.gpus_per_node:
            raise WorkloadError(
                f"C3: {model.name} on {gpu.name}: tp {a.tp} exceeds {gpu.gpus_per_node} GPUs "
                "per node"
            )
        where = _pool(catalog, a.where)
        used[where] = used.get(where, 0) + a.gpus
    have = {_pool(catalog, name): count for name, count in inventory.items()}
    for name, count in used.items():
        if count > have.get(name, 0):
            raise WorkloadError(f"C1: {count} {name} GPUs allocated, {have.get(name, 0)} available")
    for w in workloads:
        model = catalog.model(w.model)
        lengths = w.lengths(model.max_context)
        for a in rows.get(model.name, []):
            if a.dp == 0:
                continue
            perf = ReplicaPerf(model, catalog.gpu(a.gpu), a.tp, roofline, serving)
            problem = perf.infeasible_reason(lengths)
            if problem:
                raise WorkloadError(f"C2: {problem}")


def _pool(catalog: Catalog, name: str) -> str:
    """A GPU type's catalog name, or a pool name as it is."""
    try:
        return catalog.gpu(name).name
    except CatalogError:
        return name
