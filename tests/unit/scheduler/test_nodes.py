"""The inventory as nodes: pools, realisation on named nodes, and plans that respect them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from scheduler.catalog import builtin_catalog
from scheduler.errors import WorkloadError
from scheduler.inventory import Inventory, NodeGroup
from scheduler.objective import Problem
from scheduler.plan import plan
from scheduler.realise import realise
from scheduler.search import next_replica
from scheduler.workload import Workload, load_inventory

CATALOG = builtin_catalog()

# Two models on 3 nodes x 4 A100-80G where the best pooled placement gives one node's GPUs to
# both: 8B on 2 + 4 GPUs, 13B on 2 + 4 (tests below check that it does).
SPLITTING = [
    Workload("llama-3.1-8b", 60, 800, 200, 200, 60),
    Workload("llama-2-13b", 20, 600, 300, 200, 100),
]


def engines_per_node(result: object) -> Counter[str]:
    layout = result.layout  # type: ignore[attr-defined]
    return Counter(e.node for e in layout.engines)


def test_gpu_counts_are_shared_nodes_of_the_catalog_size_in_one_pool_per_type() -> None:
    inv = Inventory.of({"A100-80G": 20, "GH200": 8}, CATALOG)
    a100 = inv.pools["A100-80G"]
    assert a100.shared and a100.node_sizes == (8, 8, 4) and a100.node_gpus == 8
    assert inv.pools["GH200"].node_sizes == (4, 4)
    assert inv.counts() == {"A100-80G": 20, "GH200": 8}


def test_node_groups_merge_by_shape_and_name_pools_by_type_and_size() -> None:
    inv = Inventory.of(
        [
            NodeGroup("a100", 2, 4),
            NodeGroup("A100-80G", 1, 4),
            NodeGroup("A100-80G", 1, 8),
            NodeGroup("H100", 2, 8, shared=True),
        ],
        CATALOG,
    )
    assert inv.counts() == {"A100-80G/4g": 12, "A100-80G/8g": 8, "H100-SXM": 16}
    assert inv.pools["A100-80G/4g"].node_names == tuple(f"A100-80G/4g#{i}" for i in range(3))
    assert not inv.pools["A100-80G/4g"].shared and inv.pools["H100-SXM"].shared


def test_nodes_form_of_the_inventory_file(tmp_path: Path) -> None:
    path = tmp_path / "inventory.toml"
    path.write_text(
        '[[nodes]]\ngpu = "A100-80G"\ncount = 3\ngpus = 4\n\n'
        '[[nodes]]\ngpu = "GH200"\ncount = 2\ngpus = 4\nshared = true\n'
    )
    inv = load_inventory(path, CATALOG)
    assert inv.counts() == {"A100-80G": 12, "GH200": 8}
    assert not inv.pools["A100-80G"].shared and inv.pools["GH200"].shared


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[gpus]\nH100 = 8\n[[nodes]]\ngpu = "H100"\ncount = 1\ngpus = 8\n', "not both"),
        ('[[nodes]]\ngpu = "H100"\ncount = 1\n', "missing 'gpus'"),
        ('[[nodes]]\ngpu = "H100"\ncount = 1\ngpus = 0\n', "gpus must be an integer >= 1"),
        ('[[nodes]]\ngpu = "TPU"\ncount = 1\ngpus = 4\n', "unknown GPU type 'TPU'"),
        ('[[nodes]]\ngpu = "H100"\ncount = 1\ngpus = 4\nshared = "yes"\n', "true or false"),
        ('[[nodes]]\ngpu = "H100"\ncount = 1\ngpus = 4\nram = 4\n', "unknown key 'ram'"),
    ],
)
def test_bad_nodes_entries_are_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "inventory.toml"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        load_inventory(path, CATALOG)


def test_exclusive_nodes_never_host_two_engines_where_a_pooled_plan_would() -> None:
    shared = plan([NodeGroup("A100-80G", 3, 4, shared=True)], SPLITTING, solver="exact")
    assert max(engines_per_node(shared).values()) == 2  # the instance does split a node
    for solver in ("exact", "cpsat", "greedy"):
        result = plan([NodeGroup("A100-80G", 3, 4)], SPLITTING, solver=solver, time_limit_s=3)
        assert result.layout is not None
        assert engines_per_node(result) == dict.fromkeys(
            {e.node for e in result.layout.engines}, 1
        ), solver
        for e in result.layout.engines:
            assert e.tp * e.dp <= e.node_gpus == 4 and e.dp == 4 // e.tp
        # the prediction is the realised placement's, and every replica names its node
        doc = result.to_json()
        replicas = sum(n["dp"] for n in doc["nodes"])  # type: ignore[index]
        assert replicas == sum(a.dp for a in result.placement.allocations)
        for row in doc["allocations"]:  # type: ignore[union-attr]
            assert row["nodes"], row
        assert sum(m.replicas for m in result.predicted.models) == replicas


def test_a_replica_never_spans_nodes() -> None:
    # 70B needs 2 A100-80G: on 1-GPU nodes it cannot be served, whatever the GPU count
    workloads = [Workload("llama-3.3-70b", 1, 600, 200)]
    result = plan([NodeGroup("A100-80G", 8, 1)], workloads, solver="greedy")
    assert result.placement.allocations == ()
    assert result.unservable and "cannot span nodes of 1 GPU)" in " ".join(
        result.unservable[0].reasons
    )


def test_shared_nodes_that_do_not_divide_drop_what_does_not_fit_and_say_so() -> None:
    problem = Problem([NodeGroup("A100-80G", 1, 6, shared=True)], SPLITTING, CATALOG)
    layout = realise(
        problem, {"llama-3.1-8b": {"A100-80G": (4, 1)}, "llama-2-13b": {"A100-80G": (2, 2)}}
    )
    assert sum(e.gpus for e in layout.engines) == 6  # 4 + 2 on the one 6-GPU node
    assert layout.rows == {
        "llama-3.1-8b": {"A100-80G": (4, 1)},
        "llama-2-13b": {"A100-80G": (2, 1)},
    }
    assert "1 llama-2-13b replica(s) of TP 2 do not fit" in layout.notes[0]


def test_nodes_already_serving_a_model_keep_it() -> None:
    groups = [
        NodeGroup("A100-80G", 1, 4, names=(f"n{i}",), serving=(model,))
        for i, model in enumerate(["", "llama-2-13b", "", "llama-3.1-8b"])
    ]
    problem = Problem(groups, SPLITTING, CATALOG)
    layout = realise(
        problem, {"llama-3.1-8b": {"A100-80G": (2, 2)}, "llama-2-13b": {"A100-80G": (4, 1)}}
    )
    by_node = {e.node: e.model for e in layout.engines}
    assert by_node["n1"] == "llama-2-13b" and by_node["n3"] == "llama-3.1-8b"
    assert not any(e.replaces for e in layout.engines)


def test_priority_weights_the_shares_under_overload() -> None:
    base = [
        Workload("llama-2-13b", 110, 850, 530, 280, 180),
        Workload("codellama-34b", 185.5, 1170, 64, 390, 20),
    ]
    even = plan({"A100-80G": 48}, base, solver="exact")
    first = [Workload("llama-2-13b", 110, 850, 530, 280, 180, priority=2), base[1]]
    weighted = plan({"A100-80G": 48}, first, solver="exact")
    share = {m.model: m.served_rps / m.rate_rps for m in weighted.predicted.models}
    even_share = {m.model: m.served_rps / m.rate_rps for m in even.predicted.models}
    assert share["llama-2-13b"] > even_share["llama-2-13b"]
    # the level: 13B gets at least twice the share 34B gets, up to the GPUs' granularity
    assert share["llama-2-13b"] >= 2 * share["codellama-34b"] * 0.8
    assert weighted.overload is not None and "llama-2-13b" in weighted.overload


def test_next_replica_is_the_best_single_addition() -> None:
    problem = Problem([NodeGroup("A100-80G", 2, 4), NodeGroup("L40S", 2, 4)], SPLITTING, CATALOG)
    rows = {"llama-3.1-8b": {"A100-80G": (2, 1)}, "llama-2-13b": {"A100-80G": (4, 1)}}
    choice = next_replica(problem, rows, "llama-3.1-8b")
    assert choice is not None
    assert choice[0] == "L40S"  # both A100 nodes are taken
    full = {
        "llama-3.1-8b": {"A100-80G": (2, 1), "L40S": (1, 2)},
        "llama-2-13b": {"A100-80G": (4, 1)},
    }
    assert next_replica(problem, full, "llama-3.1-8b") is None
