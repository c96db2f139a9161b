"""When an agent counts as joined (``JoinTracker``): a member answered, nobody to join, or no
seed answered in time; and once joined it stays joined."""

from __future__ import annotations

from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.join import JoinTracker
from fabricnode.mesh.keyring import Keyring
from fabricnode.testing.simnet import make_body

NOW = 1_750_000_000.0


def lonely_core() -> MeshCore:
    me = Identity.from_seed(b"lonely")
    return MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "10.0.0.9:7946", NOW), NOW)


def test_join_tracker_is_ready_at_once_without_seeds() -> None:
    core = lonely_core()
    tracker = JoinTracker(core, had_seeds=False, started_at=0.0, timeout_s=10, clock=lambda: 0)
    assert tracker.is_ready()


def test_join_tracker_waits_for_an_alive_member_when_it_had_seeds() -> None:
    core = lonely_core()
    now = [0.0]
    tracker = JoinTracker(core, had_seeds=True, started_at=0.0, timeout_s=10, clock=lambda: now[0])
    assert not tracker.is_ready()
    other = Identity.from_seed(b"other")
    core.registry.merge(make_body(other, "10.0.0.8:7946", NOW).sign(other), NOW)
    core.members.learn_address(other.session_id, "10.0.0.8:7946", NOW)
    assert tracker.is_ready()
    assert tracker.reason == "joined the mesh"


def test_join_tracker_founds_a_new_mesh_when_no_seed_answers_in_time() -> None:
    core = lonely_core()
    now = [0.0]
    tracker = JoinTracker(core, had_seeds=True, started_at=0.0, timeout_s=10, clock=lambda: now[0])
    assert not tracker.is_ready()
    now[0] = 10.0
    assert tracker.is_ready()
    now[0] = 0.0
    assert tracker.is_ready(), "once joined, stays joined"
