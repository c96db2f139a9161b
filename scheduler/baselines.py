"""Baselines: memP (the heuristic of paper §5) and the exact optimum of the analytic cost.

memP ("memory-proportional", inspired by HexGen). Rules, in order:

1. Each model's *demand* is its arrival rate times its parameter count. The inventory's GPUs are
   apportioned to models in proportion to demand, in blocks of ``block`` GPUs (default: the
   smallest ``gpus_per_node`` among the inventory's types, i.e. whole nodes; 4 for GH200 quad
   nodes) by largest remainder; GPUs left over from the blocks go to the largest model.
2. GPU types are ranked fastest first by ``sqrt(BF16 TFLOPS x memory bandwidth)``; models, largest
   first, take their share from the fastest types that still have GPUs and can hold them (C2).
3. On each (model, GPU type) the TP degree is the feasible one with the most analytic capacity
   for the GPUs given (``dp = gpus // tp``; ties go to the smaller TP), which is generous to
   memP: it does not lose to a poor TP choice, only to its allocation.
4. GPUs still idle (rounding to TP, shares a model could not use) go to the largest models
   first, on the types they already use (their TP) or can use (their best TP).

On the paper's instance (24 A100-80G + 32 GH200; Llama-2-13B, CodeLlama-34B, Llama-3.3-70B at
110, 185.5 and 221 req/s) the demands are 6.1%, 26.9% and 67.0%, i.e. 0.86, 3.76 and 9.38 of
the 14 four-GPU blocks, rounded to 1, 4 and 9 blocks: 4, 16 and 36 GPUs. The 70B takes the 32
GH200 and 4 A100, the 34B 16 A100 and the 13B 4 A100: Table 1's MemP row exactly
(tests/unit/scheduler/test_solver.py).

The exact optimum minimises ``Problem.cost`` (lexicographic key of the mode) by dynamic
programming over models. The cost is separable by model and the only coupling is C1, so with
``V_k(R)`` the best cost of models ``k..M`` within ``R`` GPUs per type,
``V_k(R) = min_{x <= R} f_k(x) + V_{k+1}(R - x)``, where ``f_k(x)`` is the best cost of model
``k`` on exactly ``x`` GPUs per type over its TP choices (one per type, C3). The state space is
``prod(count_n + 1)``, so it is exact and tractable for a few GPU types (the bench's 2- and
3-type instances take well under a second); ``exact`` refuses instances whose work exceeds
``max_work``. The lexicographic key is scalarised as ``unserved * BIG + in_system`` with ``BIG``
far above any in-system total, and ``"fair"`` first finds the best weighted max-min level
(``Problem.fair_level``) with a bottleneck DP of the same shape, then restricts every model to
at least that level. Needs
numpy (installed with ``fabricnode[scheduler]``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.errors import SchedulerError
from scheduler.objective import Cost, Option, Problem, check_mode
from scheduler.placement import Placement


def gpu_speed(problem: Problem, pool: str) -> float:
    spec = problem.catalog.gpu(problem.pools[pool].gpu)
    return math.sqrt(spec.bf16_tflops * spec.memory_bw_gbs)


def memp(problem: Problem, block: int | None = None) -> Placement:
    """The memory-proportional placement (module docstring)."""
    models = list(problem.models)
    if not models or not problem.inventory:
        return Placement(())
    catalog = problem.catalog
    size = {m: catalog.model(m).params for m in models}
    demand = {m: problem.rates[m] * size[m] for m in models}
    if block is None:
        block = min(
            min(catalog.gpu(p.gpu).gpus_per_node, p.node_gpus) for p in problem.pools.values()
        )
    if block < 1:
        raise SchedulerError("memP block must be at least 1 GPU")
    total = sum(problem.inventory.values())
    blocks = total // block
    quota = {m: blocks * demand[m] / sum(demand.values()) for m in models}
    share = {m: math.floor(q) for m, q in quota.items()}
    by_remainder = sorted(models, key=lambda m: (-(quota[m] - share[m]), -demand[m]))
    for m in by_remainder[: blocks - sum(share.values())]:
        share[m] += 1
    share = {m: n * block for m, n in share.items()}
    largest = sorted(models, key=lambda m: (-size[m], -demand[m]))
    share[largest[0]] += total - blocks * block

    fastest = sorted(problem.gpus, key=lambda g: -gpu_speed(problem, g))
    free = dict(problem.inventory)
    counts: dict[str, dict[str, int]] = {m: {} for m in models}
    for m in largest:
        want = share[m]
        usable = {o.gpu for o in problem.options[m]}
        for g in fastest:
            if want <= 0:
                break
            if g not in usable or free[g] <= 0:
                continue
            take = min(want, free[g])
            counts[m][g] = take
            free[g] -= take
            want -= take

    rows: dict[str, dict[str, tuple[int, int]]] = {m: {} for m in models}
    for m in models:
        for g, n in counts[m].items():
            best = _best_tp(problem.options[m], g, n)
            if best is None:
                free[g] += n
                continue
            tp, dp = best
            rows[m][g] = (tp, dp)
            free[g] += n - problem.unit_gpus(g, tp) * dp
    for m in largest:
        for g in fastest:
            if g in rows[m]:
                tp, dp = rows[m][g]
                unit = problem.unit_gpus(g, tp)
                extra = free[g] // unit
                if extra:
                    rows[m][g] = (tp, dp + extra)
                    free[g] -= extra * unit
            else:
                best = _best_tp(problem.options[m], g, free[g])
                if best is not None:
                    rows[m][g] = best
                    free[g] -= problem.unit_gpus(g, best[0]) * best[1]
    return problem.placement(rows)


def _best_tp(options: Sequence[Option], gpu: str, gpus: int) -> tuple[int, int] | None:
    best: tuple[float, int, int] | None = None
    for o in options:
        if o.gpu != gpu or o.gpus > gpus:
            continue
        dp = gpus // o.gpus
        capacity = dp * o.capacity_rps
        if best is None or capacity > best[0] * (1 + 1e-12):
            best = (capacity, o.tp, dp)
    return None if best is None else (best[1], best[2])


# -- exact optimum ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactResult:
    placement: Placement
    cost: Cost
    seconds: float
    notes: tuple[str, ...]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise SchedulerError(
            "the exact optimum needs numpy: pip install 'fabricnode[scheduler]'"
        ) from None
    return numpy


def exact_work(problem: Problem) -> float:
    """Elementary DP steps ``exact`` would take (states x usage vectors x models)."""
    states = math.prod(n + 1 for n in problem.inventory.values())
    return float(states) * states * max(1, len(problem.models))


def exact(
    problem: Problem, mode: str = "latency", max_work: float = 2e9, fair_slack: float = 1.0
) -> ExactResult:
    """The placement minimising ``problem.cost(..., mode)`` (module docstring).

    ``fair_slack`` < 1 (mode ``"fair"``) keeps every model at ``fair_slack`` times the best
    max-min level instead of the level itself, then maximises served req/s and minimises
    latency: the most a plan can serve while within that share of the max-min optimum."""
    check_mode(mode)
    if not 0 < fair_slack <= 1:
        raise SchedulerError(f"fair_slack must be in (0, 1], got {fair_slack}")
    np = _numpy()
    started = time.monotonic()
    work = exact_work(problem)
    if work > max_work:
        raise SchedulerError(
            f"the exact optimum is intractable here ({work:.1e} DP steps > {max_work:.0e}; "
            f"{len(problem.gpus)} GPU types with {sum(problem.inventory.values())} GPUs)"
        )
    notes: list[str] = []
    tables = [_ModelTable(np, problem, m) for m in problem.models]
    need = problem.min_replicas
    rows = _solve(np, problem, tables, mode, need, fair_slack)
    if rows is None and need > 0:
        notes.append(
            f"the inventory cannot give every model {need} replica(s): requirement dropped"
        )
        rows = _solve(np, problem, tables, mode, 0, fair_slack)
    if rows is None:  # pragma: no cover - with min_replicas 0 the empty placement is feasible
        raise SchedulerError("exact: no feasible placement")
    placement = problem.placement(rows)
    return ExactResult(
        placement, problem.cost(placement, mode), time.monotonic() - started, tuple(notes)
    )


class _ModelTable:
    """Per usage vector x (GPUs per type), the candidates of one model: key parts per TP combo."""

    def __init__(self, np: Any, problem: Problem, model: str) -> None:
        self.model = model
        gpus = problem.gpus
        dims = tuple(problem.inventory[g] + 1 for g in gpus)
        self.dims = dims
        rate = problem.rates[model]
        umax = problem.max_utilization
        by_gpu: list[list[Option | None]] = []
        for g in gpus:
            opts: list[Option | None] = [o for o in problem.options[model] if o.gpu == g]
            by_gpu.append(opts or [None])
        # each combo: arrays over its dp grid, flattened, with the flat index of x = tp * dp
        self.combos: list[tuple[tuple[Option | None, ...], Any, Any, Any, Any, Any]] = []
        for combo in itertools.product(*by_gpu):
            axes = []
            for n, o in enumerate(combo):
                top = 0 if o is None else (dims[n] - 1) // o.gpus
                axes.append(np.arange(top + 1))
            grid = np.meshgrid(*axes, indexing="ij")
            dp = [a.ravel() for a in grid]
            capacity = np.zeros(dp[0].shape)
            replicas = np.zeros(dp[0].shape, dtype=np.int64)
            flat = np.zeros(dp[0].shape, dtype=np.int64)
            stride = 1
            for n in reversed(range(len(gpus))):
                o = combo[n]
                if o is not None:
                    capacity += dp[n] * o.capacity_rps
                    replicas += dp[n] * o.replicas
                    flat += dp[n] * o.gpus * stride
                stride *= dims[n]
            served = np.minimum(rate, umax * capacity)
            util = np.divide(served, capacity, out=np.zeros_like(served), where=capacity > 0)
            in_system = np.zeros(dp[0].shape)
            for n, o in enumerate(combo):
                if o is None:
                    continue
                rates = np.array([pt.rate_rps for pt in o.table.points])
                e2e = np.array([pt.e2e_s for pt in o.table.points])
                r = util * o.replica_capacity_rps  # per replica
                in_system += dp[n] * o.replicas * r * np.interp(r, rates, e2e)
            unserved = rate - served
            # the model's weighted fair level, min(1, fraction / priority) (Problem.fair_level)
            fraction = np.minimum(1.0, served / rate / problem.priority[model])
            dp_matrix = np.stack(dp, axis=1)
            self.combos.append((combo, flat, unserved, in_system, fraction, (replicas, dp_matrix)))

    def best(
        self, np: Any, big: float, need: int, floor_fraction: float | None
    ) -> tuple[Any, Any, Any]:
        """f(x) (flat array, inf where impossible), and per x the combo and grid row."""
        size = math.prod(self.dims)
        f = np.full(size, np.inf)
        which = np.full(size, -1, dtype=np.int64)
        row = np.full(size, -1, dtype=np.int64)
        for c, (_, flat, unserved, in_system, fraction, (replicas, _)) in enumerate(self.combos):
            key = unserved * big + in_system
            bad = replicas < need
            if floor_fraction is not None:
                bad |= fraction < floor_fraction - 1e-12
            key = np.where(bad, np.inf, key)
            better = key < f[flat]
            idx = flat[better]
            f[idx] = key[better]
            which[idx] = c
            row[idx] = np.nonzero(better)[0]
        return f, which, row

    def best_fraction(self, np: Any, need: int) -> Any:
        size = math.prod(self.dims)
        g = np.full(size, -np.inf)
        for _, flat, _, _, fraction, (replicas, _) in self.combos:
            value = np.where(replicas < need, -np.inf, fraction)
            np.maximum.at(g, flat, value)
        return g

    def rows(self, which: int, row: int) -> dict[str, tuple[int, int]]:
        combo, _, _, _, _, (_, dp_matrix) = self.combos[which]
        out: dict[str, tuple[int, int]] = {}
        for n, o in enumerate(combo):
            if o is not None and dp_matrix[row, n] > 0:
                out[o.gpu] = (o.tp, int(dp_matrix[row, n]))
        return out


def _shifted(np: Any, dims: tuple[int, ...], x: tuple[int, ...]) -> tuple[Any, Any]:
    """Slices selecting R >= x and R - x in arrays of shape ``dims``."""
    dst = tuple(slice(xi, d) for xi, d in zip(x, dims, strict=True))
    src = tuple(slice(0, d - xi) for xi, d in zip(x, dims, strict=True))
    return dst, src


def _solve(
    np: Any, problem: Problem, tables: list[_ModelTable], mode: str, need: int, slack: float = 1.0
) -> dict[str, dict[str, tuple[int, int]]] | None:
    if not tables:
        return {}
    dims = tables[0].dims
    floor_fraction: float | None = None
    if mode == "fair":
        w = np.ones(dims)
        for t in reversed(tables):
            g = t.best_fraction(np, need).reshape(dims)
            nxt = np.full(dims, -np.inf)
            for flat in np.nonzero(np.isfinite(g.ravel()))[0]:
                x = np.unravel_index(flat, dims)
                dst, src = _shifted(np, dims, tuple(int(v) for v in x))
                np.maximum(nxt[dst], np.minimum(g[x], w[src]), out=nxt[dst])
            w = nxt
        best = float(w[tuple(d - 1 for d in dims)])
        if not math.isfinite(best):
            return None
        floor_fraction = best * slack
    bound = 1.0
    for m in problem.models:
        worst = max(o.e2e_at(problem.max_utilization) for o in problem.options[m])
        bound += problem.rates[m] * worst
    big = bound * 1e6
    value = np.zeros(dims)
    choices: list[tuple[Any, Any, Any]] = []
    for t in reversed(tables):
        f, which, row = t.best(np, big, need, floor_fraction)
        f = f.reshape(dims)
        nxt = np.full(dims, np.inf)
        arg = np.full(dims, -1, dtype=np.int64)
        for flat in np.nonzero(np.isfinite(f.ravel()))[0]:
            x = np.unravel_index(flat, dims)
            dst, src = _shifted(np, dims, tuple(int(v) for v in x))
            candidate = f[x] + value[src]
            better = candidate < nxt[dst]
            nxt[dst] = np.where(better, candidate, nxt[dst])
            arg[dst] = np.where(better, flat, arg[dst])
        value = nxt
        choices.append((arg, which, row))
    choices.reverse()
    remaining = tuple(d - 1 for d in dims)
    if not math.isfinite(float(value[remaining])):
        return None
    rows: dict[str, dict[str, tuple[int, int]]] = {}
    for t, (arg, which, row) in zip(tables, choices, strict=True):
        flat = int(arg[remaining])
        x = tuple(int(v) for v in np.unravel_index(flat, dims))
        rows[t.model] = t.rows(int(which[flat]), int(row[flat]))
        remaining = tuple(r - xi for r, xi in zip(remaining, x, strict=True))
    return rows
