"""The GPU inventory as nodes: how many nodes of each GPU type and size, and how they may be split.

An agent runs one engine on one node (one Slurm job), so where a replica can go depends on the
node it lands on, not only on its GPU type. Rules:

* A ``NodeGroup`` is ``nodes`` nodes of ``gpus`` GPUs of one catalog type. It is *exclusive* by
  default: a node runs one engine (one model, ``dp = gpus // tp`` replicas of one TP degree, as a
  JOIN agent does), so the planner hands out whole nodes. ``shared = true`` says several
  engines may split a node (jobs that each take part of a node); a replica still never spans
  two nodes.
* Each GPU type's shared nodes form one *pool* of the placement problem (whatever their sizes),
  and its exclusive nodes one pool per node size (a unit of placement is a whole node). A pool
  is named after its GPU type when the type has one pool, else ``TYPE/Ng`` (``A100-80G/4g``)
  for exclusive nodes of N GPUs and ``TYPE/shared`` for the shared ones.
* The ``[gpus]`` form of an inventory file (``TYPE = COUNT``) says nothing about nodes: it is
  read as shared nodes of the type's catalog ``gpus_per_node`` (the remainder as one smaller
  node), i.e. GPUs of a type are interchangeable up to the TP link domain, as before nodes were
  known.
* TP is at most the node size and the catalog's ``gpus_per_node`` (the TP link domain).

Pure data; ``objective.Problem`` builds its options per pool and ``realise`` puts a pool
placement on named nodes (module ``scheduler.realise``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.catalog import Catalog
from scheduler.errors import CatalogError, WorkloadError


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` nodes of ``gpus`` GPUs of type ``gpu`` (a catalog name or alias).

    ``names`` (optional, one per node) name the nodes, e.g. mesh session ids; ``serving``
    (optional, one per node) is the catalog model each node already serves ("" for none)."""

    gpu: str
    nodes: int
    gpus: int
    shared: bool = False
    names: tuple[str, ...] = ()
    serving: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 0:
            raise WorkloadError(f"{self.gpu}: node count must be zero or more, got {self.nodes}")
        if self.gpus < 1:
            raise WorkloadError(f"{self.gpu}: GPUs per node must be at least 1, got {self.gpus}")
        if self.names and len(self.names) != self.nodes:
            raise WorkloadError(f"{self.gpu}: {len(self.names)} names for {self.nodes} nodes")
        if self.serving and len(self.serving) != self.nodes:
            raise WorkloadError(f"{self.gpu}: {len(self.serving)} serving for {self.nodes} nodes")


@dataclass(frozen=True)
class Pool:
    """One pool of the placement problem: nodes of one GPU type, either all of one size and
    exclusive, or shared (sizes may differ; ``node_gpus`` is the largest)."""

    name: str
    gpu: str  # catalog GPU type
    node_gpus: int
    shared: bool
    node_names: tuple[str, ...]
    node_models: tuple[str, ...]  # the model each node serves now ("" for none)
    node_sizes: tuple[int, ...]  # GPUs of each node

    @property
    def nodes(self) -> int:
        return len(self.node_names)

    @property
    def gpus(self) -> int:
        return sum(self.node_sizes)

    def unit_gpus(self, tp: int) -> int:
        """GPUs one placement unit of TP ``tp`` takes: one replica on a shared node, the whole
        node (its one engine) on an exclusive one."""
        return tp if self.shared else self.node_gpus

    def replicas_per_unit(self, tp: int) -> int:
        return 1 if self.shared else self.node_gpus // tp


class Inventory:
    """Pools by name, in a stable order (see the module docstring)."""

    def __init__(self, pools: Iterable[Pool]) -> None:
        self.pools: dict[str, Pool] = {p.name: p for p in pools if p.nodes > 0}

    @staticmethod
    def of(
        source: Inventory | Mapping[str, int] | Iterable[NodeGroup], catalog: Catalog
    ) -> Inventory:
        """An inventory from node groups, or from GPU counts (the ``[gpus]`` form)."""
        if isinstance(source, Inventory):
            return source
        if isinstance(source, Mapping):
            return Inventory.from_counts(source, catalog)
        return Inventory.from_groups(source, catalog)

    @staticmethod
    def from_counts(counts: Mapping[str, int], catalog: Catalog) -> Inventory:
        """GPU type -> count, read as shared nodes of the catalog's ``gpus_per_node``."""
        total: dict[str, int] = {}
        for name, count in counts.items():
            gpu = _gpu(catalog, name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise WorkloadError(f"inventory: {gpu} count must be zero or more")
            total[gpu] = total.get(gpu, 0) + count
        groups: list[NodeGroup] = []
        for gpu, count in total.items():
            size = catalog.gpu(gpu).gpus_per_node
            if count >= size:
                groups.append(NodeGroup(gpu, count // size, size, shared=True))
            if count % size:
                groups.append(NodeGroup(gpu, 1, count % size, shared=True))
        return Inventory.from_groups(groups, catalog)

    @staticmethod
    def from_groups(groups: Iterable[NodeGroup], catalog: Catalog) -> Inventory:
        # shared nodes of a type form one pool whatever their sizes; exclusive nodes one pool
        # per size (a unit is a whole node)
        merged: dict[tuple[str, int], list[NodeGroup]] = {}
        for g in groups:
            gpu = _gpu(catalog, g.gpu)
            if g.nodes > 0:
                merged.setdefault((gpu, 0 if g.shared else g.gpus), []).append(g)
        per_type: dict[str, int] = {}
        for gpu, _ in merged:
            per_type[gpu] = per_type.get(gpu, 0) + 1
        pools: list[Pool] = []
        for (gpu, size), parts in sorted(merged.items(), key=lambda kv: kv[0]):
            name = gpu
            if per_type[gpu] > 1:
                name += "/shared" if size == 0 else f"/{size}g"
            names: list[str] = []
            models: list[str] = []
            sizes: list[int] = []
            for p in parts:
                base = len(names)
                names += list(p.names) or [f"{name}#{base + i}" for i in range(p.nodes)]
                models += list(p.serving) or [""] * p.nodes
                sizes += [p.gpus] * p.nodes
            pools.append(
                Pool(name, gpu, max(sizes), size == 0, tuple(names), tuple(models), tuple(sizes))
            )
        return Inventory(pools)

    def counts(self) -> dict[str, int]:
        """Pool name -> GPUs."""
        return {name: p.gpus for name, p in self.pools.items()}

    def by_type(self) -> dict[str, int]:
        """Catalog GPU type -> GPUs."""
        out: dict[str, int] = {}
        for p in self.pools.values():
            out[p.gpu] = out.get(p.gpu, 0) + p.gpus
        return out

    def to_json(self) -> list[dict[str, object]]:
        return [
            {"pool": p.name, "gpu": p.gpu, "nodes": p.nodes, "gpus_per_node": p.node_gpus,
             "shared": p.shared}
            for p in self.pools.values()
        ]  # fmt: skip


def _gpu(catalog: Catalog, name: str) -> str:
    try:
        return catalog.gpu(name).name
    except CatalogError as exc:
        raise WorkloadError(f"inventory: {exc}") from None
