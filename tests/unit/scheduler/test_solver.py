"""Placement: the analytic cost, memP (paper Table 1), the exact DP optimum against brute force,
the CP-SAT solver (C1-C3 on every output, near the exact optimum) and ``plan``'s result.

CP-SAT runs with short time limits and at most two workers (the whole file takes seconds)."""

from __future__ import annotations

import itertools
import json
import math
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.analytic import estimate_placement
from scheduler.baselines import exact, memp
from scheduler.catalog import builtin_catalog
from scheduler.errors import SchedulerError, WorkloadError
from scheduler.objective import Problem, improves
from scheduler.placement import Allocation, Placement, check_placement
from scheduler.plan import plan
from scheduler.search import greedy, local_search
from scheduler.solver import Progress, hull_lines, solve
from scheduler.workload import Workload

CATALOG = builtin_catalog()

PAPER_INVENTORY = {"A100-80G": 24, "GH200": 32}


def paper_workloads(scale: float = 1.0) -> list[Workload]:
    """bench/placement.py's choice of lengths for the paper's instance."""
    return [
        Workload("llama-2-13b", 110 * scale, 850, 530, 850 / 3, 530 / 3),
        Workload("codellama-34b", 185.5 * scale, 1170, 64, 390, 64 / 3),
        Workload("llama-3.3-70b", 221 * scale, 600, 250, 200, 250 / 3),
    ]


def gpus_by_row(placement: Placement) -> dict[tuple[str, str], int]:
    return {(a.model, a.gpu): a.gpus for a in placement.allocations}


# -- memP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(600, 64), (1170, 530)])
def test_memp_reproduces_the_papers_table1_memp_row(lengths: tuple[int, int]) -> None:
    # Table 1, MemP: 13B 4xA100, 34B 16xA100, 70B 32xGH200 + 4xA100 (whatever the lengths:
    # memP looks at rates and parameter counts only)
    workloads = [
        Workload(m, rate, *lengths)
        for m, rate in (("llama-2-13b", 110), ("codellama-34b", 185.5), ("llama-3.3-70b", 221))
    ]
    placement = memp(Problem(PAPER_INVENTORY, workloads, CATALOG))
    assert gpus_by_row(placement) == {
        ("llama-2-13b", "A100-80G"): 4,
        ("codellama-34b", "A100-80G"): 16,
        ("llama-3.3-70b", "GH200"): 32,
        ("llama-3.3-70b", "A100-80G"): 4,
    }
    check_placement(placement, PAPER_INVENTORY, CATALOG, workloads)


def test_memp_splits_in_whole_nodes_by_rate_times_size_and_fills_leftovers() -> None:
    # two equal 7B demands on 2 nodes of 8: one node each; the 16 GPUs are all used
    workloads = [Workload("llama-2-7b", 10, 500, 100), Workload("llama-3.1-8b", 8.6, 500, 100)]
    placement = memp(Problem({"A100-80G": 16}, workloads, CATALOG))
    assert sum(a.gpus for a in placement.for_model("llama-2-7b")) == 8
    assert sum(a.gpus for a in placement.for_model("llama-3.1-8b")) == 8


# -- the cost model ---------------------------------------------------------------------------


def test_cost_of_a_stable_placement_is_estimate_placements_prediction() -> None:
    workloads = paper_workloads(0.1)
    problem = Problem(PAPER_INVENTORY, workloads, CATALOG)
    placement = Placement.of(
        [
            Allocation("llama-2-13b", "A100-80G", 2, 4),
            Allocation("codellama-34b", "GH200", 1, 8),
            Allocation("llama-3.3-70b", "GH200", 2, 8),
            Allocation("llama-3.3-70b", "A100-80G", 4, 2),
        ]
    )
    cost = problem.cost(placement)
    predicted = estimate_placement(placement, workloads, CATALOG)
    assert predicted.stable and cost.unserved_rps == 0
    assert cost.e2e_s == pytest.approx(predicted.e2e_s, rel=1e-9)
    assert cost.served_rps == pytest.approx(predicted.throughput_rps)


def test_linearisation_lines_stay_within_tolerance_above_the_convex_hull() -> None:
    problem = Problem(PAPER_INVENTORY, paper_workloads(0.25), CATALOG)
    for options in problem.options.values():
        for o in options:
            lines = hull_lines(o, problem.max_utilization)
            top = problem.max_utilization * o.capacity_rps
            for p in o.table.points:
                if p.rate_rps > top:
                    continue
                value = max(a + b * p.rate_rps for a, b in lines)
                assert value <= p.rate_rps * p.e2e_s * 1.01 + 1e-9  # within 1% (or below)
            # at zero load and at the headroom limit the curve is exact
            assert max(a for a, _ in lines) == pytest.approx(0.0, abs=1e-9)
            end = top * o.table.e2e_s(top)
            assert max(a + b * top for a, b in lines) == pytest.approx(end, rel=1e-9)


# -- exact optimum vs brute force ---------------------------------------------------------------


def brute_force(problem: Problem, mode: str) -> tuple[float, ...]:
    """The best key over every placement (C1, C3, min_replicas), by enumeration."""
    Rows = dict[str, tuple[int, int]]
    per_model: list[list[Rows]] = []
    for m in problem.models:
        per_gpu: list[list[tuple[int, int] | None]] = []
        for g in problem.gpus:
            choices: list[tuple[int, int] | None] = [None]
            for o in problem.options[m]:
                if o.gpu == g:
                    choices += [(o.tp, dp) for dp in range(1, problem.inventory[g] // o.tp + 1)]
            per_gpu.append(choices)
        model_rows: list[Rows] = []
        for picks in itertools.product(*per_gpu):
            model_rows.append(
                {g: c for g, c in zip(problem.gpus, picks, strict=True) if c is not None}
            )
        per_model.append(model_rows)
    best: tuple[float, ...] | None = None
    for placement in itertools.product(*per_model):
        used = dict.fromkeys(problem.gpus, 0)
        for rows in placement:
            for g, (tp, dp) in rows.items():
                used[g] += tp * dp
        if any(used[g] > problem.inventory[g] for g in problem.gpus):
            continue
        if any(sum(dp for _, dp in rows.values()) < problem.min_replicas for rows in placement):
            continue
        key = problem.cost(dict(zip(problem.models, placement, strict=True)), mode).key
        if best is None or improves(key, best):
            best = key
    assert best is not None
    return best


TINY = [
    # (inventory, workloads): some fit, some overload, mixed TP options
    (
        {"A100-80G": 4, "L40S": 3},
        [Workload("llama-2-13b", 6, 800, 200, 200, 60), Workload("llama-3.1-8b", 9, 600, 300)],
    ),
    (
        {"H100-SXM": 2, "A100-40G": 4},
        [
            Workload("llama-2-7b", 30, 500, 100),
            Workload("codellama-34b", 3, 1200, 64),
            Workload("qwen2.5-7b", 4, 2000, 150),
        ],
    ),
    (
        {"GH200": 4, "RTX-4090": 4},
        [Workload("llama-3.3-70b", 0.5, 600, 250), Workload("llama-2-13b", 2, 850, 530)],
    ),
]


@pytest.mark.parametrize("case", range(len(TINY)))
@pytest.mark.parametrize("mode", ["latency", "fair"])
def test_exact_optimum_equals_brute_force_on_tiny_instances(case: int, mode: str) -> None:
    inventory, workloads = TINY[case]
    problem = Problem(inventory, workloads, CATALOG)
    result = exact(problem, mode)
    check_placement(result.placement, inventory, CATALOG, workloads)
    want = brute_force(problem, mode)
    assert result.cost.key == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_exact_refuses_an_intractable_instance_in_one_line() -> None:
    inventory = {"A100-80G": 64, "H100-SXM": 64, "L40S": 64, "GH200": 64}
    problem = Problem(inventory, [Workload("llama-2-7b", 1, 500, 100)], CATALOG)
    with pytest.raises(SchedulerError, match="intractable") as info:
        exact(problem)
    assert "\n" not in str(info.value)


# -- the CP-SAT solver ------------------------------------------------------------------------

MODELS = ["llama-2-7b", "llama-2-13b", "codellama-34b", "mixtral-8x7b", "llama-3.3-70b"]
GPUS = ["A100-80G", "A100-40G", "H100-SXM", "L40S", "RTX-3090", "GH200"]


@st.composite
def instances(draw: st.DrawFn) -> tuple[dict[str, int], list[Workload]]:
    gpus = draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=3, unique=True))
    inventory = {g: draw(st.integers(0, 12)) for g in gpus}
    models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True))
    workloads = [
        Workload(
            m,
            draw(st.sampled_from([0.0, 0.5, 3.0, 20.0])),
            draw(st.sampled_from([300, 1000])),
            draw(st.sampled_from([64, 400])),
            100,
            30,
        )
        for m in models
    ]
    return inventory, workloads


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(instances(), st.sampled_from(["latency", "fair"]))
def test_every_solver_output_satisfies_c1_c2_c3(
    instance: tuple[dict[str, int], list[Workload]], mode: str
) -> None:
    inventory, workloads = instance
    problem = Problem(inventory, workloads, CATALOG)
    solution = solve(problem, mode, time_limit_s=0.5, num_workers=1)
    check_placement(solution.placement, inventory, CATALOG, workloads)
    placed = {a.model for a in solution.placement.allocations}
    assert not placed & {u.model for u in problem.unservable}
    assert not placed - set(problem.models)  # no GPUs for models without traffic
    # and the greedy hint and its polish are valid placements too
    hint = problem.placement(greedy(problem, mode))
    check_placement(hint, inventory, CATALOG, workloads)
    polished, _ = local_search(problem, greedy(problem, mode), mode)
    check_placement(problem.placement(polished), inventory, CATALOG, workloads)
    assert not improves(problem.cost(hint, mode).key, solution.cost.key)


SMALL_THREE_TYPE = [
    (
        {"A100-80G": 12, "H100-SXM": 8, "L40S": 8},
        [
            Workload("llama-2-7b", 20, 600, 200, 200, 60),
            Workload("llama-2-13b", 10, 850, 300, 280, 100),
            Workload("codellama-34b", 4, 1170, 64, 390, 20),
            Workload("llama-3.3-70b", 3, 600, 250, 200, 80),
        ],
    ),
    (
        {"A100-40G": 16, "GH200": 8, "RTX-4090": 8},
        [
            Workload("llama-3.1-8b", 40, 800, 300, 260, 100),
            Workload("mixtral-8x7b", 15, 1000, 300, 330, 100),
            Workload("qwen2.5-7b", 20, 2000, 150, 600, 50),
        ],
    ),
]


@pytest.mark.parametrize("case", range(len(SMALL_THREE_TYPE)))
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_solver_is_within_5_percent_of_the_exact_optimum_on_three_types(
    case: int, scale: float
) -> None:
    inventory, base = SMALL_THREE_TYPE[case]
    workloads = [w.scaled(scale) for w in base]
    problem = Problem(inventory, workloads, CATALOG)
    best = exact(problem).cost
    got = solve(problem, time_limit_s=2.0, num_workers=2).cost
    assert got.served_rps >= best.served_rps * 0.95
    if best.unserved_rps <= 1e-9:
        assert got.unserved_rps <= 1e-6
        assert got.in_system <= best.in_system * 1.05


def test_solver_matches_the_exact_optimum_on_the_papers_instance() -> None:
    for scale in (1.0, 0.25):
        problem = Problem(PAPER_INVENTORY, paper_workloads(scale), CATALOG)
        got = solve(problem, time_limit_s=3.0, num_workers=2)
        best = exact(problem)
        assert got.cost.key == pytest.approx(best.cost.key, rel=1e-6)


def test_overload_is_solved_throughput_first_and_fair_mode_raises_the_smallest_share() -> None:
    problem = Problem(PAPER_INVENTORY, paper_workloads(), CATALOG)
    throughput = solve(problem, "latency", time_limit_s=2.0, num_workers=2).cost
    fair = solve(problem, "fair", time_limit_s=2.0, num_workers=2).cost
    base = problem.cost(memp(problem))
    assert throughput.unserved_rps > 0  # ~3x overloaded
    assert throughput.served_rps >= 1.3 * base.served_rps
    assert fair.min_fraction > 2 * throughput.min_fraction
    assert fair.min_fraction > 2 * base.min_fraction
    assert all(m.replicas >= 1 for m in throughput.models)  # no model is dropped


def test_progress_reports_every_phase_and_a_failing_callback_propagates() -> None:
    problem = Problem(PAPER_INVENTORY, paper_workloads(0.25), CATALOG)
    seen: list[Progress] = []
    solve(problem, "fair", time_limit_s=2.0, num_workers=1, progress=seen.append)
    phases = [p.phase for p in seen]
    assert phases[0] == "greedy" and phases[-1] == "done"
    assert {"fair", "served", "latency"} <= set(phases)
    assert all(b.elapsed_s >= a.elapsed_s for a, b in itertools.pairwise(seen))

    class Boom(Exception):
        pass

    def fail(p: Progress) -> None:
        if p.phase == "served":
            raise Boom

    with pytest.raises(Boom):
        solve(problem, time_limit_s=2.0, num_workers=1, progress=fail)


def test_without_ortools_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "ortools" or m.startswith("ortools.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ortools", None)
    problem = Problem({"A100-80G": 2}, [Workload("llama-2-7b", 1, 500, 100)], CATALOG)
    with pytest.raises(SchedulerError, match=r"fabricnode\[scheduler\]"):
        solve(problem, time_limit_s=1.0)


# -- plan ---------------------------------------------------------------------------------------


def test_plan_reports_a_model_no_gpu_can_hold_and_places_the_others() -> None:
    workloads = [Workload("llama-3.3-70b", 1, 600, 250), Workload("llama-2-7b", 2, 600, 200)]
    result = plan({"RTX-3090": 2}, workloads, time_limit_s=1.0, num_workers=1)
    assert [u.model for u in result.unservable] == ["llama-3.3-70b"]
    assert "RTX-3090" in result.unservable[0].reasons[0]
    assert any("llama-3.3-70b cannot be served" in n for n in result.notes)
    assert {a.model for a in result.placement.allocations} == {"llama-2-7b"}
    doc = result.to_json()
    assert doc["unservable"][0]["model"] == "llama-3.3-70b"  # type: ignore[index]


def test_plan_json_has_the_spec_shape_and_no_infinities() -> None:
    result = plan(PAPER_INVENTORY, paper_workloads(), time_limit_s=2.0, num_workers=2)
    doc = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert {"allocations", "predicted", "memp", "notes", "unservable", "mode"} <= set(doc)
    for row in doc["allocations"]:
        assert set(row) == {"model", "gpu", "pool", "gpus", "tp", "dp", "nodes"}
        assert row["gpus"] == row["tp"] * row["dp"]
    assert {(r["model"], r["gpu"]): r["gpus"] for r in doc["memp"]["allocations"]} == {
        ("llama-2-13b", "A100-80G"): 4,
        ("codellama-34b", "A100-80G"): 16,
        ("llama-3.3-70b", "GH200"): 32,
        ("llama-3.3-70b", "A100-80G"): 4,
    }
    assert doc["predicted"]["throughput_rps"] > doc["memp"]["predicted"]["throughput_rps"]
    # fair by default: the overload is one line, with every model's share
    assert doc["mode"] == "fair"
    line = doc["overload"]
    assert isinstance(line, str) and line.startswith("overloaded: ")
    for model in ("llama-2-13b", "codellama-34b", "llama-3.3-70b"):
        assert model in line


def test_plan_drops_min_replicas_with_a_note_when_gpus_are_too_few() -> None:
    workloads = [Workload(m, 1, 500, 100) for m in ("llama-2-7b", "llama-3.1-8b", "qwen2.5-7b")]
    result = plan({"A100-80G": 2}, workloads, time_limit_s=1.0, num_workers=1)
    assert any("requirement dropped" in n for n in result.notes)
    assert sum(a.gpus for a in result.placement.allocations) == 2


def test_plan_rejects_unknown_modes_and_solvers() -> None:
    with pytest.raises(WorkloadError, match="mode"):
        plan({"A100-80G": 1}, [Workload("llama-2-7b", 1, 10, 10)], mode="fastest")
    with pytest.raises(SchedulerError, match="solver"):
        plan({"A100-80G": 1}, [Workload("llama-2-7b", 1, 10, 10)], solver="magic")


@pytest.mark.parametrize("solver", ["exact", "greedy"])
def test_plan_with_the_other_solvers(solver: str) -> None:
    result = plan(PAPER_INVENTORY, paper_workloads(0.25), solver=solver, time_limit_s=2.0)
    assert result.solver.name == solver
    assert result.predicted.served_rps == pytest.approx(result.predicted.offered_rps)
    assert math.isfinite(result.predicted.e2e_s)
