"""Greedy construction and exact-cost local search over placements (pure, no OR-Tools).

Both work on *rows*: model -> GPU type -> (tp, dp), with C1 (free GPUs per type never below
zero) and C3 (one TP per model and GPU type; options are memory-feasible, C2) kept by
construction, and both compare placements by ``Problem.cost``'s lexicographic key.

* ``greedy``: first ``min_replicas`` replicas per model (largest demand, parameters x rate,
  first; the option with the most capacity per GPU that still fits), then repeatedly the single
  replica whose addition improves the key most per GPU, until none does. This is the solver's
  hint; alone it is a decent heuristic.
* ``local_search``: hill climbing with first improvement over four neighbourhoods: add ``k``
  replicas from idle GPUs; move one replica's GPUs to ``k`` replicas of any model (the same
  model included: change GPU type or TP); re-shard a row to another TP; swap GPU types between
  two models (one replica each, refilled). Each candidate is priced exactly on the models it
  touches. Stops at a local optimum or at the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from scheduler.objective import Key, ModelCost, Option, Problem, improves

State = dict[str, dict[str, tuple[int, int]]]  # model -> GPU type -> (tp, dp)


@dataclass(frozen=True)
class SearchStats:
    moves: int
    evaluations: int
    seconds: float
    local_optimum: bool  # False when the deadline stopped it


class _Search:
    def __init__(self, problem: Problem, mode: str, rows: State) -> None:
        self.p = problem
        self.mode = mode
        self.rows: State = {m: dict(rows.get(m, {})) for m in problem.models}
        self.free = dict(problem.inventory)
        for r in self.rows.values():
            for g, (tp, dp) in r.items():
                self.free[g] -= problem.unit_gpus(g, tp) * dp
        if any(v < 0 for v in self.free.values()):
            raise ValueError("rows exceed the inventory")
        self.costs: dict[str, ModelCost] = {m: self._price(m, self.rows[m]) for m in self.rows}
        self.evaluations = 0
        self.moves = 0

    def _price(self, model: str, rows: dict[str, tuple[int, int]]) -> ModelCost:
        return self.p.model_cost(model, rows)

    def key(self) -> Key:
        return self.p.key(list(self.costs.values()), self.mode)

    def key_with(self, changed: dict[str, ModelCost]) -> Key:
        merged = [changed.get(m, c) for m, c in self.costs.items()]
        return self.p.key(merged, self.mode)

    def replicas(self, model: str, rows: dict[str, tuple[int, int]] | None = None) -> int:
        return sum(dp for _, dp in (self.rows[model] if rows is None else rows).values())

    def used(self, pool: str, row: tuple[int, int] | None) -> int:
        """GPUs a (tp, units) row takes in ``pool``."""
        return 0 if row is None else self.p.unit_gpus(pool, row[0]) * row[1]

    def allowed(self, model: str, rows: dict[str, tuple[int, int]], o: Option) -> bool:
        have = rows.get(o.gpu)
        return have is None or have[0] == o.tp

    def try_change(self, new_rows: dict[str, dict[str, tuple[int, int]]]) -> bool:
        """Apply the change if it keeps min_replicas (when met) and improves the key."""
        for m, r in new_rows.items():
            if self.replicas(m, r) < min(self.p.min_replicas, self.replicas(m)):
                return False
        self.evaluations += 1
        changed = {m: self._price(m, r) for m, r in new_rows.items()}
        if not improves(self.key_with(changed), self.key()):
            return False
        for m, r in new_rows.items():
            old = self.rows[m]
            for g in set(old) | set(r):
                self.free[g] += self.used(g, old.get(g))
                self.free[g] -= self.used(g, r.get(g))
            self.rows[m] = r
            self.costs[m] = changed[m]
        self.moves += 1
        return True


def _with(
    rows: dict[str, tuple[int, int]], gpu: str, tp: int, delta: int
) -> dict[str, tuple[int, int]]:
    out = dict(rows)
    dp = out.get(gpu, (tp, 0))[1] + delta
    if dp > 0:
        out[gpu] = (tp, dp)
    else:
        out.pop(gpu, None)
    return out


def greedy(problem: Problem, mode: str = "latency") -> State:
    """The greedy placement (module docstring)."""
    s = _Search(problem, mode, {})
    by_size = sorted(
        problem.models, key=lambda m: -problem.catalog.model(m).params * max(problem.rates[m], 1e-9)
    )
    for _ in range(problem.min_replicas):
        for m in by_size:
            fits = [
                o
                for o in problem.options[m]
                if s.free[o.gpu] >= o.gpus and s.allowed(m, s.rows[m], o)
            ]
            if not fits:
                continue
            o = max(fits, key=lambda o: (o.per_gpu_rps, -o.tp))
            s.rows[m] = _with(s.rows[m], o.gpu, o.tp, 1)
            s.free[o.gpu] -= o.gpus
            s.costs[m] = s._price(m, s.rows[m])
    while True:
        base = s.key()
        best: tuple[tuple[float, ...], str, Option] | None = None
        for m in problem.models:
            for o in problem.options[m]:
                if s.free[o.gpu] < o.gpus or not s.allowed(m, s.rows[m], o):
                    continue
                new = _with(s.rows[m], o.gpu, o.tp, 1)
                key = s.key_with({m: s._price(m, new)})
                if not improves(key, base):
                    continue
                gain = tuple((b - k) / o.gpus for k, b in zip(key, base, strict=True))
                if best is None or gain > best[0]:
                    best = (gain, m, o)
        if best is None:
            break
        _, m, o = best
        s.rows[m] = _with(s.rows[m], o.gpu, o.tp, 1)
        s.free[o.gpu] -= o.gpus
        s.costs[m] = s._price(m, s.rows[m])
    return {m: r for m, r in s.rows.items() if r}


def local_search(
    problem: Problem,
    rows: State,
    mode: str = "latency",
    deadline: float | None = None,
    on_improve: Callable[[Key], None] | None = None,
) -> tuple[State, SearchStats]:
    """Polish ``rows`` with exact-cost hill climbing (module docstring)."""
    started = time.monotonic()
    s = _Search(problem, mode, rows)
    optimum = False
    while True:
        if deadline is not None and time.monotonic() > deadline:
            break
        improved = False
        for change in _neighbours(s):
            if s.try_change(change):
                improved = True
                if on_improve is not None:
                    on_improve(s.key())
                break
            if deadline is not None and s.evaluations % 64 == 0 and time.monotonic() > deadline:
                break
        if not improved:
            optimum = deadline is None or time.monotonic() <= deadline
            break
    stats = SearchStats(s.moves, s.evaluations, time.monotonic() - started, optimum)
    return {m: r for m, r in s.rows.items() if r}, stats


def _fills(
    s: _Search, m: str, rows: dict[str, tuple[int, int]], free: dict[str, int]
) -> Iterator[tuple[Option, int]]:
    """(option, k): ways to add k >= 1 replicas of model m with ``free`` GPUs."""
    for o in s.p.options[m]:
        if not s.allowed(m, rows, o):
            continue
        top = free[o.gpu] // o.gpus
        for k in range(1, top + 1):
            yield o, k


def _neighbours(s: _Search) -> Iterator[dict[str, dict[str, tuple[int, int]]]]:
    p = s.p
    models = p.models
    # 1. add replicas from idle GPUs
    for m in models:
        for o, k in _fills(s, m, s.rows[m], s.free):
            yield {m: _with(s.rows[m], o.gpu, o.tp, k)}
    # 2. move one replica's GPUs (plus idle ones) to k replicas of any model, or just drop it
    for m in models:
        for g, (tp, _dp) in list(s.rows[m].items()):
            shrunk = _with(s.rows[m], g, tp, -1)
            yield {m: shrunk}
            free = dict(s.free)
            free[g] += p.unit_gpus(g, tp)
            for m2 in models:
                base = shrunk if m2 == m else s.rows[m2]
                for o, k in _fills(s, m2, base, free):
                    if m2 == m and o.gpu == g and o.tp == tp:
                        continue
                    grown = _with(base, o.gpu, o.tp, k)
                    yield {m: grown} if m2 == m else {m: shrunk, m2: grown}
    # 3. re-shard a row to another TP with the same (plus idle) GPUs
    for m in models:
        for g, (tp, dp) in list(s.rows[m].items()):
            pool = p.unit_gpus(g, tp) * dp + s.free[g]
            for o in p.options[m]:
                if o.gpu != g or o.tp == tp:
                    continue
                for dp2 in range(1, pool // o.gpus + 1):
                    rows = dict(s.rows[m])
                    rows[g] = (o.tp, dp2)
                    yield {m: rows}
    # 4. swap GPU types between two models: each gives up one replica and refills on the
    #    other's type
    for i, m1 in enumerate(models):
        for m2 in models[i + 1 :]:
            for g1, (tp1, _) in list(s.rows[m1].items()):
                for g2, (tp2, _) in list(s.rows[m2].items()):
                    if g1 == g2:
                        continue
                    r1 = _with(s.rows[m1], g1, tp1, -1)
                    r2 = _with(s.rows[m2], g2, tp2, -1)
                    free = dict(s.free)
                    free[g1] += p.unit_gpus(g1, tp1)
                    free[g2] += p.unit_gpus(g2, tp2)
                    for o1 in p.options[m1]:
                        if o1.gpu != g2 or not s.allowed(m1, r1, o1):
                            continue
                        k1 = free[g2] // o1.gpus
                        if k1 < 1:
                            continue
                        a = _with(r1, g2, o1.tp, k1)
                        rest = dict(free)
                        rest[g2] -= k1 * o1.gpus
                        for o2 in p.options[m2]:
                            if o2.gpu != g1 or not s.allowed(m2, r2, o2):
                                continue
                            k2 = rest[g1] // o2.gpus
                            if k2 >= 1:
                                yield {m1: a, m2: _with(r2, g1, o2.tp, k2)}


def next_replica(problem: Problem, rows: State, model: str) -> tuple[str, int] | None:
    """Where one more unit of ``model`` should go given ``rows``: the (pool, TP) that fits the
    free GPUs, keeps one TP per pool (C3) and improves the model's cost most per GPU (capacity
    per GPU when nothing improves, e.g. without a measured rate). None when nothing fits.

    This is the planner's answer to "which GPU type and TP for one more replica of M", for a
    controller that grows a model one replica at a time."""
    s = _Search(problem, "latency", rows)
    mine = s.rows.get(model, {})
    best: tuple[tuple[float, ...], str, int] | None = None
    before = s._price(model, mine)
    for o in problem.options.get(model, ()):
        if s.free[o.gpu] < o.gpus or not s.allowed(model, mine, o):
            continue
        after = s._price(model, _with(mine, o.gpu, o.tp, 1))
        gain = (
            (before.unserved_rps - after.unserved_rps) / o.gpus,
            (before.in_system - after.in_system) / o.gpus,
            o.per_gpu_rps,
        )
        if best is None or gain > best[0]:
            best = (gain, o.gpu, o.tp)
    return None if best is None else (best[1], best[2])
