"""Placement quality: memP vs the planner's modes vs the exact optima, judged by the DES.

CPU only, one process. For each instance and rate scale the bench builds the problem (analytic
tables), places it several ways and runs the discrete-event simulator (``scheduler.des``) on
each placement with the same seeded requests:

  memP       paper §5's memory-proportional heuristic (``scheduler.baselines.memp``)
  default    ``scheduler.plan`` as ``fabric plan`` runs it: mode ``fair`` (max-min served share
             first, then served req/s, then latency; Eq. 1 when everything fits), CP-SAT,
             ``--time-limit`` seconds, ``--workers`` workers
  latency    mode ``latency`` (Eq. 1 when everything fits, served req/s first when it does not)
  throughput mode ``throughput`` (the same objective as latency; the names differ in what a
             plan reports)
  max-min    the exact max-min optimum (``baselines.exact`` in mode ``fair``: DP over the same
             analytic cost), where tractable (<= 3 GPU types)
  mm-0.9     overloaded only: the exact plan serving the most req/s while every model keeps
             0.9x the max-min level (``fair_slack=0.9``): the most throughput any plan meeting
             the min-share target can have
  exact-eq1  the exact optimum of mode ``latency``, likewise

Instances (lengths: normal, std = mean / 3, clipped to [1, context - 1]):

  paper    24 A100-80G + 32 GH200 (paper §5 / Table 1). Llama-2-13B at 110 req/s, input 850,
           output 530 (chat); CodeLlama-34B at 185.5 req/s, input 1170, output 64 (code
           completion: long prompt, short answer); Llama-3.3-70B at 221 req/s, input 600,
           output 250. Inputs span the paper's ~600-1170, outputs its 64-530.
  mixed10  10 models x 6 GPU types: 16 H100-SXM, 32 A100-80G, 32 A100-40G, 16 L40S, 32 RTX-4090,
           8 MI300X; 1530 req/s in total (see MIXED10).

Rate scales: 1.0 (the full rates; both clusters are ~3x overloaded: the best fractional
allocation serves at most ~33% / ~35% of them) and 0.25 (a good placement fits with headroom).

Columns: solve s (placement time after the tables were built), GPUs used, predicted throughput
and mean E2E (analytic), then DES throughput (completions per second in the measured window),
output tok/s, mean / P90 E2E (mean over completed requests; P90 counts unfinished requests as
infinite), completed fraction (of the requests that arrived in the window), served E2E (mean
over the requests that completed in the window, whenever they arrived: what was served, queueing
included, the only latency an overloaded run has) and the smallest served share of a model (its
DES completions per second over its offered rate). A per-model table follows: DES share, served
E2E, analytic share. Targets: overloaded
(x1), the default's min share >= 0.9x the max-min optimum's and DES throughput >= 1.25x memP's;
fitting (x0.25), everything served, >= 1.5x lower mean E2E than memP and within 5% of the
exact Eq. 1 optimum (analytic); solve <= 15 s on 2 cores.

    .venv/bin/python bench/placement.py                       # ~3 min on 2 cores
    .venv/bin/python bench/placement.py --quick               # shorter DES, 3 s solver limit
    .venv/bin/python bench/placement.py --instances paper --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduler.baselines import exact, exact_work, memp
from scheduler.catalog import builtin_catalog
from scheduler.des import SimConfig, SimResult, simulate
from scheduler.errors import SchedulerError
from scheduler.objective import MODES, Cost, Problem
from scheduler.placement import Placement
from scheduler.plan import PlanResult, plan_problem
from scheduler.workload import Workload

CATALOG = builtin_catalog()
DEFAULT_MODE = "fair"  # what ``fabric plan`` does without --mode


def _w(model: str, rate: float, inp: float, out: float) -> Workload:
    return Workload(model, rate, inp, out, inp / 3, out / 3)


PAPER_INVENTORY = {"A100-80G": 24, "GH200": 32}
PAPER = [
    _w("llama-2-13b", 110.0, 850, 530),
    _w("codellama-34b", 185.5, 1170, 64),
    _w("llama-3.3-70b", 221.0, 600, 250),
]
MIXED10_INVENTORY = {
    "H100-SXM": 16,
    "A100-80G": 32,
    "A100-40G": 32,
    "L40S": 16,
    "RTX-4090": 32,
    "MI300X": 8,
}
MIXED10 = [
    _w("llama-2-7b", 240, 600, 200),
    _w("llama-3.1-8b", 360, 800, 300),
    _w("qwen2.5-7b", 180, 2000, 150),
    _w("mixtral-8x7b", 120, 1000, 300),
    _w("qwen3-30b-a3b", 150, 1200, 400),
    _w("llama-2-13b", 150, 600, 128),
    _w("codellama-34b", 120, 1170, 64),
    _w("llama-2-70b", 30, 500, 200),
    _w("llama-3.3-70b", 120, 850, 250),
    _w("qwen2.5-72b", 60, 1000, 300),
]
INSTANCES = {
    "paper": (PAPER_INVENTORY, PAPER),
    "mixed10": (MIXED10_INVENTORY, MIXED10),
}
# Table 1 of the paper, MemP row: GPUs per model and type
TABLE1_MEMP = {
    ("llama-2-13b", "A100-80G"): 4,
    ("codellama-34b", "A100-80G"): 16,
    ("llama-3.3-70b", "GH200"): 32,
    ("llama-3.3-70b", "A100-80G"): 4,
}


@dataclass
class Row:
    method: str
    placement: Placement
    solve_s: float
    cost: Cost
    sim: SimResult | None = None


def describe(placement: Placement) -> str:
    parts = []
    for model in sorted({a.model for a in placement.allocations}):
        rows = [f"{a.gpus}x{a.gpu}(tp{a.tp})" for a in placement.for_model(model)]
        parts.append(f"{model}: " + " + ".join(rows))
    return "; ".join(parts)


def fmt(value: float, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def run_cell(
    name: str,
    scale: float,
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, object]:
    inventory, base = INSTANCES[name]
    workloads = [w.scaled(scale) for w in base]
    t0 = time.monotonic()
    problem = Problem(inventory, workloads, CATALOG)
    tables_s = time.monotonic() - t0

    def planned(mode: str) -> tuple[Row, PlanResult]:
        result = plan_problem(
            problem,
            mode=mode,
            time_limit_s=args.time_limit,
            num_workers=args.workers,
            seed=args.seed,
            tables_s=tables_s,
        )
        label = "default" if mode == DEFAULT_MODE else mode
        row = Row(label, result.placement, result.solver.seconds, problem.cost(result.placement))
        return row, result

    default_row, result = planned(DEFAULT_MODE)
    wall = time.monotonic() - t0
    t1 = time.monotonic()
    base_placement = memp(problem)
    rows = [Row("memP", base_placement, time.monotonic() - t1, problem.cost(base_placement))]
    rows.append(default_row)
    rows += [planned(mode)[0] for mode in MODES if mode != DEFAULT_MODE]
    exact_note = ""
    if len(problem.gpus) <= 3:
        try:
            for mode, label, slack in (
                ("fair", "max-min", 1.0),
                ("fair", "mm-0.9", 0.9),
                ("latency", "exact-eq1", 1.0),
            ):
                if slack < 1 and problem.cost(rows[1].placement).unserved_rps <= 1e-9:
                    continue  # everything served: the same as max-min
                ex = exact(problem, mode, fair_slack=slack)
                rows.append(Row(label, ex.placement, ex.seconds, ex.cost))
        except SchedulerError as exc:
            exact_note = str(exc)
    else:
        exact_note = (
            f"exact skipped: {len(problem.gpus)} GPU types ({exact_work(problem):.1e} steps)"
        )
    total_rate = sum(w.rate_rps for w in workloads)
    say(
        f"\n== {name} x{scale:g}: {sum(problem.inventory.values())} GPUs, "
        f"{len(workloads)} models, {total_rate:.1f} req/s; tables {result.solver.tables_s:.2f}s, "
        f"default plan() {wall:.2f}s"
    )
    if result.overload:
        say(f"   {result.overload}")
    for note in result.notes:
        if not note.startswith("overloaded"):
            say(f"   note: {note}")
    levels = "; ".join(
        f"{p.phase} {p.status} in {p.seconds:.2f}s: {p.objective:.4g} (bound {p.bound:.4g})"
        for p in result.solver.phases
    )
    say(f"   CP-SAT (linearised model): {levels}")
    if exact_note:
        say(f"   {exact_note}")
    cfg = SimConfig(
        duration_s=args.duration, warmup_s=args.warmup, drain_s=args.drain, seed=args.seed
    )
    for row in rows:
        row.sim = simulate(row.placement, workloads, CATALOG, cfg)
    head = (
        f"   {'method':10} {'solve s':>8} {'GPUs':>5} {'pred req/s':>10} {'pred E2E':>8} "
        f"{'DES req/s':>9} {'tok/s':>8} {'E2E mean':>8} {'E2E P90':>8} {'done':>6} "
        f"{'served E2E':>10} {'min share':>9}"
    )
    say(head)
    for row in rows:
        assert row.sim is not None
        t = row.sim.total
        say(
            f"   {row.method:10} {fmt(row.solve_s):>8} "
            f"{sum(row.placement.gpus_used().values()):>5} "
            f"{fmt(row.cost.served_rps, 1):>10} {fmt(row.cost.e2e_s):>8} "
            f"{fmt(t.throughput_rps, 1):>9} {fmt(t.output_tokens_per_s, 0):>8} "
            f"{fmt(t.e2e_mean_s):>8} {fmt(t.e2e_p90_s):>8} {fmt(t.completed_fraction, 3):>6} "
            f"{fmt(t.served_e2e_mean_s):>10} {fmt(min_share(row, workloads), 3):>9}"
        )
    say("   per model: DES served share (completions in the window / offered rate), mean E2E of")
    say("   those completions (s; queueing included), analytic share in brackets")
    models = [w.model for w in workloads]
    say("   " + f"{'method':10} " + " ".join(f"{m[:22]:>24}" for m in models))
    for row in rows:
        assert row.sim is not None
        cells = []
        for w in workloads:
            sim = row.sim.model(w.model)
            mc = next(c for c in row.cost.models if c.model == w.model)
            cells.append(
                f"{sim.throughput_rps / w.rate_rps:5.2f} {fmt(sim.served_e2e_mean_s, 1):>6}s "
                f"({mc.fraction:4.2f})"
            )
        say("   " + f"{row.method:10} " + " ".join(f"{c:>24}" for c in cells))
    for row in rows:
        say(f"   {row.method}: {describe(row.placement)}")
    by = {r.method: r for r in rows}
    ours, base_row = by["default"], by["memP"]
    assert ours.sim is not None and base_row.sim is not None
    out: dict[str, object] = {
        "instance": name,
        "scale": scale,
        "offered_rps": total_rate,
        "overload": result.overload,
        "notes": list(result.notes),
        "solver": result.solver.to_json(),
        "methods": {
            r.method: {
                "placement": [
                    {"model": a.model, "gpu": a.gpu, "tp": a.tp, "dp": a.dp}
                    for a in r.placement.allocations
                ],
                "solve_s": r.solve_s,
                "predicted_rps": r.cost.served_rps,
                "predicted_e2e_s": r.cost.e2e_s,
                "predicted_min_share": r.cost.min_fraction,
                "des": {
                    "throughput_rps": r.sim.total.throughput_rps if r.sim else None,
                    "output_tokens_per_s": r.sim.total.output_tokens_per_s if r.sim else None,
                    "e2e_mean_s": r.sim.total.e2e_mean_s if r.sim else None,
                    "e2e_p90_s": r.sim.total.e2e_p90_s if r.sim else None,
                    "completed_fraction": r.sim.total.completed_fraction if r.sim else None,
                    "min_share": min_share(r, workloads),
                    "models": {
                        w.model: {
                            "share": r.sim.model(w.model).throughput_rps / w.rate_rps,
                            "e2e_mean_s": r.sim.model(w.model).e2e_mean_s,
                            "served_e2e_mean_s": r.sim.model(w.model).served_e2e_mean_s,
                        }
                        for w in workloads
                    }
                    if r.sim
                    else None,
                },
            }
            for r in rows
        },
    }
    thr = ours.sim.total.throughput_rps / max(base_row.sim.total.throughput_rps, 1e-9)
    e2e = base_row.sim.total.e2e_mean_s / ours.sim.total.e2e_mean_s
    say(
        f"   default vs memP (DES): throughput {thr:.2f}x, mean E2E {e2e:.2f}x lower, "
        f"completed {ours.sim.total.completed_fraction:.3f} vs "
        f"{base_row.sim.total.completed_fraction:.3f}, min share "
        f"{min_share(ours, workloads):.3f} vs {min_share(base_row, workloads):.3f}"
    )
    out["throughput_ratio"] = thr
    out["token_ratio"] = ours.sim.total.output_tokens_per_s / max(
        base_row.sim.total.output_tokens_per_s, 1e-9
    )
    if "mm-0.9" in by and by["mm-0.9"].sim is not None:
        out["ceiling_ratio"] = by["mm-0.9"].sim.total.throughput_rps / max(
            base_row.sim.total.throughput_rps, 1e-9
        )
    out["e2e_ratio"] = e2e
    out["min_share"] = min_share(ours, workloads)
    out["completed"] = ours.sim.total.completed_fraction
    if "max-min" in by:
        opt = by["max-min"]
        out["maxmin_share"] = min_share(opt, workloads)
        out["maxmin_share_analytic"] = opt.cost.min_fraction
        out["min_share_analytic"] = ours.cost.min_fraction
        say(
            f"   default vs max-min optimum: min share {out['min_share']:.3f} vs "
            f"{out['maxmin_share']:.3f} (DES), {ours.cost.min_fraction:.3f} vs "
            f"{opt.cost.min_fraction:.3f} (analytic)"
        )
    if "exact-eq1" in by and result.overload is None:
        ex_row = by["exact-eq1"]
        gap = ours.cost.in_system / ex_row.cost.in_system - 1
        say(f"   default vs exact (analytic): {gap * 100:+.2f}% on requests in system")
        out["exact_gap"] = gap
    out["solve_s"] = max(r.solve_s for r in rows if r.method in ("default", *MODES))
    return out


def min_share(row: Row, workloads: list[Workload]) -> float:
    """The smallest DES served share (completions per second / offered rate) over models."""
    assert row.sim is not None
    return min(row.sim.model(w.model).throughput_rps / w.rate_rps for w in workloads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--instances", default="paper,mixed10")
    parser.add_argument("--scales", default="1,0.25")
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    parser.add_argument("--duration", type=float, default=300.0, help="DES arrivals, s")
    parser.add_argument("--warmup", type=float, default=150.0, help="DES warm-up, s")
    parser.add_argument("--drain", type=float, default=60.0, help="DES drain, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="120 s DES, 3 s solver limit")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup, args.time_limit = 120.0, 40.0, 3.0
    names = [n.strip() for n in args.instances.split(",") if n.strip()]
    for n in names:
        if n not in INSTANCES:
            parser.error(f"unknown instance {n!r} (known: {', '.join(INSTANCES)})")
    scales = [float(s) for s in args.scales.split(",")]
    started = time.monotonic()
    say = print
    say(
        f"bench/placement: solver limit {args.time_limit:g}s x {args.workers} workers; DES "
        f"{args.duration:g}s of arrivals, {args.warmup:g}s warm-up, drain {args.drain:g}s"
    )
    if "paper" in names:
        problem = Problem(PAPER_INVENTORY, PAPER, CATALOG)
        got = {(a.model, a.gpu): a.gpus for a in memp(problem).allocations}
        match = "matches" if got == TABLE1_MEMP else f"DIFFERS from {TABLE1_MEMP}"
        say(f"memP on the paper's instance: {got} — {match} Table 1's MemP row")
    cells = [run_cell(n, s, args, say) for n in names for s in scales]
    say("\n== targets (judged by the DES)")
    for c in cells:
        name, scale = c["instance"], c["scale"]
        solve_s = float(c["solve_s"])  # type: ignore[arg-type]
        line = f"   {name} x{scale:g}: solve {solve_s:.1f}s {'ok' if solve_s <= 15 else 'MISSED'}"
        thr = float(c["throughput_ratio"])  # type: ignore[arg-type]
        if c["overload"]:
            tok = float(c["token_ratio"])  # type: ignore[arg-type]
            line += (
                f"; throughput {tok:.2f}x memP in output tok/s (>= 1.25x: "
                f"{'ok' if tok >= 1.25 else 'MISSED'}), {thr:.2f}x in req/s"
            )
            if "ceiling_ratio" in c:
                ceiling = float(c["ceiling_ratio"])  # type: ignore[arg-type]
                line += f" (mm-0.9, the most any plan meeting the share target has: {ceiling:.2f}x)"
            if "maxmin_share" in c:
                got, best = float(c["min_share"]), float(c["maxmin_share"])  # type: ignore[arg-type]
                ok = got >= 0.9 * best
                line += (
                    f"; min share {got:.3f} vs max-min {best:.3f} "
                    f"(>= 0.9x: {'ok' if ok else 'MISSED'})"
                )
        else:
            e2e = float(c["e2e_ratio"])  # type: ignore[arg-type]
            done = float(c["completed"])  # type: ignore[arg-type]
            line += (
                f"; all served (completed {done:.3f}); mean E2E {e2e:.2f}x lower than memP "
                f"(>= 1.5x: {'ok' if e2e >= 1.5 else 'MISSED'})"
            )
            if "exact_gap" in c:
                gap = float(c["exact_gap"])  # type: ignore[arg-type]
                line += f"; vs exact {gap * 100:+.2f}% (<= 5%: {'ok' if gap <= 0.05 else 'MISSED'})"
        say(line)
    say(f"\ntotal {time.monotonic() - started:.1f}s")
    if args.json:
        args.json.write_text(json.dumps(cells, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
