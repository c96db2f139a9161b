"""The registry's schema: label keys spelled once, and the one standing verdict."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.mesh import schema
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import Addresses, ModelInfo, State
from fabricnode.mesh.schema import CONTROL_COUNTS, Standing, standing
from fabricnode.mesh.wire import EntryMsg
from fabricnode.testing.simnet import SimNetwork, SimNode, make_body

A, S, D, L = Liveness.ALIVE, Liveness.SUSPECT, Liveness.DEAD, Liveness.LEFT
GONE, LEAVING, UNVOUCHED = Standing.GONE, Standing.LEAVING, Standing.UNVOUCHED
LIVE, SUSPECT, ROUTABLE = Standing.LIVE, Standing.SUSPECT, Standing.ROUTABLE

TABLE = [
    # state, liveness, probed -> standing
    (State.SERVING, A, True, ROUTABLE),
    (State.SERVING, S, True, SUSPECT),
    (State.SERVING, A, False, UNVOUCHED),  # no gossip address: nobody probes it
    (State.SERVING, S, False, UNVOUCHED),
    (State.SERVING, None, False, UNVOUCHED),  # not a member (yet)
    (State.SERVING, None, True, UNVOUCHED),  # probed means nothing without a member
    (State.SERVING, D, True, GONE),
    (State.SERVING, D, False, GONE),
    (State.SERVING, L, True, LEAVING),
    (State.JOIN, A, True, LIVE),
    (State.JOIN, S, True, LIVE),
    (State.JOIN, None, False, UNVOUCHED),
    (State.JOIN, D, True, GONE),
    (State.DOWN, A, True, GONE),
    (State.DOWN, None, False, GONE),
    (State.DOWN, L, True, GONE),  # DOWN ends it before LEFT does
    (State.LEFT, A, True, LEAVING),
    (State.LEFT, L, True, LEAVING),
    (State.LEFT, None, False, LEAVING),
    (State.LEFT, D, True, GONE),  # dead: nothing it accepted will be answered
]


@pytest.mark.parametrize(("state", "liveness", "probed", "expected"), TABLE)
def test_standing_table(
    state: State, liveness: Liveness | None, probed: bool, expected: Standing
) -> None:
    assert standing(state, liveness, probed=probed) is expected


states = st.sampled_from(list(State))
livenesses = st.none() | st.sampled_from(list(Liveness))


@given(states, livenesses, st.booleans())
def test_standing_keeps_every_callers_old_rule(
    state: State, liveness: Liveness | None, probed: bool
) -> None:
    """Each level is the rule one set of callers applied on its own before there was one
    verdict, so the verdict changed none of them."""
    v = standing(state, liveness, probed=probed)
    vouched = liveness is not None and probed
    # The data plane (route table, /v1/models): a SERVING entry whose owner is a probed member,
    # alive or suspect (commit 4778514); SUSPECT only as the last resort.
    assert (v >= SUSPECT) == (state is State.SERVING and vouched and liveness in (A, S))
    assert (v is ROUTABLE) == (state is State.SERVING and vouched and liveness is A)
    # The control plane: not DOWN or LEFT, and a probed member alive or suspect in this node's
    # view (an entry no probe vouches for counts for nothing: a phantom controller candidate
    # or workload endpoint could be any cluster-key holder's invention).
    assert (v >= CONTROL_COUNTS) == (state < State.DOWN and vouched and liveness in (A, S))
    assert CONTROL_COUNTS is LIVE
    # A request in flight fails over only from a node that is DOWN or dead.
    assert (v is GONE) == (state is State.DOWN or liveness is D)
    # Not known gone, vouched for or not (what the control plane counted before).
    assert (v >= UNVOUCHED) == (state < State.DOWN and liveness not in (D, L))
    if liveness is None:  # probed means nothing for a node that is not a member
        assert v is standing(state, None, probed=not probed)


def test_each_label_key_is_spelled_once() -> None:
    keys = [v for k, v in vars(schema).items() if k.endswith("_LABEL")]
    assert len(keys) == len(set(keys)) >= 13
    assert all(k.startswith(("fabric.", "slurm.")) for k in keys)


def _serving(net: SimNetwork, node: SimNode, i: int) -> None:
    node.core.update_self(
        net.wall,
        state=State.SERVING,
        models=(ModelInfo("m1", 4096),),
        addresses=Addresses(http=f"http://10.0.0.{i}:8080", gossip=node.addr),
    )
    net.poke(node)


def test_mesh_core_answers_entries_of_a_standing() -> None:
    net = SimNetwork(seed=5)
    me = net.add_node(0)
    server = net.add_node(1, seeds=[me.addr])
    joining = net.add_node(2, seeds=[me.addr])
    _serving(net, me, 1)
    _serving(net, server, 2)
    liar = Identity.from_seed(b"schema-phantom")
    phantom = replace(
        make_body(liar, "", net.wall),
        state=State.SERVING,
        models=(ModelInfo("m1", 4096),),
        addresses=Addresses(http="http://10.9.0.1:9000", gossip=""),
    )
    me.core.ingest([EntryMsg(phantom.sign(liar))], net.wall)
    net.run_for(5)
    core = me.core

    def ids(at_least: Standing) -> set[str]:
        return {e.session_id for e in core.entries(at_least)}

    sid = {"me": core.self_id, "server": server.core.self_id, "joining": joining.core.self_id}
    assert core.standing_of(core.self_entry) is ROUTABLE
    assert core.standing(sid["server"], State.SERVING) is ROUTABLE
    assert core.standing(sid["joining"], State.JOIN) is LIVE
    assert core.standing(liar.session_id, State.SERVING) is UNVOUCHED
    assert ids(ROUTABLE) == {sid["me"], sid["server"]}
    assert ids(LIVE) == {sid["me"], sid["server"], sid["joining"]}
    assert ids(UNVOUCHED) == ids(LIVE) | {liar.session_id}
    assert ids(CONTROL_COUNTS) == ids(LIVE)  # the phantom counts for nothing

    net.crash(server.addr)
    t0 = net.now
    while core.liveness(sid["server"]) is not D and net.now - t0 < 30:
        net.run_for(0.1)
    assert core.standing(sid["server"], State.SERVING) is GONE  # its entry still says SERVING
    assert sid["server"] not in ids(CONTROL_COUNTS)

    core.leave(net.wall)
    assert core.standing_of(core.self_entry) is LEAVING
    assert sid["me"] in ids(LEAVING) and sid["me"] not in ids(UNVOUCHED)
