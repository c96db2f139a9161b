"""The demand scaler on the pure mesh core: a wanted label starts a scaled-to-zero model, the
agents' request logs keep it up while used and let it go to zero once idle, and an agent that
cannot be asked is no news. Also the ingress's view of the declared models."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import httpx
import trio
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.elastic.demand import MAX_WANTED_LABELS, Declared, DemandScaler, wanted_labels
from fabricnode.elastic.observe import History, ModelSums, agent_urls, wanted_held, wanted_models
from fabricnode.elastic.vocab import MIN_REPLICAS, Fleet, Held, Reason
from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.identity import Identity, OperatorKey
from fabricnode.mesh.registry import MAX_LABEL_VALUE, Addresses, State
from fabricnode.mesh.schema import (
    MAX_WANTED_HELD,
    WANTED_LABEL,
    held_step,
    parse_wanted,
    wanted_items,
)
from fabricnode.mesh.servicedoc import ServicesBody
from fabricnode.mesh.wire import EntryMsg, Load
from fabricnode.testing.simnet import SimNetwork, make_body
from tests.unit.elastic.plans import plan

OPERATOR = OperatorKey(Identity.from_seed(b"o" * 32))
COLD = plan("cold", 0, 2, idle_to_zero_s=60.0)
WARM = plan("warm", 1, 2)


def mesh(n: int = 3) -> SimNetwork:
    net = SimNetwork(config=MeshConfig(trusted_operators=(OPERATOR.fingerprint,)), seed=9)
    first = net.add_node(0)
    for i in range(1, n):
        net.add_node(i, seeds=[first.addr])
    net.run_for(10)
    return net


class Logs:
    def __init__(self) -> None:
        self.requests: dict[str, float] = {}
        self.down: set[str] = set()
        self.asked = 0

    def requests_in(self, url: str, window_s: float) -> Mapping[str, float]:
        self.asked += 1
        if url in self.down:
            raise httpx.ConnectError("refused")
        return {"cold": self.requests.get(url, 0.0)}

    def after(self, url: str, cursor: str) -> tuple[str, Mapping[str, ModelSums]]:
        raise AssertionError("the demand rules ask by window, never by cursor")

    def history(self, url: str, history_s: float, bin_s: float) -> History:
        raise AssertionError("the demand rules ask by window, never for history")


def test_wanted_starts_then_request_logs_keep_it_up_until_it_is_idle() -> None:
    net = mesh()
    nodes = list(net.nodes.values())
    for i, node in enumerate(nodes):  # simulated nodes have no HTTP address: give them one
        body = node.core.self_entry.body
        addresses = dataclasses.replace(body.addresses, http=f"http://10.0.0.{i}:8080")
        node.core.update_self(net.wall, addresses=addresses)
        net.poke(node)
    net.run_for(3)
    logs = Logs()
    scaler = DemandScaler(nodes[0].core, logs, check_interval_s=10.0)

    def step(at: float) -> tuple[int, str]:
        trio.run(scaler.observe, [COLD, WARM], at)
        target, why = scaler.target(COLD, at)
        return target, why.text

    assert step(0.0) == (0, "idle for 60 s")
    assert scaler.target(COLD, 0.0)[1].reason is Reason.IDLE
    assert scaler.target(WARM, 0.0) == (1, MIN_REPLICAS)
    nodes[2].core.update_self(net.wall, labels=((WANTED_LABEL, "cold other"),))
    net.poke(nodes[2])
    net.run_for(3)
    assert step(1.0) == (1, "scale from zero: requests waiting")
    assert scaler.target(COLD, 1.0)[1].reason is Reason.SCALE_FROM_ZERO
    nodes[2].core.update_self(net.wall, labels=())
    net.poke(nodes[2])
    net.run_for(3)
    assert step(30.0) == (1, "active recently")  # wanted at 1.0, within 60 s
    url = nodes[1].core.self_entry.body.addresses.http
    logs.requests[url] = 3.0  # a request in the window: active again
    assert step(50.0) == (1, "active recently")
    logs.requests[url] = 0.0
    assert step(105.0) == (1, "active recently")  # last activity 50.0
    logs.down.add(url)  # an agent that cannot be asked: no news, the last verdict stands
    assert step(105.0) == (1, "active recently")
    assert step(111.0) == (0, "idle for 60 s")
    logs.down.clear()
    assert step(125.0) == (0, "idle for 60 s")
    assert logs.asked >= 3 * 4  # every check asked every agent (3), stopping at one that failed


def test_declared_models_and_hold_times_follow_the_service_file() -> None:
    net = mesh(1)
    (node,) = net.nodes.values()
    declared = Declared(node.core)
    assert declared.models() == [] and declared.hold_s("cold") is None
    text = (
        '[limits]\nmax_jobs = 2\nmax_gpus = 2\n\n[[model]]\nname = "cold"\nengine = "sim"\n'
        'min_replicas = 0\nhold_requests = "45s"\n'
    )
    node.core.publish_services(
        ServicesBody(net.wall, text, OPERATOR.public_key).sign(OPERATOR), net.wall
    )
    assert declared.models() == ["cold"] and declared.hold_s("cold") == 45.0
    bad = "[[model]]\nname = 1\n"
    node.core.publish_services(
        ServicesBody(net.wall + 1, bad, OPERATOR.public_key).sign(OPERATOR), net.wall + 1
    )
    assert declared.models() == []  # an invalid file declares nothing


def test_declared_sites_follow_the_service_file_and_a_broken_file_never_widens_them() -> None:
    net = mesh(1)
    (node,) = net.nodes.values()
    declared = Declared(node.core)
    assert declared.sites("eu") is None

    def publish(text: str, at: float) -> None:
        signed = ServicesBody(net.wall + at, text, OPERATOR.public_key).sign(OPERATOR)
        node.core.publish_services(signed, net.wall + at)

    head = '[limits]\nmax_jobs = 2\nmax_gpus = 2\n\n[[model]]\nname = "eu"\nengine = "sim"\n'
    publish(head + 'sites = ["B", "A"]\n\n[[model]]\nname = "any"\nengine = "sim"\n', 0)
    assert declared.sites("eu") == frozenset({"A", "B"})
    assert declared.sites("any") is None and declared.sites("unknown") is None
    publish("[[model]]\nname = 1\n", 1)
    assert declared.models() == []  # an invalid file declares nothing...
    assert declared.sites("eu") == frozenset({"A", "B"})  # ...but widens nothing
    publish(head, 2)
    assert declared.sites("eu") is None  # a valid file without sites lifts the limit


def test_many_wanted_models_spread_over_labels_that_fit_the_registry() -> None:
    models = {f"org/model-{i:03d}-" + "x" * 40: i + 1 for i in range(30)}
    labels = wanted_labels(models)
    assert 1 < len(labels) <= MAX_WANTED_LABELS
    assert all(len(v) <= MAX_LABEL_VALUE for _, v in labels)
    assert labels[0][0] == WANTED_LABEL and labels[1][0] == f"{WANTED_LABEL}.1"
    carried = {m: n for _, v in labels for m, n in parse_wanted(v).items()}
    assert set(carried) <= set(models) and len(carried) >= 8  # what fits, never a cut name
    assert all(carried[m] == held_step(models[m]) for m in carried)
    net = mesh(2)
    node = list(net.nodes.values())[1]
    node.core.update_self(net.wall, labels=labels)  # signs: every value fits
    net.poke(node)
    net.run_for(3)
    first = next(iter(net.nodes.values()))
    assert wanted_models(first.core) == set(carried)
    assert wanted_held(first.core) == carried
    assert wanted_labels({}) == () and wanted_labels({"idle": 0}) == ()


def test_the_held_counts_of_every_ingress_add_up_and_an_old_label_counts_one() -> None:
    net = mesh(3)
    nodes = list(net.nodes.values())
    nodes[1].core.update_self(net.wall, labels=wanted_labels({"cold": 40, "warm": 3}))
    # an ingress of the format before the counts: the model's name alone
    nodes[2].core.update_self(net.wall, labels=((WANTED_LABEL, "cold"),))
    for node in nodes[1:]:
        net.poke(node)
    net.run_for(3)
    assert wanted_held(nodes[0].core) == {"cold": 32 + 1, "warm": 3}


@given(st.text(max_size=MAX_LABEL_VALUE))
def test_law_a_hostile_wanted_value_is_read_bounded(value: str) -> None:
    """A label is peer input: whatever it says, every count is 1..MAX_WANTED_HELD, every
    model a non-empty item of it, and there are no more models than items."""
    held = parse_wanted(value)
    assert len(held) <= len(value.split())
    for model, n in held.items():
        assert model and not any(c.isspace() for c in model)
        assert isinstance(n, int) and 1 <= n <= MAX_WANTED_HELD


@given(st.dictionaries(st.text("abc/=-.", min_size=1, max_size=12), st.integers(0, 10**7)))
def test_law_wanted_items_read_back_as_their_steps(held: dict[str, int]) -> None:
    read: dict[str, int] = {}
    for item in wanted_items(held):
        for model, n in parse_wanted(item).items():
            read[model] = n
    assert read == {m: held_step(n) for m, n in held.items() if n > 0}


def test_held_step_is_two_steps_an_octave_and_bounded() -> None:
    assert [held_step(n) for n in range(10)] == [0, 1, 2, 3, 4, 4, 6, 6, 8, 8]
    assert held_step(100) == 96 and held_step(10**9) == held_step(MAX_WANTED_HELD) <= 10**5
    assert all(held_step(n) <= n and 3 * held_step(n) >= 2 * n for n in range(1, 5000))


def test_a_phantom_entry_no_probe_vouches_for_brings_no_demand() -> None:
    """A cluster-key holder signs an entry with no gossip address (no member, no probe) that
    says it wants the cold model and whose workload endpoint would report invented requests:
    it is neither read for the wanted label nor asked, so the cold model stays at zero."""
    net = mesh()
    nodes = list(net.nodes.values())
    liar = Identity.from_seed(b"phantom-demand")
    phantom_url = "http://10.9.0.1:9000"
    phantom = make_body(
        liar,
        "",
        net.wall,
        addresses=Addresses(http=phantom_url, gossip=""),
        labels=((WANTED_LABEL, "cold"),),
    )
    nodes[0].core.ingest([EntryMsg(phantom.sign(liar))], net.wall)
    assert any(e.session_id == liar.session_id for e in nodes[0].core.registry)
    assert wanted_models(nodes[0].core) == set()
    assert phantom_url not in {url for _, url in agent_urls(nodes[0].core)}
    logs = Logs()
    logs.requests[phantom_url] = 40.0  # what the phantom would report, were it asked
    scaler = DemandScaler(nodes[0].core, logs, check_interval_s=10.0)
    trio.run(scaler.observe, [COLD], 0.0)
    target, why = scaler.target(COLD, 0.0)
    assert (target, why.reason) == (0, Reason.IDLE)


def test_a_controller_that_takes_over_during_a_ramp_from_zero_keeps_the_starting_replica() -> None:
    """The acting controller started a replica for held requests 20 s ago and died; the held
    requests went to the replica (no wanted label), none has ended (the logs count nothing).
    A fresh scaler sees the job's submission in Slurm's list (``Held.newest_at``) and the
    replica's load: the model stays at one for its idle time from then, and longer while
    requests are in flight."""
    net = mesh()
    nodes = list(net.nodes.values())
    logs = Logs()
    replica = nodes[2]
    sid = replica.core.self_id
    labels = (("fabric.service", "cold"), ("slurm.job_id", "12"))
    replica.core.update_self(net.wall, state=State.SERVING, labels=labels)
    net.poke(replica)
    net.run_for(3)
    now = 1000.0
    fleet = Fleet({"cold": Held(0, 1, newest_at=now - 20)})
    successor = DemandScaler(nodes[0].core, logs, check_interval_s=10.0)
    trio.run(successor.observe, [COLD], now, fleet)
    target, why = successor.target(COLD, now)
    assert (target, why.reason) == (1, Reason.ACTIVE)
    assert successor.idle_at(COLD, now) == now - 20 + 60
    # without the job's submission it would have found the model idle (the bug this fixes)
    blind = DemandScaler(nodes[0].core, logs, check_interval_s=10.0)
    trio.run(blind.observe, [COLD], now)
    assert blind.target(COLD, now)[0] == 0
    # requests in flight at the replica keep it past the idle time counted from the start
    later = now + 50
    nodes[0].core.loads[sid] = Load(sid, 1, 30, 8, 0.5, 38, later)
    trio.run(successor.observe, [COLD], later, Fleet({"cold": Held(1, 0, newest_at=now - 20)}))
    target, why = successor.target(COLD, later + 30)
    assert target == 1 and "in flight" in why.text
    assert successor.idle_at(COLD, later) == later + 60
    # a model wanted now has no idle time; a model that keeps replicas has none either
    assert successor.idle_at(WARM, later) is None
