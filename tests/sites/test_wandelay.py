"""The WAN model of tests/support/wandelay.py, driven with a hand-held clock: which packet leaves
when, which is dropped and why. No namespaces, no root (test_emulated_sites.py runs it for real).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.wandelay import Link, Wan, config_json, wan_from_config

SITES = {"a": "10.201.0.0/24", "b": "10.201.1.0/24", "c": "10.201.2.0/24"}
ADDRESS = {"a": bytes([10, 201, 0, 10]), "b": bytes([10, 201, 1, 10]), "c": bytes([10, 201, 2, 10])}


def packet(src: str, dst: str, size: int = 100, tag: int = 0) -> bytes:
    """An IPv4 packet of ``size`` bytes from ``src``'s gateway to ``dst``'s (only the header
    fields the router reads are real; ``tag`` tells packets apart)."""
    header = bytes([0x45, 0, 0, 0, tag >> 8 & 0xFF, tag & 0xFF, 0, 0, 64, 17, 0, 0])
    return header + ADDRESS[src] + ADDRESS[dst] + bytes(size - 20)


def wan(link: Link, *, seed: int = 0) -> Wan:
    return Wan(SITES, {("a", "b"): link, ("a", "c"): Link(rtt_ms=150)}, seed=seed)


def run(w: Wan, until: float) -> list[tuple[float, bytes]]:
    """Release everything due up to ``until`` as the process would: at each release time."""
    out = []
    while (due := w.next_due()) is not None and due <= until:
        out += [(due, p) for p in w.release(due)]
    return out


def test_a_packet_leaves_half_the_rtt_after_it_arrived_never_earlier() -> None:
    w = wan(Link(rtt_ms=40))
    w.arrive(packet("a", "b"), now=10.0)
    assert w.next_due() == pytest.approx(10.020)
    assert w.release(10.0199) == []
    assert w.release(10.020) == [packet("a", "b")]
    w.arrive(packet("c", "a"), now=11.0)
    assert w.next_due() == pytest.approx(11.075)  # the other link's 150 ms


def test_jitter_spreads_the_delay_within_its_bounds_and_never_reorders() -> None:
    w = wan(Link(rtt_ms=40, jitter_ms=10), seed=1)
    sent = [packet("a", "b", tag=i) for i in range(200)]
    for i, p in enumerate(sent):
        w.arrive(p, now=i * 0.001)  # 1 ms apart: a jittered one may catch up with the one ahead
    released = run(w, until=10)
    assert [p for _, p in released] == sent
    delays = [t - i * 0.001 for i, (t, _) in enumerate(released)]
    assert min(delays) >= 0.010 and max(delays) <= 0.030 + 1e-9
    assert max(delays) - min(delays) > 0.010  # spread, not a constant


def test_sparse_probes_see_the_uniform_jitter_set() -> None:
    w = wan(Link(rtt_ms=40, jitter_ms=5), seed=2)
    delays = []
    for i in range(400):
        w.arrive(packet("a", "b"), now=float(i))
        ((t, _),) = run(w, until=i + 0.5)
        delays.append(t - i)
    assert 0.015 <= min(delays) < 0.016 and 0.024 < max(delays) <= 0.025
    assert sum(delays) / len(delays) == pytest.approx(0.020, abs=0.0005)


def test_loss_drops_the_share_set_from_a_seeded_rng() -> None:
    def survivors(seed: int) -> list[int]:
        w = wan(Link(rtt_ms=10, loss=0.2), seed=seed)
        for i in range(2000):
            w.arrive(packet("a", "b", tag=i), now=i * 0.001)
        return [int.from_bytes(p[4:6], "big") for _, p in run(w, until=100)]

    kept = survivors(7)
    assert kept == survivors(7)  # the same seed, the same packets lost
    assert kept != survivors(8)
    assert 0.17 < 1 - len(kept) / 2000 < 0.23


def test_bandwidth_serialises_packets_one_after_the_other() -> None:
    # 8 Mbit/s: a 1000-byte packet holds the direction 1 ms.
    w = wan(Link(rtt_ms=20, bandwidth_mbit=8))
    for i in range(10):
        w.arrive(packet("a", "b", size=1000, tag=i), now=0.0)
    times = [t for t, _ in run(w, until=10)]
    assert times == pytest.approx([0.010 + 0.001 * (i + 1) for i in range(10)])
    # The other direction has its own serialiser (full duplex).
    w.arrive(packet("b", "a", size=1000), now=0.0)
    assert run(w, until=10)[0][0] == pytest.approx(0.011)


def test_a_full_queue_drops_the_packets_that_do_not_fit() -> None:
    w = wan(Link(rtt_ms=20, bandwidth_mbit=8, queue_bytes=5000))
    for i in range(10):
        w.arrive(packet("a", "b", size=1000, tag=i), now=0.0)
    stats = w.statistics().direction("a", "b")
    assert (stats.held, stats.overflow) == (5, 5)
    assert len(run(w, until=10)) == 5
    # Once the queue has drained, packets are accepted again.
    w.arrive(packet("a", "b", size=1000), now=1.0)
    assert w.statistics().direction("a", "b").held == 1


def test_the_default_queue_is_one_bandwidth_delay_product_at_least_64_kib() -> None:
    assert Link(bandwidth_mbit=8).queue_limit_bytes == 64 * 1024
    assert Link(rtt_ms=200, bandwidth_mbit=100).queue_limit_bytes == 2_500_000
    assert Link(rtt_ms=200).queue_limit_bytes is None


def test_a_cut_drops_new_packets_and_those_on_the_wire_until_healed() -> None:
    w = wan(Link(rtt_ms=40))
    w.arrive(packet("a", "b"), now=0.0)
    w.cut("b", "a")
    w.arrive(packet("b", "a"), now=0.001)
    w.arrive(packet("a", "c"), now=0.001)  # another link: not cut
    assert [p for _, p in run(w, until=1)] == [packet("a", "c")]
    assert w.statistics().direction("a", "b").cut == 1  # the one on the wire
    assert w.statistics().direction("b", "a").cut == 1
    w.heal("a", "b")
    w.arrive(packet("a", "b"), now=2.0)
    assert [p for _, p in run(w, until=3)] == [packet("a", "b")]


def test_packets_outside_the_sites_segments_are_dropped_as_unrouted() -> None:
    w = wan(Link(rtt_ms=40))
    lan = packet("a", "b")[:16] + bytes([10, 200, 1, 11]) + bytes(80)  # b's LAN, not its WAN
    ipv6 = bytes([0x60]) + bytes(59)
    for p in (lan, ipv6, b"\x45"):
        w.arrive(p, now=0.0)
    w.arrive(packet("b", "c"), now=0.0)  # no link between b and c in this WAN
    assert w.next_due() is None
    assert w.statistics().unrouted == 4


def test_set_link_applies_to_the_packets_that_arrive_after_it() -> None:
    w = wan(Link(rtt_ms=40))
    w.arrive(packet("a", "b"), now=0.0)
    w.set_link("a", "b", Link(rtt_ms=100))
    w.arrive(packet("a", "b"), now=0.0)
    assert [t for t, _ in run(w, until=1)] == pytest.approx([0.020, 0.050])


def test_control_commands_answer_ok_or_a_one_line_error() -> None:
    w = wan(Link(rtt_ms=40))
    assert w.handle({"op": "cut", "a": "a", "b": "b"}) == {"ok": True}
    assert w.is_cut("a", "b")
    assert w.handle({"op": "heal", "a": "b", "b": "a"}) == {"ok": True}
    assert not w.is_cut("a", "b")
    assert w.handle({"op": "set", "a": "a", "b": "c", "link": {"rtt_ms": 7}}) == {"ok": True}
    assert w.link("c", "a") == Link(rtt_ms=7)
    stats = w.handle({"op": "stats"})
    assert stats["ok"] and stats["unrouted"] == 0
    for bad in (
        {"op": "cut", "a": "a", "b": "x"},
        {"op": "cut", "a": "a", "b": "a"},
        {"op": "set", "a": "a", "b": "b", "link": {"rtt": 1}},
        {"op": "set", "a": "a", "b": "b", "link": {"loss": 2}},
        {"op": "fly"},
    ):
        reply = w.handle(bad)
        assert reply["ok"] is False and "\n" not in reply["error"], bad


def test_the_configuration_line_round_trips() -> None:
    links = [("a", "b", Link(rtt_ms=40, jitter_ms=2, loss=0.01, bandwidth_mbit=50))]
    line = config_json({"a": SITES["a"], "b": SITES["b"]}, links, seed=3, tun="tun0")
    w = wan_from_config(json.loads(line))
    assert w.link("a", "b") == links[0][2] and w.seed == 3


@given(
    arrivals=st.lists(
        st.tuples(st.floats(0, 1), st.integers(40, 1500), st.sampled_from(["ab", "ba", "ac"])),
        max_size=60,
    ),
    rtt_ms=st.floats(0, 300),
    jitter_ms=st.floats(0, 50),
    bandwidth=st.none() | st.floats(0.1, 1000),
)
def test_no_packet_leaves_early_or_out_of_order_within_its_direction(
    arrivals: list[tuple[float, int, str]],
    rtt_ms: float,
    jitter_ms: float,
    bandwidth: float | None,
) -> None:
    link = Link(rtt_ms=rtt_ms, jitter_ms=jitter_ms, bandwidth_mbit=bandwidth, queue_bytes=10**9)
    w = Wan(SITES, {("a", "b"): link, ("a", "c"): link})
    arrived = {}
    for i, (now, size, way) in enumerate(sorted(arrivals)):
        p = packet(way[0], way[1], size=size, tag=i)
        w.arrive(p, now)
        arrived[p] = now
    released = run(w, until=1e9)
    assert len(released) == len(arrivals)
    for t, p in released:
        assert t >= arrived[p] + max(0.0, rtt_ms / 2000 - jitter_ms / 1000) - 1e-9
    by_way: dict[tuple[bytes, bytes], list[int]] = {}
    for _, p in released:
        by_way.setdefault((p[12:15], p[16:19]), []).append(int.from_bytes(p[4:6], "big"))
    assert all(tags == sorted(tags) for tags in by_way.values())
