"""Serving models: the analytic steady state (the solver's tables) and the discrete-event
simulator of continuous batching, against the roofline and against each other."""

from __future__ import annotations

import math
import time

import pytest

from scheduler.analytic import (
    estimate_placement,
    max_rate,
    replica_table,
    replica_tables,
    steady_state,
)
from scheduler.catalog import builtin_catalog
from scheduler.des import Request, SimConfig, generate_requests, simulate, simulate_requests
from scheduler.placement import Allocation, Placement
from scheduler.replica import ReplicaPerf
from scheduler.workload import Workload

CATALOG = builtin_catalog()


def perf(model: str, gpu: str, tp: int = 1) -> ReplicaPerf:
    return ReplicaPerf(CATALOG.model(model), CATALOG.gpu(gpu), tp)


def one(model: str, gpu: str, tp: int = 1, dp: int = 1) -> Placement:
    return Placement.of([Allocation(model, gpu, tp, dp)])


# -- DES mechanics ----------------------------------------------------------------------------


def test_a_lone_request_takes_one_prefill_then_one_decode_iteration_per_token() -> None:
    p = perf("llama-2-7b", "H100")
    result = simulate_requests(
        one("llama-2-7b", "H100"),
        [Request(0.0, "llama-2-7b", 1000, 200)],
        CATALOG,
        SimConfig(duration_s=1, warmup_s=0, drain_s=60),
    )
    assert result.total.ttft_mean_s == pytest.approx(p.step.prefill_time(1000), rel=1e-12)
    assert result.total.e2e_mean_s == pytest.approx(p.step.request_latency(1000, 200), rel=1e-12)
    assert result.steps == 200


def test_concurrent_requests_share_iterations() -> None:
    p = perf("llama-2-7b", "H100")
    alone = p.step.request_latency(500, 300)
    result = simulate_requests(
        one("llama-2-7b", "H100"),
        [Request(0.0, "llama-2-7b", 500, 300) for _ in range(8)],
        CATALOG,
        SimConfig(duration_s=1, warmup_s=0, drain_s=60),
    )
    assert result.total.completed == 8
    assert result.end_s < 2 * alone  # eight requests in much less than 8x one


def test_same_seed_same_result_and_another_seed_differs() -> None:
    workloads = [Workload("llama-2-13b", 6, 600, 200, 200, 60)]
    placement = one("llama-2-13b", "A100-80G", 1, 2)
    cfg = SimConfig(duration_s=120, warmup_s=10, seed=7)
    first = simulate(placement, workloads, CATALOG, cfg)
    assert simulate(placement, workloads, CATALOG, cfg) == first
    other = simulate(placement, workloads, CATALOG, SimConfig(duration_s=120, warmup_s=10, seed=8))
    assert other.total.e2e_mean_s != first.total.e2e_mean_s


def test_adding_a_model_does_not_change_another_models_requests() -> None:
    a = Workload("llama-2-13b", 5, 600, 200, 100, 50)
    b = Workload("codellama-34b", 3, 1000, 100)
    alone = generate_requests([a], CATALOG, 60, seed=1)
    both = generate_requests([a, b], CATALOG, 60, seed=1)
    assert [r for r in both if r.model == "llama-2-13b"] == alone


def test_overload_reports_unfinished_requests_instead_of_hiding_them() -> None:
    p = perf("llama-2-13b", "A100-80G")
    w = Workload("llama-2-13b", 1, 600, 200, 200, 60)
    capacity = max_rate(p, w.lengths(4096))
    result = simulate(
        one("llama-2-13b", "A100-80G"),
        [w.scaled(2 * capacity)],
        CATALOG,
        SimConfig(duration_s=600, warmup_s=200, drain_s=30),
    ).total
    assert result.completed_fraction < 0.6
    assert result.e2e_p90_s == math.inf and result.e2e_p50_s == math.inf
    # the replica still works at capacity, and the analytic model knows that capacity
    assert result.throughput_rps == pytest.approx(capacity, rel=0.05)


def test_requests_that_cannot_fit_any_replica_are_rejected_and_counted() -> None:
    catalog = CATALOG.merged(
        '[gpus."small-16G"]\nvendor = "x"\nmemory_gb = 16\nbf16_tflops = 100\n'
        'memory_bw_gbs = 500\nlink = "PCIe"\nlink_gbs = 16\nlink_latency_us = 3\n'
        "gpus_per_node = 1\n",
        "test",
    )
    kv = ReplicaPerf(catalog.model("llama-2-7b"), catalog.gpu("small-16G"), 1).kv_capacity_tokens
    assert 500 < kv < 1000
    result = simulate(
        Placement.of([Allocation("llama-2-7b", "small-16G", 1, 1)]),
        [Workload("llama-2-7b", 0.5, 600, 100, 300)],
        catalog,
        SimConfig(duration_s=200, warmup_s=0),
    ).total
    assert result.rejected > 0.2 * result.arrived
    assert result.completed == result.arrived - result.rejected
    assert result.completed_fraction == pytest.approx(result.completed / result.arrived)


def test_a_model_without_replicas_completes_nothing() -> None:
    result = simulate(
        one("llama-2-13b", "A100-80G"),
        [Workload("llama-2-13b", 1, 600, 100), Workload("llama-2-7b", 2, 600, 100)],
        CATALOG,
        SimConfig(duration_s=60, warmup_s=0),
    )
    orphan = result.model("llama-2-7b")
    assert orphan.arrived > 60 and orphan.rejected == orphan.arrived
    assert orphan.completed_fraction == 0.0 and orphan.e2e_p90_s == math.inf
    assert result.total.completed_fraction < 0.8


def test_least_loaded_routing_favours_the_faster_replicas() -> None:
    placement = Placement.of(
        [Allocation("llama-2-13b", "GH200", 1, 1), Allocation("llama-2-13b", "RTX-3090", 2, 1)]
    )
    w = Workload("llama-2-13b", 12, 600, 200, 200, 60)  # beyond the 3090 pair, not the GH200
    cfg = {"duration_s": 300.0, "warmup_s": 30.0, "drain_s": 120.0}
    smart = simulate(placement, [w], CATALOG, SimConfig(routing="least-loaded", **cfg)).total
    naive = simulate(placement, [w], CATALOG, SimConfig(routing="round-robin", **cfg)).total
    assert smart.completed_fraction == 1.0
    assert smart.e2e_mean_s < naive.e2e_mean_s / 2


# -- analytic model ---------------------------------------------------------------------------


def test_analytic_zero_load_latency_is_the_lone_request_roofline() -> None:
    p = perf("llama-3.1-8b", "A100-80G")
    state = steady_state(p, Workload("llama-3.1-8b", 0, 800, 300).lengths(131072), 0.0)
    assert state.e2e_s == pytest.approx(p.step.request_latency(800, 300), rel=1e-3)
    assert state.ttft_s == pytest.approx(p.step.prefill_time(800), rel=1e-9)


def test_analytic_latency_grows_with_load_until_capacity() -> None:
    p = perf("codellama-34b", "A100-80G", 2)
    lengths = Workload("codellama-34b", 1, 1170, 250, 390, 80).lengths(16384)
    capacity = max_rate(p, lengths)
    states = [steady_state(p, lengths, capacity * f) for f in (0.0, 0.3, 0.6, 0.9)]
    e2e = [s.e2e_s for s in states]
    assert e2e == sorted(e2e) and e2e[-1] > 1.5 * e2e[0]
    assert all(s.stable for s in states)
    beyond = steady_state(p, lengths, capacity * 1.01)
    assert not beyond.stable and beyond.e2e_s == math.inf and beyond.limit == "kv"
    table = replica_table(p, lengths)
    assert table.max_rate_rps == pytest.approx(capacity)
    assert table.e2e_s(capacity * 0.6) == pytest.approx(states[2].e2e_s, rel=0.02)
    assert table.e2e_s(capacity) == math.inf


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "lengths"),
    [
        ("llama-2-13b", "A100-80G", 1, (600, 64, 200, 21)),  # dense MHA, short outputs
        ("llama-3.3-70b", "GH200", 4, (900, 530, 300, 170)),  # GQA, tensor parallel
    ],
)
def test_analytic_agrees_with_the_des_at_half_load(
    model: str, gpu: str, tp: int, lengths: tuple[int, int, int, int]
) -> None:
    # Stated tolerance (docs/scheduler.md): at half of capacity, mean E2E within 10% and mean
    # TTFT within 15%; the analytic mean-field model reads low as load grows.
    p = perf(model, gpu, tp)
    w = Workload(model, 1, *lengths)
    rate = 0.5 * max_rate(p, w.lengths(CATALOG.model(model).max_context))
    predicted = steady_state(p, w.lengths(CATALOG.model(model).max_context), rate)
    measured = simulate(
        one(model, gpu, tp), [w.scaled(rate)], CATALOG, SimConfig(duration_s=1500, warmup_s=100)
    ).total
    assert measured.completed_fraction == 1.0
    assert predicted.e2e_s == pytest.approx(measured.e2e_mean_s, rel=0.10)
    assert predicted.ttft_s == pytest.approx(measured.ttft_mean_s, rel=0.15)
    assert measured.throughput_rps == pytest.approx(measured.arrived / 1400, rel=0.03)


def test_placement_estimate_splits_by_capacity_and_flags_overload() -> None:
    workloads = [Workload("llama-2-13b", 10, 600, 64), Workload("codellama-34b", 4, 1170, 250)]
    placement = Placement.of(
        [
            Allocation("llama-2-13b", "A100-80G", 1, 2),
            Allocation("llama-2-13b", "GH200", 1, 1),
            Allocation("codellama-34b", "GH200", 1, 2),
        ]
    )
    tables = replica_tables(CATALOG, workloads, ["A100-80G", "GH200"])
    assert ("llama-2-13b", "A100-80G", 1) in tables
    assert ("codellama-34b", "A100-80G", 1) in tables  # 34B fits one 80 GB GPU
    estimate = estimate_placement(placement, workloads, CATALOG, tables=tables)
    assert estimate.stable and estimate.throughput_rps == 14
    capacity_13b = (
        2 * tables[("llama-2-13b", "A100-80G", 1)].max_rate_rps
        + tables[("llama-2-13b", "GH200", 1)].max_rate_rps
    )
    assert estimate.models[0].capacity_rps == pytest.approx(capacity_13b)
    overloaded = estimate_placement(
        placement, [w.scaled(10) for w in workloads], CATALOG, tables=tables
    )
    assert not overloaded.stable and overloaded.e2e_s == math.inf
    assert overloaded.throughput_rps == pytest.approx(
        sum(m.capacity_rps for m in overloaded.models)
    )


def test_des_evaluates_a_56_gpu_three_model_placement_at_500_rps_in_seconds() -> None:
    # The paper's cluster (24 A100-80G + 32 GH200) and models, at ~500 req/s in total.
    placement = Placement.of(
        [
            Allocation("llama-2-13b", "A100-80G", 1, 8),
            Allocation("codellama-34b", "A100-80G", 2, 8),
            Allocation("codellama-34b", "GH200", 1, 16),
            Allocation("llama-3.3-70b", "GH200", 4, 4),
        ]
    )
    workloads = [
        Workload("llama-2-13b", 110, 600, 64, 200, 20),
        Workload("codellama-34b", 185.5, 1170, 64, 390, 20),
        Workload("llama-3.3-70b", 221, 850, 250, 280, 80),
    ]
    started = time.perf_counter()
    result = simulate(placement, workloads, CATALOG, SimConfig(duration_s=120, warmup_s=20))
    elapsed = time.perf_counter() - started
    assert result.total.arrived > 50_000 * 0.9
    assert elapsed < 10, f"{elapsed:.1f} s for {result.steps} iterations"
