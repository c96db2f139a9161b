"""From a placement over GPU pools to one engine per node (what `fabric plan --apply` sends)."""

from __future__ import annotations

from scheduler.node_assign import MeshNode, PoolAllocation, assign_nodes


def node(sid: str, gpu: str, gpus: int, state: str = "join", *models: str) -> MeshNode:
    return MeshNode(sid, gpu, gpus, state, models)


def test_replicas_fill_nodes_best_fit_and_spare_gpus_add_replicas() -> None:
    nodes = [node("a", "H100", 8), node("b", "H100", 4), node("c", "H100", 2), node("d", "L4", 1)]
    plan = assign_nodes(
        [PoolAllocation("big", "H100", 4, 2), PoolAllocation("small", "H100", 1, 2)], nodes
    )
    got = {a.session_id: (a.model, a.tp, a.dp) for a in plan.assignments}
    assert got == {"a": ("big", 4, 2), "c": ("small", 1, 2)}
    assert plan.unplaced == () and sorted(plan.idle_nodes) == ["b", "d"]


def test_serving_nodes_count_as_placed_and_are_never_reassigned() -> None:
    nodes = [node("s", "A100", 4, "serving", "m"), node("j1", "A100", 4), node("j2", "A100", 4)]
    plan = assign_nodes([PoolAllocation("m", "A100", 2, 4)], nodes)
    assert [(a.session_id, a.dp) for a in plan.assignments] == [("j1", 2)]
    assert plan.serving_gpus == {("m", "A100"): 4}
    assert all(a.session_id != "s" for a in plan.assignments)


def test_what_no_node_can_host_is_reported_or_substituted_on_another_type() -> None:
    nodes = [node("h", "H100", 2), node("l", "L40S", 4)]
    allocations = [PoolAllocation("m", "H100", 4, 1)]
    plan = assign_nodes(allocations, nodes)
    assert plan.assignments == () and plan.unplaced[0].replicas == 1

    def smallest_tp(model: str, gpu: str, gpus: int) -> int | None:
        return {"H100": 2, "L40S": 4}[gpu] if gpus >= 2 else None

    plan = assign_nodes(allocations, nodes, smallest_tp)
    assert plan.unplaced == ()
    (a,) = plan.assignments
    assert (a.session_id, a.gpu, a.tp, a.dp, a.substitute) == ("l", "L40S", 4, 1, True)


def test_every_node_is_assigned_at_most_once_and_within_its_gpus() -> None:
    nodes = [node(f"n{i}", "A100", g) for i, g in enumerate([1, 2, 2, 4, 8, 3])]
    allocations = [
        PoolAllocation("a", "A100", 1, 5),
        PoolAllocation("b", "A100", 2, 3),
        PoolAllocation("c", "A100", 8, 1),
    ]
    plan = assign_nodes(allocations, nodes)
    ids = [a.session_id for a in plan.assignments]
    assert len(ids) == len(set(ids))
    sizes = {n.session_id: n.gpus for n in nodes}
    for a in plan.assignments:
        assert a.tp * a.dp <= sizes[a.session_id] and a.dp >= 1
