"""The ingress's decisions about sites (``fabricnode.dataplane.across``): what a peer site may
bring in, where a request no node of ours takes goes out, residency's routes and refusals, and
where a Responses follow-up goes. No sockets, no mesh: a table of routes and offers."""

from __future__ import annotations

import math

import orjson
import pytest

from fabricnode.dataplane import residency, responses
from fabricnode.dataplane.across import Across, refused_here
from fabricnode.dataplane.job import BatchSlot, Job
from fabricnode.dataplane.keytable import ApiKey
from fabricnode.dataplane.request import Rejection, Routed, pinned_node
from fabricnode.dataplane.responses import PinnedNode
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.routing import (
    Candidate,
    NodeInfo,
    RouteRequest,
    make_policy,
    prompt_blocks,
)
from fabricnode.dataplane.sites import HOP_PUSH, HOP_SITE, Prompt, SiteOffer
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import Standing

RING = Keyring.with_key(b"k" * 32)
NODE = "b" * 32


def route(sid: str, site: str = "A") -> Route:
    info = NodeInfo(sid, f"http://{sid[:4]}", "p", None, None, "L4", 1, 4096, None, site=site)
    return Route(info, ("127.0.0.1", 1), math.inf, False)


class Table:
    def __init__(self, gateways: int = 0, asleep: list[Route] | None = None) -> None:
        self._gateways = [route(f"{i:032x}") for i in range(gateways)]
        self._asleep = asleep

    def sleeping(self, model: str) -> list[Route] | None:
        return self._asleep

    def gateways(self) -> list[Route]:
        return list(self._gateways)


def across(table: Table | None = None, declared: bool = False) -> tuple[Across, list[str]]:
    refused: list[str] = []
    made = Across(
        "A",
        table or Table(),
        lambda: RING,
        refused.append,
        (lambda model: 60.0) if declared else None,
    )
    return made, refused


def routed(doc: dict[str, object] | None = None, sites: frozenset[str] | None = None) -> Routed:
    doc = doc if doc is not None else {"model": "m"}
    r = Routed("responses", "m", False, doc, None, frozenset(), None, None, 0)
    r.pinned = pinned_node(doc)
    r.sites = sites
    return r


def test_a_request_from_a_peer_site_is_taken_in_only_when_our_site_is_allowed() -> None:
    a, refused = across()
    assert a.taken_in("C", {}) is None  # any site
    assert a.taken_in("C", {residency.SITES_HEADER: b"A,B"}) == frozenset({"A", "B"})
    no = a.taken_in("C", {residency.SITES_HEADER: b"B"})
    assert (
        isinstance(no, Rejection) and no.status == 403 and refused == [residency.FORWARD_ELSEWHERE]
    )
    bad = a.taken_in("C", {residency.SITES_HEADER: b"\xff"})
    assert isinstance(bad, Rejection) and bad.status == 400 and "'C'" in bad.message


def test_an_agent_spreads_out_going_requests_over_its_sites_gateways() -> None:
    a, _ = across(Table(gateways=3))
    firsts = [a.out_routes("m", None)[0].info.session_id for _ in range(6)]
    assert len(set(firsts)) == 3 and firsts[:3] == firsts[3:]
    assert across()[0].out_routes("m", None) == []  # no gateway: nowhere


def test_a_gateway_offers_the_peer_sites_that_serve_the_model_and_are_allowed() -> None:
    a, refused = across()
    offers = [
        SiteOffer("C", ("10.0.0.1:7000",), True, 0.1, 1, 1, 0),
        SiteOffer("B", ("10.0.0.2:7000",), True, 0.2, 1, 1, 0),
    ]
    a.offers = lambda model: offers if model == "m" else []
    out = a.out_routes("m", frozenset({"B"}))
    assert [r.info.site for r in out] == ["B"] and out[0].hop == HOP_SITE
    assert [r.info.site for r in a.out_routes("m", None)] == ["C", "B"]
    # nothing for an unknown model: 404; sites serve it but none allowed: 403 (counted)
    assert a.not_served("x", True, None, 1).status == 404
    denied = a.not_served("m", True, frozenset({"D"}), 1)
    assert denied.status == 403 and refused == [residency.NOT_SERVED_THERE]
    busy = a.not_served("m", True, None, 7)
    assert busy.status == 503 and (b"retry-after", b"7") in busy.headers


def test_residency_keeps_the_allowed_routes_and_refuses_what_cannot_be_served() -> None:
    here, there = route("1" * 32, "A"), route("2" * 32, "B")
    a, refused = across()
    assert a.within(routed(sites=frozenset({"B"})), None, [here, there]) == ([there], False)
    asleep = route("3" * 32, "B")
    a2, _ = across(Table(asleep=[asleep]))
    assert a2.within(routed(sites=frozenset({"B"})), None, [here]) == ([asleep], True)
    no_common = a.within(routed(sites=frozenset()), None, [here])
    assert isinstance(no_common, Rejection) and refused[-1] == residency.NO_COMMON_SITE
    elsewhere = a.within(routed(sites=frozenset({"C"})), None, [here])
    assert isinstance(elsewhere, Rejection) and elsewhere.status == 403
    assert refused[-1] == residency.NOT_SERVED_THERE
    # ...unless a replica may start (declared) or a gateway may find site C
    assert across(declared=True)[0].within(routed(sites=frozenset({"C"})), None, [here]) == (
        None,
        False,
    )
    assert across(Table(gateways=1))[0].within(routed(sites=frozenset({"C"})), None, [here]) == (
        None,
        False,
    )


def facts(sid: str) -> PinnedNode:
    return PinnedNode(State.SERVING, Standing.ROUTABLE, True)


def test_a_follow_up_of_a_response_another_site_stores_goes_to_that_site_alone() -> None:
    a, refused = across()
    _, rid = responses.tagged({}, NODE, b"\x01" * 8, RING, "site:A/-", "C")
    r = routed({"model": "m", "previous_response_id": rid})
    assert a.responses_routes(r, [route(NODE)], "", facts) == (None, None, "C")
    assert r.sites == frozenset({"C"})
    # limited to sites that leave C out: 403, counted
    limited = routed({"model": "m", "previous_response_id": rid}, frozenset({"A"}))
    no = a.responses_routes(limited, None, "", facts)
    assert isinstance(no, Rejection) and no.status == 403 and "site 'C'" in no.message
    assert refused == [residency.NOT_SERVED_THERE]
    # from a peer site: never sent on (the 404 of an unknown id)
    bounced = routed({"model": "m", "previous_response_id": rid, "request_id": "-"})
    again = a.responses_routes(bounced, None, "B", facts)
    assert isinstance(again, Rejection) and again.status == 404


def test_a_response_from_a_peer_site_is_owned_by_that_sites_reference() -> None:
    a, _ = across()
    ref = "0123456789abcdef"
    new = routed({"model": "m", "request_id": ref})
    assert a.responses_routes(new, [route(NODE)], "C", facts) == (
        [route(NODE)],
        f"site:C/{ref}",
        "",
    )
    nameless = a.responses_routes(routed({"model": "m"}), [route(NODE)], "C", facts)
    assert isinstance(nameless, Rejection) and nameless.status == 400
    # stored here for C's reference: continued from C with it, not with another or from B
    _, rid = responses.tagged({}, NODE, b"\x02" * 8, RING, f"site:C/{ref}", "A")
    follow = {"model": "m", "previous_response_id": rid, "request_id": ref}
    assert a.responses_routes(routed(follow), [route(NODE)], "C", facts) == (
        [route(NODE)],
        f"site:C/{ref}",
        "",
    )
    for site, other in (("B", ref), ("C", "fedcba9876543210")):
        doc = {**follow, "request_id": other}
        no = a.responses_routes(routed(doc), [route(NODE)], site, facts)
        assert isinstance(no, Rejection) and no.status == 404


@pytest.mark.parametrize("keyed", [False, True])
def test_a_local_follow_up_is_pinned_to_its_node_and_checked_for_its_key(keyed: bool) -> None:
    a, _ = across()
    _, rid = responses.tagged({}, NODE, b"\x03" * 8, RING, "key-1")
    r = routed({"model": "m", "previous_response_id": rid})
    if keyed:
        r.key = ApiKey("key-2", "bob", b"\x00" * 32, 0.0)
        no = a.responses_routes(r, [route(NODE), route("c" * 32)], "", facts)
        assert isinstance(no, Rejection) and no.status == 404
    else:
        assert a.responses_routes(r, [route(NODE), route("c" * 32)], "", facts) == (
            [route(NODE)],
            None,
            "",
        )
    assert orjson.dumps(r.doc)  # the decoded body is left as it came


def test_a_forward_or_a_peer_sites_request_is_refused_here_only_outside_its_sites() -> None:
    assert refused_here(None, "A") is None
    assert refused_here(frozenset({"A", "C"}), "A") is None
    no = refused_here(frozenset({"C"}), "A")
    assert no is not None and (no.status, no.code) == (403, residency.SITE_NOT_ALLOWED)
    assert "site 'A'" in no.message and "C" in no.message


def test_a_request_our_nodes_cannot_admit_is_pushed_to_a_gateway_or_an_admitting_site() -> None:
    """Two-layer routing (``sites`` rule 5): an agent pushes to its site's gateways (asking each
    to route it anywhere, our site first); a gateway to the peer sites that can admit it now."""
    agent, _ = across(Table(gateways=2))
    pushed = agent.push_routes("m", None)
    assert [r.hop for r in pushed] == [HOP_PUSH, HOP_PUSH]
    assert across()[0].push_routes("m", None) == []  # no gateway: it waits here
    gateway, _ = across()
    offers = [
        SiteOffer("B", ("10.0.0.2:7000",), True, 0.05, 2, 0, 9),  # full: never pushed to
        SiteOffer("C", ("10.0.0.3:7000",), True, 0.20, 1, 1, 0),
        SiteOffer("D", ("10.0.0.4:7000",), True, 0.10, 1, 1, 0),
    ]
    gateway.offers = lambda model: offers
    assert [r.info.site for r in gateway.push_routes("m", None)] == ["D", "C"]
    assert [r.info.site for r in gateway.push_routes("m", frozenset({"C"}))] == ["C"]
    assert gateway.push_routes("m", frozenset({"B"})) == []  # the allowed site is full
    # taking a request out (no node of ours serves the model) still offers every site
    assert [r.info.site for r in gateway.out_routes("m", None)] == ["D", "C", "B"]


def test_a_pushed_conversation_goes_back_to_the_site_it_was_pushed_to_while_it_admits() -> None:
    gateway, _ = across()
    offers = [
        SiteOffer("C", ("10.0.0.3:7000",), True, 0.20, 1, 1, 0),
        SiteOffer("D", ("10.0.0.4:7000",), True, 0.10, 1, 1, 0),
    ]
    gateway.offers = lambda model: offers
    assert [r.info.site for r in gateway.push_routes("m", None, "conv")] == ["D", "C"]
    gateway.pushed_to("conv", "C")  # D was busy that turn: it went to C
    assert [r.info.site for r in gateway.push_routes("m", None, "conv")] == ["C", "D"]
    assert [r.info.site for r in gateway.push_routes("m", None, "other")] == ["D", "C"]
    offers[0] = SiteOffer("C", ("10.0.0.3:7000",), True, 0.20, 1, 0, 4)  # C full now
    assert [r.info.site for r in gateway.push_routes("m", None, "conv")] == ["D"]


def test_a_request_our_pick_would_start_late_goes_to_a_quicker_site_from_a_gateway() -> None:
    """Rule 6: the pick's wait (its prefill backlog) against each admitting site's round trip
    and backlog, the quickest first; never a conversation's turn; an agent that is not a
    gateway knows no peer site's wait and keeps the request."""
    gateway, _ = across()
    offers = [
        SiteOffer("B", ("10.0.0.2:7000",), True, 0.04, 2, 1, 0, True, 0.5),  # 0.54 s
        SiteOffer("C", ("10.0.0.3:7000", "10.0.0.9:7000"), True, 0.15, 2, 1, 0),  # 0.15 s
        SiteOffer("D", ("10.0.0.4:7000",), True, 0.01, 2, 0, 3),  # full
    ]
    gateway.offers = lambda model: offers
    assert gateway.quicker_routes("m", None, None, 0.1) == []  # ours is quicker
    sites_of = [r.info.site for r in gateway.quicker_routes("m", None, None, 1.0)]
    assert sites_of == ["C", "C", "B"]
    # a conversation keeps its site and replica while they admit it (its cache is there)
    assert gateway.quicker_routes("m", None, "conv", 9.0) == []
    assert [r.info.site for r in gateway.quicker_routes("m", frozenset({"B"}), None, 1.0)] == ["B"]
    assert gateway.quicker_routes("m", frozenset({"D"}), None, 9.0) == []
    agent, _ = across(Table(gateways=2))
    assert agent.quicker_routes("m", None, None, 9.0) == []


def test_push_asks_the_rule_its_wait_names_and_only_for_a_request_that_may_go_out() -> None:
    gateway, _ = across()
    offers = [SiteOffer("C", ("10.0.0.3:7000",), True, 0.15, 2, 1, 0)]
    gateway.offers = lambda model: offers
    here = [route(NODE)]
    job = Job("chat", "m", False, b"{}", b"/v1/chat/completions", {}, None, 0.0, None)
    assert [r.info.site for r in gateway.push(job, here, None, None)] == ["C"]  # rule 5
    assert [r.info.site for r in gateway.push(job, here, None, 0.5)] == ["C"]  # rule 6
    assert gateway.push(job, here, None, 0.1) == []
    job.from_site = "B"  # came from a peer site: never sent on
    assert gateway.push(job, here, None, None) == []
    assert gateway.push(job, here, None, 5.0) == []


def test_a_declared_model_served_elsewhere_goes_there_rather_than_wait_for_a_start_here() -> None:
    """A declared model no node of ours serves: a gateway sends the request to the peer sites
    that serve it now; an agent hands it to a gateway of ours; it waits here for a start when
    no site serves it, when it came from a peer site, or when it may be served here only."""
    gateway, _ = across()
    offers = [
        SiteOffer("B", ("10.0.0.2:7000",), True, 0.04, 0, 0, 0),  # declared there too, none yet
        SiteOffer("C", ("10.0.0.3:7000",), True, 0.15, 2, 0, 3),  # serves (busy, but serves)
    ]
    gateway.offers = lambda model: offers
    assert [r.info.site for r in gateway.instead_of_cold_start("m", None, "")] == ["C"]
    assert gateway.instead_of_cold_start("m", None, "B") == []  # came from a peer site
    assert gateway.instead_of_cold_start("m", frozenset({"A"}), "") == []  # here only
    assert gateway.instead_of_cold_start("m", frozenset({"A", "B"}), "") == []  # C not allowed
    offers.pop()
    assert gateway.instead_of_cold_start("m", None, "") == []  # nobody serves it: wait here
    agent, _ = across(Table(gateways=2))
    assert [r.hop for r in agent.instead_of_cold_start("m", None, "")] == [HOP_PUSH, HOP_PUSH]
    assert across()[0].instead_of_cold_start("m", None, "") == []  # no gateway


def test_a_request_no_node_of_ours_takes_goes_out_waits_for_a_start_or_is_refused() -> None:
    gateway, _ = across()
    offers = [SiteOffer("C", ("10.0.0.3:7000",), True, 0.15, 1, 1, 0)]
    gateway.offers = lambda model: offers
    chat = Routed("chat", "m", False, {"model": "m"}, None, frozenset(), None, None, 0)
    there = gateway.without_nodes(chat, False, "", None, 1)
    assert not isinstance(there, Rejection)
    assert [r.info.site for r in there[0]] == ["C"] and there[1] is None
    # a declared model served at C goes there; a Responses request waits for the start here
    there = gateway.without_nodes(chat, False, "", 60.0, 1)
    assert not isinstance(there, Rejection) and there[1] is None
    new_response = routed({"model": "m"})
    assert gateway.without_nodes(new_response, False, "", 60.0, 1) == ([], 60.0)
    # from a peer site: never sent on (served nowhere here: the 404); no site serves it: 404
    came = gateway.without_nodes(chat, False, "B", None, 1)
    assert isinstance(came, Rejection) and came.status == 404
    offers.clear()
    gone = gateway.without_nodes(chat, False, "", None, 1)
    assert isinstance(gone, Rejection) and gone.status == 404
    assert gateway.without_nodes(chat, False, "", 60.0, 1) == ([], 60.0)


def test_the_sessions_a_gateway_remembers_are_bounded_oldest_first() -> None:
    gateway, _ = across()
    gateway.max_sessions = 3
    for i in range(5):
        gateway.pushed_to(f"s{i}", "C")
    gateway.pushed_to("s2", "D")  # remembered again: the newest
    gateway.pushed_to("s5", "C")
    assert list(gateway.sessions) == ["s4", "s2", "s5"]
    gateway.pushed_to(None, "C")
    assert len(gateway.sessions) == 3


def test_a_site_whose_summary_is_too_old_to_say_it_admits_is_not_pushed_to() -> None:
    gateway, _ = across()
    offers = [
        SiteOffer("C", ("10.0.0.3:7000",), True, 0.05, 1, 1, 0, fresh=False),
        SiteOffer("D", ("10.0.0.4:7000",), True, 0.20, 1, 1, 0),
    ]
    gateway.offers = lambda model: offers
    assert [r.info.site for r in gateway.push_routes("m", None)] == ["D"]
    # still routable: what no node of ours serves goes to the nearest, C, as before
    assert [r.info.site for r in gateway.out_routes("m", None)] == ["C", "D"]


def test_a_new_response_for_a_model_no_node_of_ours_serves_has_no_routes_here_yet() -> None:
    """Not "stored elsewhere": a declared model may still get a replica (the cold start), or a
    gateway take it out; only a continuation names a site."""
    a, _ = across()
    assert a.responses_routes(routed({"model": "m"}), None, "", facts) == (None, None, "")


def test_only_an_interactive_model_request_routed_to_our_nodes_may_go_out() -> None:
    a, _ = across()
    here = [route(NODE)]

    def job(**fields: object) -> Job:
        made = Job("chat", "m", False, b"{}", b"/v1/chat/completions", {}, None, 0.0, None)
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    assert a.may_go_out(job(), here)
    assert not a.may_go_out(job(), [])  # no route of ours: out_routes' case, not a retry
    for refused in (
        {"from_site": "C"},  # came from another site: never sent on
        {"out": True},  # already on its way out
        {"sites": frozenset({"A"})},  # allowed here only
        {"slot": BatchSlot("t")},  # batch work: the gate's
        {"waking": True},
        {"kind": "responses"},
    ):
        assert not a.may_go_out(job(**refused), here), refused
    assert a.may_go_out(job(sites=frozenset({"A", "C"})), here)


def test_a_responses_request_leaving_carries_its_owners_reference_not_its_key() -> None:
    a, _ = across()
    r = routed({"model": "m", "input": "hi"})
    body = orjson.loads(a.outgoing_response(r))
    assert body["request_id"] == responses.ANONYMOUS and body["input"] == "hi"
    r.key = ApiKey("key-1", "alice", b"\x00" * 32, 0.0)
    ref = orjson.loads(a.outgoing_response(r))["request_id"]
    assert ref == responses.owner_ref(RING, "key-1") and "key-1" not in ref


def test_a_gateway_keeps_a_shared_prefix_at_the_site_it_sent_it_to() -> None:
    """Rule 7 with the product's prefix index: the first prompt of a long shared prefix that
    our site cannot admit goes to the nearest site that can (B); the next ones go to B too,
    although C is nearer by then, while B can admit; our site's own cache keeps a prompt
    here; a conversation's turn is never moved by the cost."""
    policy = make_policy("prefix-pending")
    gateway, _ = across()
    offers = [
        SiteOffer("B", ("10.0.0.2:7000",), True, 0.15, 2, 1, 0),
        SiteOffer("C", ("10.0.0.3:7000",), True, 0.20, 2, 1, 0),
    ]
    gateway.offers = lambda model: offers
    system = "".join(f"rule {i}: answer briefly and cite your sources.\n" for i in range(60))
    here = [route(NODE)]
    job = Job("chat", "m", False, b"{}", b"/v1/chat/completions", {}, None, 0.0, None)

    def prompt_of(req: RouteRequest, pick: str | None) -> Prompt:
        n = len(req.prefix_blocks)
        held = policy.held_blocks(req, pick) if pick else 0
        return Prompt(n, held, 0.004, lambda sid: policy.held_blocks(req, sid))

    first = RouteRequest("m", prompt_blocks(system + "q1"), None, 0)
    out = gateway.push(job, here, None, None, prompt_of(first, None))  # rule 5
    assert [r.info.site for r in out] == ["B", "C"]  # the nearer first
    policy.on_routed(first, out[0].info.session_id, 0.0)
    offers[1] = SiteOffer("C", ("10.0.0.3:7000",), True, 0.01, 2, 1, 0)  # C is nearer now
    second = RouteRequest("m", prompt_blocks(system + "q2"), None, 0)
    out = gateway.push(job, here, None, None, prompt_of(second, None))
    assert [r.info.site for r in out] == ["B", "C"]  # B holds the prefix: 0.15 s < 0.01 + 0.17
    # our node can admit it now and holds nothing of it: B is quicker than computing it here
    assert [r.info.site for r in gateway.push(job, here, None, 0.0, prompt_of(second, NODE))] == [
        "B"
    ]
    # once our node holds the prefix too, a prompt that starts now stays here
    policy.on_routed(second, NODE, 0.0)
    third = RouteRequest("m", prompt_blocks(system + "q3"), None, 0)
    assert gateway.push(job, here, None, 0.0, prompt_of(third, NODE)) == []
    assert gateway.push(job, here, "conv", 0.0, prompt_of(first, None)) == []  # a session's turn
    agent, _ = across(Table(gateways=1))  # an agent that is not a gateway prices nothing
    assert agent.push(job, here, None, 0.0, prompt_of(second, None)) == []


def test_a_request_waits_for_a_start_at_the_site_whose_controller_starts_it_first() -> None:
    """Rule 8 at a gateway: a declared model no site serves waits at a peer site whose
    controller expects to serve it sooner than ours (ours cannot say: it waits here); a site
    that serves it comes before any start."""
    gateway, _ = across()
    offers = [SiteOffer("B", ("10.0.0.2:7000",), True, 0.04, 0, 0, 0, start_s=20.0)]
    gateway.offers = lambda model: offers
    assert gateway.instead_of_cold_start("m", None, "") == []  # our controller cannot say
    here: dict[str, float | None] = {"m": 30.0}
    gateway.start_here = here.get
    assert [r.info.site for r in gateway.instead_of_cold_start("m", None, "")] == ["B"]
    here["m"] = 10.0
    assert gateway.instead_of_cold_start("m", None, "") == []  # ours starts sooner
    here["m"] = math.inf  # our Slurm refuses it: the waiting requests go to B
    assert [r.info.site for r in gateway.instead_of_cold_start("m", None, "")] == ["B"]
    assert gateway.instead_of_cold_start("m", None, "B") == []  # came from B: waits here
    assert gateway.instead_of_cold_start("m", frozenset({"A"}), "") == []  # here only
    offers.append(SiteOffer("C", ("10.0.0.3:7000",), True, 0.15, 1, 1, 0))  # C serves it
    assert [r.info.site for r in gateway.instead_of_cold_start("m", None, "")] == ["C"]


def test_a_gateway_prices_the_prompt_of_a_request_that_may_leave_only() -> None:
    """``Across.prompt``: the most blocks any ranked node of ours holds, one block's prefill at
    the pick's rate; none on an agent that is not a gateway, nor for a request from a peer."""
    gateway, _ = across()
    gateway.offers = lambda model: []
    job = Job("chat", "m", False, b"{}", b"/v1/chat/completions", {}, None, 0.0, None)
    ranked = [Candidate(route(NODE).info, None, 0), Candidate(route("c" * 32).info, None, 0)]
    held = {NODE: 3, "c" * 32: 7}.get
    prompt = gateway.prompt(job, 10, ranked, lambda sid: held(sid) or 0, lambda sid: 1600.0)
    assert prompt is not None and (prompt.blocks, prompt.here, prompt.block_s) == (10, 7, 0.01)
    assert gateway.prompt(job, 0, ranked, lambda sid: 0, lambda sid: 1.0) is None
    job.from_site = "B"
    assert not gateway.prices(job) and gateway.prompt(job, 10, ranked, held, lambda s: 1.0) is None
    agent, _ = across(Table(gateways=1))
    job.from_site = ""
    assert agent.prompt(job, 10, ranked, lambda sid: 0, lambda sid: 1.0) is None


def test_responses_and_batch_requests_wait_for_a_start_here() -> None:
    gateway, _ = across()
    offers = [SiteOffer("C", ("10.0.0.3:7000",), True, 0.15, 2, 1, 0)]
    gateway.offers = lambda model: offers
    chat = Routed("chat", "m", False, {"model": "m"}, None, frozenset(), None, None, 0)
    assert [r.info.site for r in gateway.waits_elsewhere(chat, "")] == ["C"]
    chat.batch = True
    assert gateway.waits_elsewhere(chat, "") == []
    assert gateway.waits_elsewhere(routed(), "") == []  # a Responses request
