"""From engines on named nodes to what `fabric plan --apply` sends (``assign_layout``)."""

from __future__ import annotations

from scheduler.node_assign import MeshNode, assign_layout
from scheduler.realise import NodeEngine


def node(sid: str, gpu: str, gpus: int, state: str = "join", *models: str) -> MeshNode:
    return MeshNode(sid, gpu, gpus, state, models)


def engine(sid: str, model: str, tp: int, dp: int, gpus: int = 4) -> NodeEngine:
    return NodeEngine(sid, "A100-80G", "A100-80G", gpus, model, tp, dp)


def test_join_nodes_get_their_engine_and_idle_join_nodes_are_listed() -> None:
    nodes = [node("a", "A100-80G", 4), node("b", "A100-80G", 4), node("c", "A100-80G", 4)]
    plan = assign_layout([engine("a", "m", 2, 2), engine("c", "n", 1, 3)], nodes)
    got = {a.session_id: (a.model, a.tp, a.dp, a.idle_gpus) for a in plan.assignments}
    assert got == {"a": ("m", 2, 2, 0), "c": ("n", 1, 3, 1)}
    assert plan.idle_nodes == ("b",) and plan.unplaced == ()


def test_serving_nodes_are_never_reassigned() -> None:
    nodes = [
        node("s", "A100-80G", 4, "serving", "m"),
        node("t", "A100-80G", 4, "serving", "other"),
        node("j", "A100-80G", 4),
    ]
    plan = assign_layout(
        [engine("s", "m", 4, 1), engine("t", "m", 4, 1), engine("j", "m", 4, 1)], nodes
    )
    assert [a.session_id for a in plan.assignments] == ["j"]  # s already serves m
    assert plan.serving_gpus == {("m", "A100-80G"): 4, ("other", "A100-80G"): 4}
    # t serves another model: apply never stops a running engine, so it is reported
    assert [(u.model, u.replicas) for u in plan.unplaced] == [("m", 1)]
    doc = plan.to_json()
    assert doc["unplaced"] == [{"model": "m", "gpu": "A100-80G", "tp": 4, "replicas": 1}]


def test_an_engine_on_a_node_that_left_is_unplaced() -> None:
    plan = assign_layout([engine("gone", "m", 1, 4)], [node("a", "A100-80G", 4)])
    assert plan.assignments == () and plan.unplaced[0].model == "m"
    assert plan.idle_nodes == ("a",)
