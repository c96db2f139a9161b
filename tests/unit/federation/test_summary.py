"""Signed site summaries: round trip, strict decoding, and no mutated byte that verifies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.errors import DecodeError
from fabricnode.federation.sitekey import SiteKey
from fabricnode.federation.summary import (
    MAX_MODELS,
    MAX_START_S,
    ModelCapacity,
    SiteSummary,
    SummaryBody,
    capacity_of,
    decode,
    gateways_of,
    next_seq,
)
from fabricnode.mesh import codec
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity, canonical
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import ModelInfo, State
from fabricnode.mesh.wire import Load
from fabricnode.testing.simnet import make_body

NOW = 1_750_000_000.0

capacities = st.builds(
    lambda r, a, w, b, kv, start: ModelCapacity(r, min(a, r), w, b, kv, start),
    st.integers(0, 1000),
    st.integers(0, 1000),
    st.integers(0, 10**6),
    st.integers(0, 10**9),
    st.floats(0.0, 1.0, allow_nan=False),
    st.one_of(st.none(), st.floats(0.0, MAX_START_S, allow_nan=False)),
)
model_names = st.text(
    st.characters(min_codepoint=33, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Zl", "Zp")),
    min_size=1,
    max_size=40,
).filter(str.isprintable)
gateways = st.lists(
    st.builds(lambda i, p: f"10.0.{i}.1:{p}", st.integers(0, 255), st.integers(1, 65535)),
    max_size=16,
    unique=True,
)
bodies = st.builds(
    lambda seq, at, gw, models: SummaryBody("A", seq, at, tuple(gw), models),
    st.integers(1, 2**62),
    st.floats(0.0, 1e10, allow_nan=False),
    gateways,
    st.dictionaries(model_names, capacities, max_size=8),
)


def sample(key: SiteKey, seq: int = 1) -> SiteSummary:
    models = {"llama": ModelCapacity(3, 2, 1, 500, 0.25), "qwen": ModelCapacity(1, 0, 4, 0, 0.9)}
    return SiteSummary.sign(SummaryBody("A", seq, NOW, ("gw.a:7950",), models), key)


@settings(max_examples=60, deadline=None)
@given(body=bodies)
def test_summary_round_trips(site_keys: dict[str, SiteKey], body: SummaryBody) -> None:
    summary = SiteSummary.sign(body, site_keys["A"])
    back = decode(summary.encode())
    assert back.body == body
    assert back.verify(site_keys["A"].cert.public_key)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_mutated_byte_fails_verification_or_decoding(
    site_keys: dict[str, SiteKey], data: st.DataObject
) -> None:
    wire = bytearray(sample(site_keys["A"]).encode())
    index = data.draw(st.integers(0, len(wire) - 1))
    flip = data.draw(st.integers(1, 255))
    wire[index] ^= flip
    try:
        summary = decode(bytes(wire))
    except DecodeError:
        return
    assert not summary.verify(site_keys["A"].cert.public_key)


@given(junk=st.binary(max_size=300))
def test_garbage_is_a_decode_error(junk: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(junk)


def test_a_summary_signed_by_another_site_key_does_not_verify(
    site_keys: dict[str, SiteKey],
) -> None:
    summary = sample(site_keys["A"])
    assert not summary.verify(site_keys["B"].cert.public_key)
    with pytest.raises(ValueError, match="cannot sign"):
        SiteSummary.sign(SummaryBody("C", 1, NOW, (), {}), site_keys["A"])


def test_bounds_are_refused_at_signing(site_keys: dict[str, SiteKey]) -> None:
    too_many = {f"m{i:04}": ModelCapacity(1, 1, 0, 0, 0.0) for i in range(MAX_MODELS + 1)}
    with pytest.raises(ValueError, match="models"):
        SiteSummary.sign(SummaryBody("A", 1, NOW, (), too_many), site_keys["A"])
    gws = tuple(f"10.0.0.{i}:1" for i in range(17))
    with pytest.raises(ValueError, match="gateways"):
        SiteSummary.sign(SummaryBody("A", 1, NOW, gws, {}), site_keys["A"])
    with pytest.raises(ValueError, match="admitting"):
        SiteSummary.sign(
            SummaryBody("A", 1, NOW, (), {"m": ModelCapacity(1, 2, 0, 0, 0.0)}), site_keys["A"]
        )


def test_sequence_follows_the_clock_and_never_goes_back() -> None:
    assert next_seq(0, NOW) == int(NOW * 1000)
    assert next_seq(int(NOW * 1000) + 5, NOW) == int(NOW * 1000) + 6


def _core() -> MeshCore:
    me = Identity.from_seed(b"fed-self")
    return MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "10.0.0.1:7946", NOW), NOW)


def _add(core: MeshCore, name: str, index: int, **kw: object) -> str:
    identity = Identity.from_seed(name.encode())
    addr = f"10.0.0.{index}:7946"
    kw.setdefault("site", "A")  # the gateway's own site (another site's entries do not count)
    entry = make_body(identity, addr, NOW, **kw).sign(identity)  # type: ignore[arg-type]
    assert core.registry.merge(entry, NOW).changed
    core.members.learn_address(entry.session_id, addr, NOW)
    return entry.session_id


def test_capacity_counts_serving_replicas_and_their_load() -> None:
    core = _core()
    llama = ModelInfo("llama", 8192, None)
    a = _add(core, "a", 2, state=State.SERVING, models=(llama,))
    b = _add(core, "b", 3, state=State.SERVING, models=(llama,))
    _add(core, "joining", 4, models=(llama,))
    _add(core, "gone", 5, state=State.LEFT, models=(llama,))
    _add(core, "of-b", 6, state=State.SERVING, models=(llama,), site="B")  # not our site's
    core.loads[a] = Load(a, 1, 0, 3, 0.5, 0, NOW)
    core.loads[b] = Load(b, 1, 2, 3, 0.3, 0, NOW)
    caps = capacity_of(core, "A", NOW)
    assert set(caps) == {"llama"}
    cap = caps["llama"]
    assert cap.replicas == 2
    assert cap.admitting == 1  # b queues requests
    assert cap.waiting == 2
    assert cap.kv_usage == pytest.approx(0.4)
    # a stale report counts nothing
    assert capacity_of(core, "A", NOW + 60)["llama"].waiting == 0


def test_gateways_come_from_the_gateway_label_ours_first() -> None:
    core = _core()
    _add(core, "g2", 2, labels=(("fabric.gateway", "gw2.a:7950"),))
    _add(core, "bad", 3, labels=(("fabric.gateway", "0.0.0.0:7950"),))
    assert gateways_of(core, "A", "gw1.a:7950") == ("gw1.a:7950", "gw2.a:7950")


def test_capacity_lists_the_starts_the_controller_expects() -> None:
    """A model the controller would start gets its expected start, with a row of no replica
    when none serves; a start out of bounds is left out rather than break the summary."""
    core = _core()
    llama = ModelInfo("llama", 8192, None)
    _add(core, "a", 2, state=State.SERVING, models=(llama,))
    caps = capacity_of(core, "A", NOW, starts={"qwen": 21.5, "llama": 30.0, "bad": -1.0})
    assert set(caps) == {"llama", "qwen"}
    assert (caps["qwen"].replicas, caps["qwen"].start_s) == (0, 21.5)
    assert (caps["llama"].replicas, caps["llama"].start_s) == (1, 30.0)
    assert capacity_of(core, "A", NOW)["llama"].start_s is None


def test_a_start_in_a_summary_is_a_float_within_a_week(site_keys: dict[str, SiteKey]) -> None:
    """The seventh field of a model's row (``start_s``) decodes strictly: present only as a
    float in [0, MAX_START_S]; a row of six fields is a site that says no start."""

    def signed(row: list[object]) -> bytes:
        body = canonical(b"fabric/site-summary/v1", "A", 1, NOW, [], [row])
        return codec.pack([body, site_keys["A"].sign(body)])

    base: list[object] = ["m", 0, 0, 0, 0, 0.0]
    assert decode(signed(base)).body.models["m"].start_s is None
    assert decode(signed([*base, 12.5])).body.models["m"].start_s == 12.5
    for bad in ([*base, 12], [*base, -1.0], [*base, MAX_START_S * 2], [*base, 1.0, 2.0]):
        with pytest.raises(DecodeError):
            decode(signed(bad))
