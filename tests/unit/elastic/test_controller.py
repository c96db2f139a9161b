"""The control loop's passes on the pure mesh core and a fake Slurm: leadership among
controller agents (a takeover starts from Slurm's list and never submits twice), replicas read
from the registry, Slurm's refusals and invalid service files reported, dry-run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import trio

from fabricnode.elastic.controller import Controller
from fabricnode.elastic.leader import candidate_since
from fabricnode.elastic.slurmctl import SlurmControl, comment_for, mesh_tag
from fabricnode.elastic.startups import parse_start_ups
from fabricnode.elastic.vocab import ServicePlans
from fabricnode.errors import ConfigError
from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.identity import Identity, OperatorKey
from fabricnode.mesh.registry import Addresses, State
from fabricnode.mesh.schema import CONTROLLER_LABEL
from fabricnode.mesh.servicedoc import ServicesBody
from fabricnode.mesh.wire import EntryMsg
from fabricnode.testing.simnet import SimNetwork, SimNode, make_body
from tests.unit.elastic.plans import plan

OPERATOR = OperatorKey(Identity.from_seed(b"o" * 32))
MESH = mesh_tag(b"k" * 32)
PLANS = {
    "two": ServicePlans((plan("m", 2, 4, partitions=("gpu",), time_limit_s=120),), digest="two"),
    "none": ServicePlans((), digest="none"),
    "across": ServicePlans(
        (plan("m", 2, 2, partitions=("gpu",), prefer_sites=("B", "A"), sites=("A", "B")),),
        digest="across",
    ),
}


class FakeSlurm:
    """sbatch, squeue and scancel over an in-memory job list (squeue's format)."""

    def __init__(self, refuse: str = "") -> None:
        self.jobs: dict[str, tuple[str, str]] = {}  # id -> (state, comment)
        self.next_id = 100
        self.refuse = refuse
        self.submitted: list[str] = []
        self.sbatch_calls = 0
        self.preempted: set[str] = set()  # jobs whose record has a PreemptTime

    def __call__(self, argv: Sequence[str]) -> tuple[int, str, str]:
        if argv[0] == "sbatch":
            self.sbatch_calls += 1
            if self.refuse:
                return 1, "", f"sbatch: error: {self.refuse}\n"
            self.next_id += 1
            comment = next(a for a in argv if a.startswith("--comment="))[len("--comment=") :]
            self.jobs[str(self.next_id)] = ("PENDING", comment)
            self.submitted.append(str(self.next_id))
            return 0, f"{self.next_id}\n", ""
        if argv[0] == "scancel":
            self.jobs.pop(argv[-1], None)
            return 0, "", ""
        if "PreemptTime" in argv:
            job = argv[argv.index("-j") + 1]
            return 0, ("2026-11-25T10:00:00" if job in self.preempted else "None") + "\n", ""
        lines = [
            f"{i}|{state}|gpu|N/A|N/A|N/A|2:00|None|{comment}"
            for i, (state, comment) in self.jobs.items()
        ]
        return 0, "\n".join(lines), ""


def parse(text: str) -> ServicePlans:
    if text not in PLANS:
        raise ConfigError(f"line 1: unknown service file {text!r}")
    return PLANS[text]


def mesh(n: int) -> SimNetwork:
    net = SimNetwork(config=MeshConfig(trusted_operators=(OPERATOR.fingerprint,)), seed=3)
    first = net.add_node(0)
    for i in range(1, n):
        net.add_node(i, seeds=[first.addr])
    net.run_for(10)
    return net


def controller(
    net: SimNetwork, node: SimNode, slurm: FakeSlurm, dry_run: bool = False
) -> Controller:
    def relabel(labels: tuple[tuple[str, str], ...]) -> None:
        node.core.update_self(net.wall, labels=labels)
        net.poke(node)

    ctl = Controller(
        node.core,
        SlurmControl(MESH, Path("/x.sbatch"), "me", slurm, dry_run),
        parse,
        relabel,
        wall_clock=lambda: net.wall,
    )
    return ctl


def apply(net: SimNetwork, node: SimNode, text: str) -> None:
    node.core.publish_services(
        ServicesBody(net.wall, text, OPERATOR.public_key).sign(OPERATOR), net.wall
    )
    net.poke(node)
    net.run_for(5)


def announce(net: SimNetwork, ctl: Controller, node: SimNode, since: float) -> None:
    node.core.update_self(net.wall, labels=((CONTROLLER_LABEL, f"{since:.3f}"),))
    net.poke(node)


def test_one_controller_acts_and_a_takeover_never_submits_twice() -> None:
    net = mesh(4)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm()
    first, second = controller(net, nodes[1], slurm), controller(net, nodes[2], slurm)
    announce(net, first, nodes[1], 100.0)
    announce(net, second, nodes[2], 200.0)  # the newcomer stands by
    apply(net, nodes[0], "two")

    async def passes() -> None:
        await first.tick()
        await second.tick()

    trio.run(passes)
    assert (first.status.role, second.status.role) == ("acting", "standby")
    assert len(slurm.submitted) == 2
    assert [d.action for d in first.recent] == ["submit", "submit"]
    assert all(comment_for(MESH, "m", gpus=1) == c for _, c in slurm.jobs.values())
    # the acting one dies: the standby takes over once it is declared dead, from Slurm's list
    net.crash(nodes[1].addr)
    net.run_for(15)
    trio.run(second.tick)
    assert second.status.role == "acting"
    assert len(slurm.submitted) == 2  # the two jobs are counted, none is submitted again
    assert second.status.models[0].pending == 2


def test_a_takeover_starts_from_the_start_up_times_the_last_acting_controller_learned() -> None:
    """The acting controller labels its entry with what it learned (``elastic.startups``); a
    candidate that takes over reads them from its dead entry and plans with the same lead,
    not with what the jobs it inherits would teach it again (nor the default)."""
    net = mesh(4)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm()
    first, second = controller(net, nodes[1], slurm), controller(net, nodes[2], slurm)
    announce(net, first, nodes[1], 100.0)
    announce(net, second, nodes[2], 200.0)
    apply(net, nodes[0], "two")
    trio.run(first.tick)
    first.memory.observe("m", "gpu", 42.0)  # as if it had seen a job go from sbatch to SERVING
    trio.run(first.tick)
    net.run_for(5)
    seen = nodes[2].core.registry.get(nodes[1].core.self_id)
    assert seen is not None and parse_start_ups(seen.body.labels) == {("m", "gpu"): 42.0}
    assert candidate_since(seen.body.labels) == 100.0  # the candidate label is kept
    net.crash(nodes[1].addr)
    net.run_for(15)
    trio.run(second.tick)
    assert second.status.role == "acting"
    assert second.memory.lead == {("m", "gpu"): 42.0}
    assert second.memory.lead_s("m", "gpu") == first.memory.lead_s("m", "gpu")


def test_replicas_are_matched_to_jobs_through_the_registry() -> None:
    net = mesh(3)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm()
    ctl = controller(net, nodes[1], slurm)
    announce(net, ctl, nodes[1], 1.0)
    apply(net, nodes[0], "two")
    trio.run(ctl.tick)
    job = slurm.submitted[0]
    slurm.jobs[job] = ("RUNNING", slurm.jobs[job][1])
    labels = (("fabric.service", "m"), ("slurm.job_id", job))
    nodes[2].core.update_self(net.wall, state=State.SERVING, labels=labels)
    net.poke(nodes[2])
    net.run_for(5)
    trio.run(ctl.tick)
    (status,) = ctl.status.models
    assert (status.serving, status.pending, status.state) == (1, 1, "ok")
    # what it learned: nothing (squeue gives no submit time here, the scaler learns nothing);
    # the start-up time it plans with is the default
    (shown,) = ctl.status.to_json()["models"]  # type: ignore[misc]
    default = ctl.memory.tuning.default_lead_s
    assert shown["learned"] == {"cold_start_s": default, "cold_start_learned": False}
    # preempted, it left within its grace time: squeue says COMPLETED, its record PreemptTime
    slurm.jobs[job] = ("COMPLETED", slurm.jobs[job][1])
    slurm.preempted.add(job)
    nodes[2].core.update_self(net.wall, state=State.LEFT)
    net.poke(nodes[2])
    net.run_for(5)
    trio.run(ctl.tick)
    reasons = [d.reason for d in ctl.recent if d.action == "submit"]
    assert reasons[-1] == f"replaces job {job} (preempted)"
    assert ctl.decisions[("submit", "preempted")] == 1


def test_refusals_invalid_files_and_dry_run_change_nothing_and_say_why() -> None:
    net = mesh(2)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm(refuse="invalid partition specified: gpu")
    ctl = controller(net, nodes[1], slurm)
    announce(net, ctl, nodes[1], 1.0)
    trio.run(ctl.tick)
    assert "no service file" in ctl.status.error
    apply(net, nodes[0], "two")
    trio.run(ctl.tick)
    assert ctl.status.models[0].state == "refused"
    assert "invalid partition specified: gpu" in ctl.status.models[0].note
    assert {d.action for d in ctl.recent} == {"refused"}
    assert "sbatch at partition gpu: invalid partition" in ctl.recent[-1].reason
    # Slurm said no to the only placement: the next passes wait instead of asking again
    calls = slurm.sbatch_calls
    trio.run(ctl.tick)
    assert slurm.sbatch_calls == calls
    assert ctl.status.models[0].state == "refused"
    assert "invalid partition specified: gpu" in ctl.status.models[0].note
    apply(net, nodes[0], "garbage")
    trio.run(ctl.tick)
    assert "invalid" in ctl.status.error and "line 1" in ctl.status.error
    assert ctl.recent[-1].action == "invalid"

    dry = FakeSlurm()
    ctl = controller(net, nodes[1], dry, dry_run=True)
    apply(net, nodes[0], "two")
    trio.run(ctl.tick)
    assert dry.submitted == [] and len(ctl.status.commands) == 2
    assert all(c.startswith("sbatch --parsable") for c in ctl.status.commands)


def test_a_phantom_controller_candidate_no_probe_vouches_for_leaves_the_real_one_acting() -> None:
    """A cluster-key holder signs an entry labelled as a controller candidate since long ago,
    with no gossip address (no member, no probe): the real controller keeps acting. Before the
    control plane trusted only live members, the phantom was the oldest alive candidate and the
    real controller stood by for as long as the entry lived."""
    net = mesh(3)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm()
    real = controller(net, nodes[1], slurm)
    announce(net, real, nodes[1], 100.0)
    liar = Identity.from_seed(b"phantom-controller")
    phantom = make_body(
        liar,
        "",
        net.wall,
        addresses=Addresses(http="http://10.9.0.1:9000", gossip=""),
        labels=((CONTROLLER_LABEL, "1.000"),),  # a candidate long before the real one
    )
    for node in nodes:
        node.core.ingest([EntryMsg(phantom.sign(liar))], net.wall)
    apply(net, nodes[0], "two")
    assert any(e.session_id == liar.session_id for e in nodes[1].core.registry)
    trio.run(real.tick)
    assert real.status.role == "acting"
    assert len(slurm.submitted) == 2


def test_a_model_counted_across_sites_gets_what_the_preferred_site_does_not_serve() -> None:
    """``prefer_sites = ["B", "A"]``, two replicas in all (``elastic.sitespread``): the
    controller at site A starts both while B serves none (its partition refuses), and cancels
    its jobs as B's serve, one for one."""
    net = mesh(2)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm()
    ctl = controller(net, nodes[1], slurm)
    ctl.site = "A"
    at_b = {"m": 0}
    ctl.serving_elsewhere = lambda model: {"B": at_b[model]}
    announce(net, ctl, nodes[1], 1.0)
    apply(net, nodes[0], "across")
    trio.run(ctl.tick)
    assert len(slurm.jobs) == 2
    assert "site A's share: 2 to 2 (0 serving at sites preferred before it" in str(
        ctl.status.to_json()["site_shares"]
    )
    at_b["m"] = 1  # B serves one: A keeps one
    trio.run(ctl.tick)
    assert len(slurm.jobs) == 1
    at_b["m"] = 2
    trio.run(ctl.tick)
    assert slurm.jobs == {}
    assert [d.action for d in ctl.recent] == ["submit", "submit", "cancel", "cancel"]
    # not a gateway (no view of the other sites): they are taken to serve nothing
    ctl.serving_elsewhere = None
    trio.run(ctl.tick)
    assert len(slurm.jobs) == 2
    said = ctl.status.site_shares["m"]
    assert "blind: this controller sees no other site" in said and "--gateway" in said


def test_the_acting_controller_says_how_long_a_start_takes_and_none_while_slurm_refuses() -> None:
    """What our site's summary and gateway read (``dataplane.sites`` rule 8): the acting
    controller's expected start per model it would start now (the learned start-up time,
    ``default_lead_s`` before any); inf while Slurm refuses every placement; a standby says
    nothing (None)."""
    net = mesh(2)
    nodes = list(net.nodes.values())
    slurm = FakeSlurm()
    ctl = controller(net, nodes[1], slurm)
    assert ctl.start_here("m") is None  # not acting yet
    announce(net, ctl, nodes[1], 1.0)
    apply(net, nodes[0], "two")
    trio.run(ctl.tick)
    assert ctl.status.role == "acting"
    assert ctl.start_here("m") == ctl.memory.tuning.default_lead_s
    assert ctl.starts == {"m": ctl.memory.tuning.default_lead_s}
    ctl.memory.lead[("m", "gpu")] = 21.04  # learned from a job that served
    trio.run(ctl.tick)
    assert ctl.starts == {"m": 21.0}
    assert ctl.start_here("other") == math.inf  # not a model it starts

    refusing = controller(net, nodes[1], FakeSlurm(refuse="invalid partition specified: gpu"))
    announce(net, refusing, nodes[1], 1.0)
    trio.run(refusing.tick)
    assert refusing.starts == {} and refusing.start_here("m") == math.inf


def test_a_site_the_model_may_not_be_served_at_or_with_no_room_has_no_start() -> None:
    net = mesh(2)
    nodes = list(net.nodes.values())
    ctl = controller(net, nodes[1], FakeSlurm())
    ctl.site = "C"  # "across" allows A and B only
    ctl.serving_elsewhere = lambda model: {}
    announce(net, ctl, nodes[1], 1.0)
    apply(net, nodes[0], "across")
    trio.run(ctl.tick)
    assert ctl.starts == {}
    ctl.site = "A"
    ctl.serving_elsewhere = lambda model: {"B": 2}  # B serves both: A's ceiling is 0
    trio.run(ctl.tick)
    assert ctl.starts == {}
    ctl.serving_elsewhere = lambda model: {"B": 0}
    trio.run(ctl.tick)
    assert set(ctl.starts) == {"m"}
