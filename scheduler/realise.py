"""From a placement over pools to engines on named nodes: the placement a plan predicts and applies.

The solvers place *units* per pool (``scheduler.inventory``): on an exclusive pool a unit is one
node's engine, on a shared pool one replica. ``realise`` names the node of every engine:

* Exclusive pools: each unit gets a node of its own. A node that already serves the unit's
  model (a SERVING agent of the mesh) is taken first, then an idle one (JOIN), and a node
  serving another model only when nothing else is left (``NodeEngine.replaces`` names what it
  serves; ``fabric plan --apply`` never stops a running engine, so it reports those).
* Shared pools: replicas are packed onto the pool's nodes first-fit decreasing by TP (largest
  first, each onto the fullest node it fits on), so a replica never spans two nodes and replicas
  of one model and TP on one node form one engine (``dp`` > 1). A replica no node can hold
  (node sizes that do not divide) is dropped and reported; the pool-level plan then promised
  more than the nodes hold, and the realised rows say what was kept.

``Layout.rows`` is what a plan predicts: the realised placement, not the pool-level one.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.objective import Problem
from scheduler.search import State


@dataclass(frozen=True)
class NodeEngine:
    """One engine on one node: ``dp`` replicas of ``tp`` GPUs of ``model``."""

    node: str
    pool: str
    gpu: str  # catalog GPU type
    node_gpus: int
    model: str
    tp: int
    dp: int
    replaces: str = ""  # the model the node serves now, when it is another one

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    def to_json(self) -> dict[str, object]:
        return {
            "node": self.node,
            "pool": self.pool,
            "gpu": self.gpu,
            "node_gpus": self.node_gpus,
            "model": self.model,
            "tp": self.tp,
            "dp": self.dp,
            "replaces": self.replaces or None,
        }


@dataclass(frozen=True)
class Layout:
    engines: tuple[NodeEngine, ...]
    rows: State  # the realised placement: model -> pool -> (tp, units)
    notes: tuple[str, ...]

    def nodes_of(self, model: str, pool: str) -> list[str]:
        return [e.node for e in self.engines if e.model == model and e.pool == pool]


def realise(problem: Problem, rows: State) -> Layout:
    """Name the node of every engine of ``rows`` (module docstring)."""
    engines: list[NodeEngine] = []
    kept: State = {}
    notes: list[str] = []
    for name, pool in problem.pools.items():
        wanted = [(m, r[name]) for m, r in rows.items() if r.get(name, (0, 0))[1] > 0]
        if not wanted:
            continue
        if not pool.shared:
            free = list(range(pool.nodes))
            given: dict[str, list[int]] = {m: [] for m, _ in wanted}
            # nodes serving the model first, then idle nodes, then nodes serving another model
            for rank in (0, 1, 2):
                for model, (_, units) in wanted:
                    for i in list(free):
                        if len(given[model]) >= units:
                            break
                        now = pool.node_models[i]
                        mine, idle = now == model, now == ""
                        if (rank == 0 and mine) or (rank == 1 and idle) or rank == 2:
                            given[model].append(i)
                            free.remove(i)
            for model, (tp, units) in wanted:
                for i in sorted(given[model]):
                    now = pool.node_models[i]
                    engines.append(
                        NodeEngine(
                            pool.node_names[i],
                            name,
                            pool.gpu,
                            pool.node_gpus,
                            model,
                            tp,
                            pool.node_gpus // tp,
                            now if now and now != model else "",
                        )
                    )
                if given[model]:
                    kept.setdefault(model, {})[name] = (tp, len(given[model]))
                if len(given[model]) < units:  # pragma: no cover - C1 keeps units within nodes
                    notes.append(
                        f"{units - len(given[model])} {model} node(s) on {name}: none left"
                    )
            continue
        space = list(pool.node_sizes)
        placed: dict[tuple[int, str, int], int] = {}
        replicas = sorted(
            ((tp, model) for model, (tp, units) in wanted for _ in range(units)),
            key=lambda r: (-r[0], r[1]),
        )
        lost: dict[tuple[str, int], int] = {}
        for tp, model in replicas:
            fits = [i for i in range(pool.nodes) if space[i] >= tp]
            if not fits:
                lost[(model, tp)] = lost.get((model, tp), 0) + 1
                continue
            i = min(fits, key=lambda j: (space[j], j))  # fullest node that fits
            space[i] -= tp
            placed[(i, model, tp)] = placed.get((i, model, tp), 0) + 1
        for (i, model, tp), dp in sorted(placed.items()):
            engines.append(
                NodeEngine(pool.node_names[i], name, pool.gpu, pool.node_sizes[i], model, tp, dp)
            )
            old = kept.setdefault(model, {}).get(name, (tp, 0))
            kept[model][name] = (tp, old[1] + dp)
        for (model, tp), n in sorted(lost.items()):
            notes.append(
                f"{n} {model} replica(s) of TP {tp} do not fit on {name}'s "
                f"{pool.node_gpus}-GPU nodes: left out of the plan"
            )
    return Layout(tuple(engines), kept, tuple(notes))
