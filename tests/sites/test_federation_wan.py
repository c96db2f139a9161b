"""The federation's acceptance over the emulated WAN (tests/support/sites.py): real agents in
network namespaces, three sites 40, 150 and 250 ms apart, each its own mesh and cluster key,
joined by their gateways and nothing else.

Site ``a``: a gateway, an ingress with API keys on (``a-c0``) and a node serving ``sim-a``;
site ``b``: a gateway and a node serving ``sim-b``; site ``c``: two gateways and a node serving
``sim-c``, the model only ``c`` has. Every client runs inside a namespace (``Sites.in_node``):
the host's own network reaches none of them.

One run, in phases, so that the agents start once:

1. A compute node cannot reach another site's, not even from a gateway (a connect that fails).
2. The official ``openai`` client at site ``a`` gets a JSON and a streamed answer from
   ``sim-c``, ``anthropic``'s Messages too, each through a's gateway and one of c's.
3. Residency: a key limited to site ``a`` gets a 404 for ``sim-c``, and c's node sees none of
   its requests; ``X-Fabric-Require: site=c`` is served there.
4. A forged summary: site ``b``, over its own authenticated link, sends a summary for site
   ``c`` (signed by b's key, naming c); a's and c's gateways refuse it, and nothing of it shows.
5. Under a steady load of JSON requests and streams from ``a`` to ``sim-c``, the c gateway
   carrying it is killed (``kill -9``): no request without a first byte fails, and no stream.
6. Site ``b`` is cut off from both others for ``FABRIC_WAN_CUT_S`` (default 60 s, the
   acceptance's): a and c keep serving what they can, b serves its own model to its own
   clients, nothing inside any site is declared dead; after the heal every gateway's view
   agrees (every peer site routable) within 10 s. The figures are printed (``-s``).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cli.localmesh import wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.federation import protocol
from fabricnode.federation.keygen import generate_site_key
from fabricnode.federation.summary import ModelCapacity, SiteSummary, SummaryBody
from tests.support.federation import Federation, official_answers, start_meshes
from tests.support.sites import Link, Site, Topology, emulated_sites, require_sites

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

CUT_S = float(os.environ.get("FABRIC_WAN_CUT_S", "60"))
TOPOLOGY = Topology(
    sites=(Site("a", computes=2), Site("b"), Site("c", gateways=2)),
    links={
        ("a", "b"): Link(rtt_ms=40),
        ("a", "c"): Link(rtt_ms=150),
        ("b", "c"): Link(rtt_ms=250),
    },
)
MODELS = {"a": "sim-a", "b": "sim-b", "c": "sim-c"}
GATEWAYS = ("a-gw0", "b-gw0", "c-gw0", "c-gw1")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    require_sites()
    root = tmp_path_factory.mktemp("wan")
    keys = {s.name: generate_site_key(s.name, root / f"key-{s.name}") for s in TOPOLOGY.sites}
    with emulated_sites(TOPOLOGY) as sites:
        fed = Federation(sites, root, keys)
        store = ApiKeyStore(root / "a-api-keys.json", enabled=True)
        fed.api_keys = {
            "anywhere": store.new_key("anywhere")[0],
            "only_a": store.new_key("only-a", sites=["a"])[0],
            "ops": store.new_key("ops", admin=True)[0],
        }
        store.save()
        try:
            start_meshes(fed)
            # the nodes first (a gateway's first summary then lists their models)
            fed.start("a-c1", "--sim", MODELS["a"])
            fed.start("b-c0", "--sim", MODELS["b"])
            fed.start("c-c0", "--sim", MODELS["c"])
            fed.start("a-c0", "--api-keys", str(root / "a-api-keys.json"))
            for gw in ("a-gw0", "b-gw0", "c-gw0", "c-gw1"):
                fed.gateway(gw)
            for agent in fed.agents.values():
                agent.wait_ready(60)
            yield fed
        finally:
            fed.close()


def everyone_sees_everything(fed: Federation) -> bool:
    """Every gateway has every peer site routable, with its model in its summary (c's with
    both gateways)."""
    for gw in ("a-gw0", "b-gw0", "c-gw0", "c-gw1"):
        own = fed.sites.node(gw).site
        rows = fed.peer_sites(gw)
        for site, model in MODELS.items():
            if site == own:
                continue
            row = rows.get(site)
            if not (row and row["routable"] and row["summary"]):
                return False
            if row["summary"]["models"].get(model, {}).get("replicas") != 1:
                return False
            if site == "c" and len(row["summary"]["gateways"]) != 2:
                return False
    return True


def test_three_sites_over_the_wan(federation: Federation) -> None:
    fed = federation
    started = time.monotonic()
    assert wait_until(lambda: everyone_sees_everything(fed), 60), "\n".join(
        f"{gw}: {fed.peer_sites(gw)}\n" + _federation_metrics(fed, gw) for gw in GATEWAYS
    )
    # a's ingress knows its gateway
    assert wait_until(
        lambda: any(
            n["labels"].get("fabric.gateway")
            for n in fed.get("a-c0", "a-c0", "/fabric/v1/nodes")["nodes"]
        ),
        20,
    )
    converged_s = time.monotonic() - started

    # 1. a compute node of c is reached from nowhere outside c
    c_node = fed.url("c-c0").removeprefix("http://")
    host, port = c_node.rsplit(":", 1)
    for src in ("a-c0", "a-gw0", "b-gw0"):
        with pytest.raises(OSError) as unreachable:
            fed.at(src, lambda: socket.create_connection((host, int(port)), timeout=3).close())
        assert unreachable.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, None), src

    # 2. the official clients at a, for the model only c serves
    key = fed.api_keys["anywhere"]
    ingress = fed.url("a-c0")
    model = MODELS["c"]

    def clients() -> dict[str, Any]:
        return official_answers(ingress, key, model)

    answers = fed.at("a-c0", clients)
    assert answers["json"] and answers["stream"].strip(), answers
    assert answers["site"] == "c" and answers["node"] == fed.agents["c-c0"].session_id
    assert len(answers["messages"].split()) == 6 and len(answers["messages_stream"].split()) == 6

    # 3. residency: a key limited to a never reaches c's node
    def c_served() -> int:
        """Requests that reached c's node (every forward its agent took, whatever came of
        it): its engine sees no request that did not."""
        page = fed.at("c-c0", lambda: httpx.get(f"{fed.url('c-c0')}/metrics", timeout=10).text)
        found = re.findall(r"^fabric_forward_requests_total\{[^}]*\} (\S+)$", page, re.M)
        return int(sum(float(v) for v in found))

    assert c_served() >= 4  # the answers above
    seen = c_served()
    body = {"model": model, "messages": [{"role": "user", "content": "where"}], "max_tokens": 2}

    def ask(api_key: str, **headers: str) -> tuple[int, dict[str, Any], str]:
        def post() -> tuple[int, dict[str, Any], str]:
            r = httpx.post(
                f"{ingress}/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {api_key}", **headers},
                timeout=60,
            )
            return r.status_code, r.json(), r.headers.get("x-fabric-site", "")

        result: tuple[int, dict[str, Any], str] = fed.at("a-c0", post)
        return result

    for _ in range(3):
        status, doc, _ = ask(fed.api_keys["only_a"])
        assert status == 404 and doc["error"]["code"] == "model_not_found", doc
    status, doc, site = ask(key, **{"X-Fabric-Require": "site=c"})
    assert status == 200 and site == "c", doc
    assert wait_until(lambda: c_served() >= seen + 1, 10)
    assert c_served() == seen + 1, (seen, c_served())  # the one allowed, none limited to a

    # 4. a summary for site c forged by site b, over b's own link, refused at a and at c
    refused_metric = "fabric_federation_summaries_refused_total"
    for target in ("a-gw0", "c-gw0"):
        refused = fed.metric(target, refused_metric, reason="other_site")
        fed.at("b-gw0", lambda target=target: _send_forged_summary(fed, target))  # type: ignore[misc]

        def counted(target: str = target, refused: float = refused) -> bool:
            return fed.metric(target, refused_metric, reason="other_site") > refused

        assert wait_until(counted, 10), target
    for gw in ("a-gw0", "c-gw0", "c-gw1"):
        for row in fed.peer_sites(gw).values():
            assert "forged" not in (row["summary"] or {}).get("models", {}), (gw, row)

    # 5. kill -9 of the c gateway carrying a steady load from a: nothing without a first
    # byte fails, no stream breaks
    load = Load(fed, "a-c0", key, model)
    load.start()
    assert wait_until(lambda: load.done >= 4 and load.streams >= 1, 90), load.report()
    carrying = max(
        ("c-gw0", "c-gw1"),
        key=lambda gw: fed.metric(gw, "fabric_federation_http_connections", direction="in"),
    )
    before, streams_before = load.done, load.streams
    killed = fed.agents[carrying].session_id
    fed.agents[carrying].kill()
    fed.agents[carrying].wait(10)
    after_kill = wait_until(
        lambda: load.done > before + 8 and load.streams >= streams_before + 2, 120
    )
    load.stop()
    assert after_kill, load.report()
    assert not load.failures, load.failures[:5]
    print(f"\nconverged {converged_s:.1f} s after start; killed {carrying}: {load.report()}")

    # 6. site b cut off: a and c serve what they can, b its own model to its own clients,
    # nothing inside any site is declared dead; after the heal every view agrees in 10 s
    fed.sites.isolate("b")
    cut_at = time.monotonic()
    assert wait_until(lambda: not fed.peer_sites("a-gw0")["b"]["routable"], 30)
    unroutable_s = time.monotonic() - cut_at
    checks = 0
    while time.monotonic() - cut_at < CUT_S:
        assert ask(key)[0] == 200  # a's clients, the model of c
        a_local = fed.at("a-c0", lambda: _chat(ingress, key, MODELS["a"]))
        assert a_local == 200
        b_own = fed.at("b-c0", lambda: _chat(fed.url("b-c0"), None, MODELS["b"]))
        assert b_own == 200
        for node in fed.agents:
            if node != carrying:
                assert _nobody_dead(fed, node, killed), node
        checks += 1
        time.sleep(2)
    rows = fed.peer_sites("a-gw0")["b"]
    assert not rows["routable"] and rows["summary"] is not None  # kept: a partition, no death
    fed.sites.reconnect("b")
    healed_at = time.monotonic()
    survivors = [gw for gw in ("a-gw0", "b-gw0", "c-gw0", "c-gw1") if gw != carrying]

    def views_agree() -> bool:
        for gw in survivors:
            own = fed.sites.node(gw).site
            if not all(r["routable"] for s, r in fed.peer_sites(gw).items() if s != own):
                return False
        return True

    assert wait_until(views_agree, 10), {gw: fed.peer_sites(gw) for gw in survivors}
    heal_s = time.monotonic() - healed_at
    print(
        f"b cut for {CUT_S:g} s: unroutable at a after {unroutable_s:.1f} s, {checks} rounds "
        f"of checks served at a, b and c; every view agreed {heal_s:.1f} s after the heal"
    )


def _federation_metrics(fed: Federation, node: str) -> str:
    page = fed.at(node, lambda: httpx.get(f"{fed.url(node)}/metrics", timeout=10).text)
    return "\n".join(x for x in page.splitlines() if x.startswith("fabric_federation_"))


def _chat(url: str, key: str | None, model: str) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    return r.status_code


def _nobody_dead(fed: Federation, node: str, killed: str) -> bool:
    """No member of ``node``'s own mesh is declared dead by it (but ``killed``, the gateway
    phase 5 crashed on purpose)."""
    nodes = fed.get(node, node, "/fabric/v1/nodes")["nodes"]
    return all(n.get("liveness") != "dead" for n in nodes if n["session_id"] != killed)


def _send_forged_summary(fed: Federation, target: str) -> None:
    """From b's gateway: a link to ``target``'s federation port as site b (its own key and
    certificate), then a summary that names site c, signed by b's key."""
    b_key = fed.keys["b"]
    theirs = fed.keys[fed.sites.node(target).site]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.load_cert_chain(b_key.cert_path, b_key.key_path)
    ctx.load_verify_locations(cadata=theirs.cert.pem.decode())
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.set_alpn_protocols([protocol.ALPN_LINK])
    body = SummaryBody(
        site="c",
        seq=int(time.time() * 1000) + 10**9,
        issued_at=time.time(),
        gateways=(fed.wan("b-gw0"),),
        models={"forged": ModelCapacity(9, 9, 0, 0, 0.0)},
    )
    signed = body.canonical_bytes()
    forged = SiteSummary(body, signed, b_key.sign(signed))
    host, port = fed.wan(target).rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=10)
    with ctx.wrap_socket(raw) as tls:
        tls.sendall(protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, "b", "")))
        tls.sendall(protocol.encode(protocol.Summary(forged.encode())))
        tls.settimeout(2)
        try:
            while tls.recv(65536):  # until the gateway answers or drops us
                pass
        except (TimeoutError, OSError):
            pass


class Load:
    """Three JSON clients and two streaming ones at ``node``'s ingress, inside its namespace;
    a failure is an answer that is not 200 or an error before the first byte (a JSON answer
    cut after its head is counted apart: no ingress can take a first byte back)."""

    def __init__(self, fed: Federation, node: str, key: str, model: str) -> None:
        self.fed, self.node, self.key, self.model = fed, node, key, model
        self.done = 0
        self.streams = 0
        self.failures: list[str] = []
        self.cut_after_head: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for stream in (False, False, False, True, True):
            t = threading.Thread(
                target=self.fed.at, args=(self.node, lambda s=stream: self._run(s))
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def report(self) -> str:
        return (
            f"{self.done} requests, {self.streams} streams, {len(self.failures)} failed, "
            f"{len(self.cut_after_head)} JSON answers cut after their head"
        )

    def _run(self, stream: bool) -> None:
        url = f"{self.fed.url(self.node)}/v1/chat/completions"
        headers = {"authorization": f"Bearer {self.key}"}
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "a long answer" if stream else "load"}],
            "max_tokens": 40 if stream else 4,
            "stream": stream,
        }
        with httpx.Client(timeout=90) as http:
            while not self._stop.is_set():
                head = False
                try:
                    with http.stream("POST", url, json=body, headers=headers) as r:
                        head = True
                        text = "".join(r.iter_text())
                    bad = r.status_code != 200 or (
                        stream and ("data: [DONE]" not in text or '"error"' in text)
                    )
                    if bad:
                        self.failures.append(f"{r.status_code}: {text[-300:]}")
                except httpx.HTTPError as exc:
                    if head and not stream:
                        self.cut_after_head.append(repr(exc))
                    else:
                        self.failures.append(repr(exc))
                if stream:
                    self.streams += 1
                else:
                    self.done += 1
