"""CP-SAT placement solver (OR-Tools, optional extra ``fabricnode[scheduler]``).

Theory of operation. The decision of paper Eq. 1 for every model m and each of its options
o = (pool n, TP degree t) that is memory-feasible (C2) and shards the model (C3). An option is
a unit: one replica on a shared pool, one node's engine of ``k = node GPUs // t`` replicas on
an exclusive pool (``scheduler.inventory``); it takes ``g_o`` GPUs (``t`` or the node's):

* ``y[o]`` boolean: model m uses TP t on type n; at most one t per (m, n) (C3);
* ``dp[o]`` integer units, ``y[o] <= dp[o] <= floor(count_n / g_o) * y[o]``; the allocation
  ``a[m, n] = sum_t g_o * dp[o]`` is linear (no multiplication constraint), and C1 is
  ``sum_m a[m, n] <= count_n``;
* ``r[o]`` integer: the rate routed to those replicas (milli-req/s), ``r[o] <= u_max * cap_o *
  dp[o]``, and ``served[m] = sum_o r[o] <= rate_m``;
* ``c[o]`` integer: the mean number of m's requests in the system on those replicas (Little:
  rate x E2E, micro-requests). One replica at rate rho holds ``h_o(rho) = rho * E2E_o(rho)``
  requests, ``h_o`` taken from the analytic table (``analytic.replica_table``) and convex. Its
  piecewise-linear lower convex hull gives lines ``h_o(rho) >= alpha_k + beta_k * rho``; the
  ``dp`` replicas of o sharing ``r`` equally hold ``dp * h_o(r / dp) >= alpha_k * dp + beta_k *
  r`` (the perspective of an affine function is linear), so ``c[o] >= alpha_k * dp[o] +
  beta_k * r[o]`` for every k is an exact linearisation of the piecewise-linear curve, with no
  extra booleans (a unit of k replicas uses ``k * alpha_k``). Between replica types the solver
  splits the rate freely (the best router);
  the exact cost splits it in proportion to capacity (what least-loaded routing converges to),
  which the polishing step below accounts for.

Objectives, solved lexicographically, one CP-SAT solve per level, each hinted with the previous
level's solution and then fixed at its best value: ``"fair"`` first maximises the fair level
phi (``1000 * served[m] >= priority_m * phi * rate_m``, ``Problem.fair_level``); every mode
then maximises ``sum served``
and finally minimises ``sum c``. The first solve is hinted with the greedy placement
(``search.greedy``). Every model with traffic gets ``min_replicas`` replicas when the inventory
allows (otherwise the requirement is dropped with a note).

The CP-SAT placement is then polished by exact-cost local search (``search.local_search`` on
``Problem.cost``) within the remaining time, and the better of it and the polished greedy
placement is returned. Progress (each improving CP-SAT solution, each phase, each polishing
move) goes to an optional callback and to the ``scheduler.solver`` logger.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.errors import SchedulerError
from scheduler.objective import Cost, Option, Problem, check_mode, improves
from scheduler.placement import Placement
from scheduler.search import State, greedy, local_search

log = logging.getLogger("scheduler.solver")

RATE_SCALE = 1000  # r and served in milli-req/s
COST_SCALE = 1_000_000  # c in micro-requests
PHI_SCALE = 1000  # fair share in thousandths
PRIORITY_SCALE = 1000  # priorities (at most 1) in thousandths


def _cp_model() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise SchedulerError(
            "the CP-SAT solver needs OR-Tools: pip install 'fabricnode[scheduler]'"
        ) from None
    return cp_model


@dataclass(frozen=True)
class Progress:
    """One progress report: a CP-SAT solution, a phase result or a polishing move."""

    phase: str  # "greedy", "fair", "served", "latency", "polish"
    elapsed_s: float
    objective: float  # the phase's objective (fair: share 0-1; served: req/s;
    #                    latency/polish: requests in the system)
    bound: float  # CP-SAT's best bound (nan for greedy and polish)
    message: str


@dataclass(frozen=True)
class PhaseStats:
    """One CP-SAT level. Objective and bound in the linearised model's units: fair share (0-1),
    served req/s, or requests in the system (latency)."""

    phase: str
    status: str  # CP-SAT status name
    seconds: float
    objective: float
    bound: float


@dataclass(frozen=True)
class Solution:
    placement: Placement
    cost: Cost
    seconds: float
    phases: tuple[PhaseStats, ...]
    greedy_cost: Cost
    cpsat_cost: Cost | None  # the CP-SAT placement before polishing
    polish_moves: int
    notes: tuple[str, ...]
    proven_optimal: bool  # every CP-SAT level ran and proved optimal for the linearised model


def solve(
    problem: Problem,
    mode: str = "latency",
    *,
    time_limit_s: float = 10.0,
    num_workers: int | None = None,
    seed: int = 0,
    progress: Callable[[Progress], None] | None = None,
    polish_share: float = 0.2,
) -> Solution:
    """Place ``problem`` with CP-SAT within ``time_limit_s`` (module docstring).

    ``num_workers`` defaults to ``os.cpu_count()``; ``polish_share`` of the time limit is kept
    for the exact-cost local search (unused CP-SAT time rolls over to it)."""
    check_mode(mode)
    if time_limit_s <= 0:
        raise SchedulerError("time_limit_s must be positive")
    cp_model = _cp_model()
    started = time.monotonic()
    deadline = started + time_limit_s
    workers = num_workers if num_workers is not None else (os.cpu_count() or 1)
    notes: list[str] = []

    def report(phase: str, objective: float, bound: float, message: str) -> None:
        elapsed = time.monotonic() - started
        log.info("%s %.2fs: %s", phase, elapsed, message)
        if progress is not None:
            progress(Progress(phase, elapsed, objective, bound, message))

    hint = greedy(problem, mode)
    greedy_cost = problem.cost(hint, mode)
    report("greedy", greedy_cost.in_system, math.nan, _describe(greedy_cost))
    if not problem.models:
        placement = problem.placement({})
        cost = problem.cost(placement, mode)
        return Solution(placement, cost, 0.0, (), greedy_cost, None, 0, (), True)

    need = problem.min_replicas
    # when greedy could not give every model a replica, ask CP-SAT whether any placement can
    if (
        need > 0
        and problem.lacks_replicas(hint)
        and not _feasible(cp_model, problem, need, workers, seed)
    ):
        notes.append(
            f"the inventory cannot give every model {need} replica(s): requirement dropped"
        )
        need = 0

    cp_budget = time_limit_s * (1.0 - polish_share)
    built = _Built(cp_model, problem, need)
    built.hint(problem, hint)
    phases: list[PhaseStats] = []
    levels = (["fair"] if mode == "fair" else []) + ["served", "latency"]
    rows: State | None = None
    for i, level in enumerate(levels):
        left = started + cp_budget - time.monotonic()
        share = left if i == len(levels) - 1 else left * (0.25 if level == "fair" else 0.35)
        if share <= 0.05:
            break
        stats, values, raw = built.run(cp_model, level, share, workers, seed, report)
        phases.append(stats)
        if values is None:
            break
        rows = values
        built.fix(level, raw)
    cpsat_cost: Cost | None = None
    candidates: list[State] = [hint]
    if rows is not None:
        cpsat_cost = problem.cost(rows, mode)
        candidates.insert(0, rows)

    def short(rows: State) -> int:  # models below min_replicas, when that is required
        return len(problem.lacks_replicas(rows)) if need > 0 else 0

    def moved(key: tuple[float, ...]) -> None:
        report("polish", key[-1], math.nan, f"key {_fmt_key(key)}")

    best: State = hint
    best_cost = greedy_cost
    moves = 0
    for candidate in candidates:
        polished, search = local_search(problem, candidate, mode, deadline, moved)
        moves += search.moves
        cost = problem.cost(polished, mode)
        fewer_short = short(polished) < short(best)
        if fewer_short or (short(polished) == short(best) and improves(cost.key, best_cost.key)):
            best, best_cost = polished, cost
        if time.monotonic() > deadline:
            break
    placement = problem.placement(best)
    report("done", best_cost.in_system, math.nan, _describe(best_cost))
    return Solution(
        placement,
        best_cost,
        time.monotonic() - started,
        tuple(phases),
        greedy_cost,
        cpsat_cost,
        moves,
        tuple(notes),
        len(phases) == len(levels) and all(p.status == "OPTIMAL" for p in phases),
    )


def _describe(cost: Cost) -> str:
    return (
        f"served {cost.served_rps:.2f}/{cost.offered_rps:.2f} req/s, "
        f"min share {cost.min_fraction:.3f}, mean E2E {cost.e2e_s:.3f} s"
    )


def _fmt_key(key: Sequence[float]) -> str:
    return "(" + ", ".join(f"{k:.4g}" for k in key) + ")"


def hull_lines(
    option: Option, max_utilization: float, tolerance: float = 0.01
) -> list[tuple[float, float]]:
    """(alpha, beta) of the lines whose maximum approximates ``rho -> rho * E2E(rho)`` (one
    replica's requests in the system at rate rho, from the option's table, up to
    ``max_utilization`` of capacity) from above: the lower convex hull of the table's points,
    then vertices dropped while the chord over them stays within ``tolerance`` (relative)."""
    top = max_utilization * option.replica_capacity_rps
    pts = [(p.rate_rps, p.rate_rps * p.e2e_s) for p in option.table.points if p.rate_rps < top]
    pts.append((top, top * option.table.e2e_s(top)))
    hull: list[tuple[float, float]] = []
    for x, y in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (x - x1) >= (y - y1) * (x2 - x1):  # hull[-1] not below the chord
                hull.pop()
            else:
                break
        hull.append((x, y))

    def excess(i: int) -> float:
        (x0, y0), (x1, y1), (x2, y2) = hull[i - 1], hull[i], hull[i + 1]
        chord = y0 + (y2 - y0) * (x1 - x0) / (x2 - x0)
        return (chord - y1) / max(y1, 1e-12)

    while len(hull) > 2:
        i = min(range(1, len(hull) - 1), key=excess)
        if excess(i) > tolerance:
            break
        del hull[i]
    # A unit of k replicas sharing rate rho holds k * h(rho / k) >= k * alpha + beta * rho.
    k = option.replicas
    lines: list[tuple[float, float]] = []
    for (x1, y1), (x2, y2) in itertools.pairwise(hull):
        if x2 <= x1:
            continue
        beta = (y2 - y1) / (x2 - x1)
        lines.append((k * (y1 - beta * x1), beta))
    return lines or [(0.0, option.e2e_at(0.0))]


class _Built:
    """The CP-SAT model of one problem (variables per option, constraints, objectives)."""

    def __init__(self, cp_model: Any, problem: Problem, need: int) -> None:
        self.model = cp_model.CpModel()
        m_ = self.model
        self.problem = problem
        umax = problem.max_utilization
        self.options: list[Option] = [o for m in problem.models for o in problem.options[m]]
        self.y: dict[Option, Any] = {}
        self.dp: dict[Option, Any] = {}
        self.r: dict[Option, Any] = {}
        self.c: dict[Option, Any] = {}
        self.served: dict[str, Any] = {}
        self.lines: dict[Option, list[tuple[int, int]]] = {}
        self.rate: dict[str, int] = {
            m: max(1, round(problem.rates[m] * RATE_SCALE)) for m in problem.models
        }
        for o in self.options:
            top = problem.inventory[o.gpu] // o.gpus
            lam = self.rate[o.model]
            tag = f"{o.model}|{o.gpu}|{o.tp}"
            y = m_.new_bool_var(f"y[{tag}]")
            dp = m_.new_int_var(0, top, f"dp[{tag}]")
            r = m_.new_int_var(0, lam, f"r[{tag}]")
            lines = [
                (math.ceil(a * COST_SCALE), math.ceil(b * COST_SCALE / RATE_SCALE))
                for a, b in hull_lines(o, umax)
            ]
            c_top = max(max(a, 0) * top + b * lam for a, b in lines) + 1
            c = m_.new_int_var(0, max(c_top, 1), f"c[{tag}]")
            m_.add(dp <= top * y)
            m_.add(dp >= y)
            per_replica = math.floor(umax * o.capacity_rps * RATE_SCALE)
            m_.add(r <= per_replica * dp)
            for a, b in lines:
                m_.add(c >= a * dp + b * r)
            self.y[o], self.dp[o], self.r[o], self.c[o] = y, dp, r, c
            self.lines[o] = lines
        for m in problem.models:
            mine = [o for o in self.options if o.model == m]
            for g in problem.gpus:
                same = [self.y[o] for o in mine if o.gpu == g]
                if len(same) > 1:
                    m_.add(sum(same) <= 1)
            served = m_.new_int_var(0, self.rate[m], f"served[{m}]")
            m_.add(served == sum(self.r[o] for o in mine))
            self.served[m] = served
            if need > 0:
                m_.add(sum(self.dp[o] for o in mine) >= need)
        for g in problem.gpus:
            m_.add(
                sum(o.gpus * self.dp[o] for o in self.options if o.gpu == g) <= problem.inventory[g]
            )
        # weighted max-min level: served[m] >= priority[m] * phi * rate[m] (priorities <= 1)
        self.phi = m_.new_int_var(0, PHI_SCALE, "phi")
        for m in problem.models:
            weight = max(1, round(problem.priority[m] * PRIORITY_SCALE))
            m_.add(PRIORITY_SCALE * PHI_SCALE * self.served[m] >= weight * self.rate[m] * self.phi)
        self.total_served = sum(self.served.values())
        self.total_cost = sum(self.c.values())
        self.all_vars = [self.phi, *self.served.values()]
        for o in self.options:
            self.all_vars += [self.y[o], self.dp[o], self.r[o], self.c[o]]

    def hint(self, problem: Problem, rows: State) -> None:
        """Hint a complete, feasible assignment derived from ``rows``."""
        values: dict[int, int] = {}
        phi = PHI_SCALE
        for m in problem.models:
            mine = rows.get(m, {})
            cost = problem.model_cost(m, mine)
            served_total = 0
            for o in self.options:
                if o.model != m:
                    continue
                tp, dp = mine.get(o.gpu, (0, 0))
                if tp != o.tp:
                    dp = 0
                share = o.capacity_rps * dp / cost.capacity_rps if dp else 0.0
                r = min(
                    math.floor(cost.served_rps * share * RATE_SCALE),
                    math.floor(self.problem.max_utilization * o.capacity_rps * RATE_SCALE) * dp,
                    self.rate[m],
                )
                c = self._least_c(o, dp, r)
                values[self.y[o].index] = 1 if dp else 0
                values[self.dp[o].index] = dp
                values[self.r[o].index] = r
                values[self.c[o].index] = c
                served_total += r
            served_total = min(served_total, self.rate[m])
            values[self.served[m].index] = served_total
            weight = max(1, round(problem.priority[m] * PRIORITY_SCALE))
            phi = min(phi, PRIORITY_SCALE * PHI_SCALE * served_total // (weight * self.rate[m]))
        values[self.phi.index] = phi
        self._set_hint(values)

    def _least_c(self, o: Option, dp: int, r: int) -> int:
        return max(0, *(a * dp + b * r for a, b in self.lines[o]))

    def _set_hint(self, values: dict[int, int]) -> None:
        self.model.clear_hints()
        for v in self.all_vars:
            if v.index in values:
                self.model.add_hint(v, values[v.index])

    def run(
        self,
        cp_model: Any,
        level: str,
        seconds: float,
        workers: int,
        seed: int,
        report: Callable[[str, float, float, str], None],
    ) -> tuple[PhaseStats, State | None, int]:
        if level == "fair":
            self.model.maximize(self.phi)
            scale = 1.0 / PHI_SCALE
        elif level == "served":
            self.model.maximize(self.total_served)
            scale = 1.0 / RATE_SCALE
        else:
            self.model.minimize(self.total_cost)
            scale = 1.0 / COST_SCALE
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.05, seconds)
        solver.parameters.num_workers = max(1, workers)
        solver.parameters.random_seed = seed
        callback = _callback(cp_model, level, scale, report)
        t0 = time.monotonic()
        status = solver.solve(self.model, callback)
        callback.reraise()
        name = solver.status_name(status)
        elapsed = time.monotonic() - t0
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            report(level, math.nan, math.nan, f"{name} after {elapsed:.2f}s")
            return PhaseStats(level, name, elapsed, math.nan, math.nan), None, 0
        objective = solver.objective_value
        bound = solver.best_objective_bound
        report(
            level,
            objective * scale,
            bound * scale,
            f"{name} in {elapsed:.2f}s: {objective * scale:.6g} (bound {bound * scale:.6g})",
        )
        values = {v.index: solver.value(v) for v in self.all_vars}
        for o in self.options:  # the next level starts from the least cost of this solution
            c = self._least_c(o, values[self.dp[o].index], values[self.r[o].index])
            values[self.c[o].index] = c
        self._set_hint(values)
        rows: State = {}
        for o in self.options:
            dp = values[self.dp[o].index]
            if dp > 0:
                rows.setdefault(o.model, {})[o.gpu] = (o.tp, dp)
        stats = PhaseStats(level, name, elapsed, objective * scale, bound * scale)
        return stats, rows, round(objective)

    def fix(self, level: str, value: int) -> None:
        """Keep the level at its best found value while the next levels optimise."""
        if level == "fair":
            self.model.add(self.phi >= value)
        elif level == "served":
            self.model.add(self.total_served >= value)


def _feasible(cp_model: Any, problem: Problem, need: int, workers: int, seed: int) -> bool:
    built = _Built(cp_model, problem, need)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 2.0
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = seed
    status = solver.solve(built.model)
    return bool(status in (cp_model.OPTIMAL, cp_model.FEASIBLE))


def _callback(
    cp_model: Any,
    phase: str,
    scale: float,
    report: Callable[[str, float, float, str], None],
) -> Any:
    """A CpSolverSolutionCallback that reports each improving solution and keeps the first
    exception ``report`` raised (``reraise`` after the solve)."""

    class Callback(cp_model.CpSolverSolutionCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.error: BaseException | None = None

        def on_solution_callback(self) -> None:
            if self.error is not None:
                return
            try:
                value = self.objective_value * scale
                bound = self.best_objective_bound * scale
                report(phase, value, bound, f"solution {value:.6g} (bound {bound:.6g})")
            except BaseException as exc:  # re-raised after the solve returns
                self.error = exc
                self.stop_search()

        def reraise(self) -> None:
            if self.error is not None:
                raise self.error

    return Callback()
