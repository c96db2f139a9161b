"""Data residency's pure parts: the allowed set (an intersection), its header on forwards,
the sites of the request header and of API keys, and the 403's words."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane import residency
from fabricnode.dataplane.keytable import ApiKey
from fabricnode.dataplane.request import Routed, allowed_sites, parse_require
from fabricnode.dataplane.routing import NodeInfo, meets

NAMES = st.sampled_from(["A", "B", "C", "eu-1", "us_2", "a"])
SITES = st.none() | st.frozensets(NAMES, max_size=4)


@given(SITES, SITES)
def test_narrowing_is_commutative_and_never_widens(a: residency.Sites, b: residency.Sites) -> None:
    both = residency.narrow(a, b)
    assert both == residency.narrow(b, a)
    for given_set in (a, b):
        if given_set is not None:
            assert both is not None and both <= given_set
    if a is None and b is None:
        assert both is None


@given(SITES, SITES, SITES)
def test_narrowing_is_associative_and_any_site_is_its_identity(
    a: residency.Sites, b: residency.Sites, c: residency.Sites
) -> None:
    n = residency.narrow
    assert n(n(a, b), c) == n(a, n(b, c))
    assert n(a, None) == a and n(None, a) == a
    assert n(a, a) == a


@given(SITES, SITES, NAMES)
def test_a_site_is_allowed_only_if_every_limit_allows_it(
    a: residency.Sites, b: residency.Sites, site: str
) -> None:
    assert residency.allows(residency.narrow(a, b), site) == (
        residency.allows(a, site) and residency.allows(b, site)
    )


@given(st.frozensets(NAMES, max_size=6))
def test_the_carried_set_round_trips_through_its_header(sites: frozenset[str]) -> None:
    raw = residency.encode(sites)
    assert residency.decode(raw) == sites
    assert raw == residency.encode(frozenset(sorted(sites)))  # one spelling per set


@pytest.mark.parametrize(
    "raw", [b"A,,B", b"A B", b"-A", b"\xff", b",".join([b"s%d" % i for i in range(33)])]
)
def test_a_malformed_carried_set_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="x-fabric-sites"):
        residency.decode(raw)


def test_the_site_requirement_takes_alternatives_of_exact_names() -> None:
    req = parse_require("gpu=H100, site = A|eu-1 ,quant>=8")
    assert req.sites == frozenset({"A", "eu-1"}) and req.gpu == frozenset({"h100"})
    assert parse_require("site=A").sites == frozenset({"A"})
    assert parse_require("gpu=H100").sites is None


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("site=", "cannot be empty"),
        ("site=A|", "cannot be empty"),
        ("site=A||B", "cannot be empty"),
        ("site=a b", "ASCII letters"),
        ("site=" + "x" * 33, "at most 32"),
        ("site>=A", "expected gpu=TYPE"),
        ("site=A,site=B", "site given twice"),
        ("site=" + "|".join(f"s{i}" for i in range(33)), "more than 32 sites"),
    ],
)
def test_a_malformed_site_requirement_is_refused_with_the_term(header: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_require(header)


def node(site: str) -> NodeInfo:
    return NodeInfo(
        session_id="s" * 32,
        url="http://10.0.0.1:8080",
        provider="p",
        verified_provider=None,
        certified_name=None,
        gpu_type="H100",
        gpu_count=1,
        max_model_len=4096,
        quantization=None,
        site=site,
    )


def test_the_site_requirement_matches_the_nodes_signed_site_exactly() -> None:
    req = parse_require("site=A|B")
    assert meets(node("A"), req) and meets(node("B"), req)
    assert not meets(node("a"), req) and not meets(node("default"), req)


def key(sites: frozenset[str] | None) -> ApiKey:
    return ApiKey("0" * 8, "k", b"\0" * 32, 0.0, sites=sites)


@given(SITES, SITES)
def test_a_request_is_allowed_the_sites_its_key_and_header_both_allow(
    key_sites: residency.Sites, header_sites: residency.Sites
) -> None:
    header = None if header_sites is None else parse_require("gpu=H100")
    if header is not None and header_sites:
        header = parse_require("site=" + "|".join(sorted(header_sites)))
    expected = residency.narrow(key_sites, header.sites if header is not None else None)
    assert allowed_sites(key(key_sites), header) == expected
    routed = Routed("chat", "m", False, {}, key(key_sites), frozenset(), header, None, 0)
    assert routed.sites == expected
    assert allowed_sites(None, None) is None


def test_the_refusal_names_the_allowed_sites_or_each_limit() -> None:
    some = residency.refusal_message(
        "m", frozenset({"B", "A"}), key_sites=None, header_sites=None, model_sites=None
    )
    assert some == "model 'm' is not served at any site this request may use (allowed sites: A, B)"
    none = residency.refusal_message(
        "m",
        frozenset(),
        key_sites=frozenset({"A"}),
        header_sites=frozenset({"C"}),
        model_sites=frozenset({"A", "C"}),
    )
    assert none == (
        "no site may serve this request: the API key allows A; X-Fabric-Require allows C; "
        "the service file allows 'm' at A, C"
    )
