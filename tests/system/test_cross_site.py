"""Cross-site requests with real agents on loopback: site A (an ingress that is not a gateway,
and a gateway), site C (two gateways and a simulated node), each its own cluster key and mesh.
The official clients at A's ingress get answers from the model only C serves, through A's
gateway and one of C's; killing the C gateway that carries the load fails no request."""

from __future__ import annotations

import json
import re
import socket
import ssl
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.federation.keygen import generate_site_key
from fabricnode.federation.sitekey import SiteKey
from tests.support.federation import official_answers
from tests.support.meshview import free_port
from tests.system.test_federation import gateway_args, peer_dir, sites_of

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow
MODEL = "sim-remote"


def node_of(url: str) -> str:
    nodes = httpx.get(f"{url}/fabric/v1/self", timeout=5).json()
    return str(nodes["session_id"])


def log_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_model_only_another_site_serves_is_answered_through_the_gateways(
    tmp_path: Path,
) -> None:
    key_a = generate_site_key("A", tmp_path / "key-A")
    key_c = generate_site_key("C", tmp_path / "key-C")
    port_a, port_c1, port_c2 = free_port(), free_port(), free_port()
    peers_a = peer_dir(tmp_path, "A", key_c)
    peers_c = peer_dir(tmp_path, "C", key_a)
    request_log = tmp_path / "a-ingress-requests.jsonl"
    # an ingress of A with API keys on: one key limited to site A, one to site C
    keys_path = tmp_path / "a-api-keys.json"
    store = ApiKeyStore(keys_path, enabled=True)
    only_a = store.new_key("only-a", sites=["A"])[0]
    only_c = store.new_key("only-c", sites=["C"])[0]
    ops = store.new_key("ops", admin=True)[0]
    store.save()
    with LocalMesh(tmp_path / "site-a") as site_a, LocalMesh(tmp_path / "site-c") as site_c:
        c_node = site_c.start("c-node", args=["--site", "C", "--sim", MODEL])
        gw_c1 = site_c.start(
            "c-gateway-1", args=gateway_args(key_c, peers_c, port_c1, f"A=127.0.0.1:{port_a}")
        )
        gw_c2 = site_c.start(
            "c-gateway-2", args=gateway_args(key_c, peers_c, port_c2, f"A=127.0.0.1:{port_a}")
        )
        gw_a = site_a.start(
            "a-gateway",
            args=gateway_args(key_a, peers_a, port_a, f"C=127.0.0.1:{port_c1}"),
        )
        ingress = site_a.start("a-ingress", args=["--site", "A", "--request-log", str(request_log)])
        keyed = site_a.start("a-keyed", args=["--site", "A", "--api-keys", str(keys_path)])

        def c_lists_both_gateways() -> bool:
            row = sites_of(gw_a).get("C")
            return bool(
                row
                and row["routable"]
                and row["summary"]
                and row["summary"]["models"].get(MODEL, {}).get("replicas") == 1
                and len(row["summary"]["gateways"]) == 2
            )

        assert wait_until(c_lists_both_gateways, 40), sites_of(gw_a)
        # the ingress knows A's gateway (its entry, labelled fabric.gateway)
        for agent in (ingress, keyed):
            assert wait_until(
                lambda agent=agent: any(  # type: ignore[misc]
                    n["session_id"] == gw_a.session_id
                    for n in httpx.get(
                        f"{agent.http_url}/fabric/v1/nodes",
                        headers={"authorization": f"Bearer {ops}"},
                        timeout=5,
                    ).json()["nodes"]
                ),
                20,
            )
        c_sid = c_node.session_id
        url = ingress.http_url

        # the official clients: openai's JSON and stream, anthropic's Messages plain and streamed
        started = time.monotonic()
        answers = official_answers(url, "none", MODEL, timeout_s=30)
        first_s = time.monotonic() - started  # the four answers, the first crossing included
        assert answers["json"] and answers["stream"].strip(), answers
        assert answers["node"] == c_sid and answers["site"] == "C"
        assert len(answers["messages"].split()) == 6, answers
        assert len(answers["messages_stream"].split()) == 6, answers
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)

        # data residency across sites (docs/federation.md): the request's allowed sites travel
        # with it, checked by the gateway taking it out and the one taking it in; what site C's
        # node serves is counted in its request log
        def c_served() -> int:
            """Requests that reached C's node (every forward its agent took, whatever came
            of it): the engine sees no request that did not."""
            page = httpx.get(f"{c_node.http_url}/metrics", timeout=5).text
            found = re.findall(r"^fabric_forward_requests_total\{[^}]*\} (\S+)$", page, re.M)
            return int(sum(float(v) for v in found))

        chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "where"}]}

        def ask(base: str, key: str = "none", **headers: str) -> httpx.Response:
            return httpx.post(
                f"{base}/v1/chat/completions",
                json=chat_body,
                headers={"authorization": f"Bearer {key}", **headers},
                timeout=30,
            )

        assert c_served() >= 4  # the answers above
        seen = c_served()
        limited_a = openai.OpenAI(
            base_url=f"{keyed.http_url}/v1", api_key=only_a, max_retries=0, timeout=30
        )
        for _ in range(3):  # a key limited to A: the model only C serves is not found for it
            with pytest.raises(openai.NotFoundError) as refused:
                limited_a.chat.completions.create(**chat_body)  # type: ignore[call-overload]
            assert MODEL in str(refused.value)
        refused_header = ask(url, **{"X-Fabric-Require": "site=A"})
        assert refused_header.status_code == 404, refused_header.text
        assert refused_header.json()["error"]["code"] == "model_not_found"
        # over the link, a request whose allowed sites exclude C: refused at C's gateway
        link_head = (
            f"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
            f"x-fabric-sites: A\r\ncontent-length: {len(json.dumps(chat_body))}"
        )
        over = _over_link(key_a, key_c, port_c1, link_head.encode(), json.dumps(chat_body).encode())
        assert over.startswith(b"HTTP/1.1 403") and b"site_not_allowed" in over, over[:300]
        # the key limited to C, and requests asking for C (or A or C), are served at C
        allowed_c = ask(keyed.http_url, only_c)
        assert allowed_c.status_code == 200, allowed_c.text
        assert allowed_c.headers["x-fabric-site"] == "C"
        for require in ("site=C", "site=A|C"):
            r = ask(url, **{"X-Fabric-Require": require})
            assert r.status_code == 200 and r.headers["x-fabric-site"] == "C", (require, r.text)
        # C's node saw the three it may serve, none of those limited to A (sent before them)
        assert wait_until(lambda: c_served() >= seen + 3, 10)
        assert c_served() == seen + 3, (seen, c_served())

        # a model no site serves: 404, as for a model unknown in a site
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}]
            )

        # a client cannot mark its request as from another site (it would stay inside A)
        forged = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Fabric-From-Site": "C"},
            timeout=30,
        )
        assert forged.status_code == 200 and forged.headers["x-fabric-site"] == "C"
        # over the link, a peer site reaches the model-routed endpoints only
        assert _over_link(key_a, key_c, port_c1, b"GET /fabric/v1/self HTTP/1.1").startswith(
            b"HTTP/1.1 403"
        )
        chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(chat)}"
        )
        answer = _over_link(key_a, key_c, port_c1, head.encode(), chat.encode())
        assert answer.startswith(b"HTTP/1.1 200") and b"x-fabric-site: c" in answer.lower()
        # the ingress's request log names C's node and site
        assert wait_until(lambda: len(log_lines(request_log)) >= 4, 10)
        served = [r for r in log_lines(request_log) if r.get("M") == MODEL]
        assert served and all(r["site"] == "C" and r["node"] == c_sid for r in served), served

        # the latency the gateways add: sequential small requests at C's node itself and at
        # A's ingress (three more hops: ingress -> gateway A -> gateway C -> C's node's agent)
        direct_ms = _median_ms(c_node.http_url)
        across_ms = _median_ms(url)
        per_hop_ms = (across_ms - direct_ms) / 3

        # steady load while the C gateway carrying it is killed: no request fails
        carrying = _carrying(gw_c1, gw_c2)
        failures: list[str] = []
        # a JSON answer whose head came through the killed gateway and whose body did not: a
        # first byte was out, no ingress can take it back (streams are resumed instead); the
        # acceptance is about requests without a first byte
        cut_after_head: list[str] = []
        done = [0]
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=30) as http:
                while not stop.is_set():
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "load"}],
                        "max_tokens": 4,
                    }
                    head = False
                    try:
                        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                            head = True
                            text = r.read().decode()
                        if r.status_code != 200:
                            failures.append(f"{r.status_code} {text[:200]}")
                    except httpx.HTTPError as exc:
                        (cut_after_head if head else failures).append(repr(exc))
                    done[0] += 1

        streams = [0]

        def stream_load() -> None:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "a long answer"}],
                        "max_tokens": 60,
                        "stream": True,
                    }
                    try:
                        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                            text = "".join(r.iter_text())
                        if r.status_code != 200 or "data: [DONE]" not in text or '"error"' in text:
                            failures.append(f"stream {r.status_code}: {text[-300:]}")
                    except httpx.HTTPError as exc:
                        failures.append(f"stream {exc!r}")
                    streams[0] += 1

        threads = [threading.Thread(target=load) for _ in range(3)]
        threads += [threading.Thread(target=stream_load) for _ in range(2)]
        for t in threads:
            t.start()
        # the load runs through the gateway to be killed, then the kill; the measure is what
        # is sent after it (waited for as events: a loaded machine is slower, not wronger)
        assert wait_until(lambda: done[0] >= 4 and streams[0] >= 1, 60), (done, streams)
        before, streams_before = done[0], streams[0]
        carrying.kill()
        carrying.wait(10)
        after_kill = wait_until(
            lambda: done[0] > before + 8 and streams[0] >= streams_before + 2, 90
        )
        stop.set()
        for t in threads:
            t.join(60)
        assert after_kill, (before, done[0], streams_before, streams[0], failures[:5])
        assert not failures, failures[:5]
        # the added latency per hop is printed, not asserted (a bench's figure: loaded CI
        # machines make it anything); the target is in docs/federation.md
        print(
            f"the official clients' four answers in {first_s * 1000:.0f} ms; "
            f"median {direct_ms:.2f} ms at "
            f"C's node, {across_ms:.2f} ms from A's ingress: {per_hop_ms:.2f} ms per hop; "
            f"{done[0]} requests and {streams[0]} streams under load, {done[0] - before} "
            f"requests after killing {carrying.name}, none failed before its first byte "
            f"({len(cut_after_head)} JSON answers cut after their head)"
        )


def _median_ms(url: str, n: int = 60) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    times = []
    with httpx.Client(timeout=30) as http:
        for i in range(n + 5):
            started = time.perf_counter()
            r = http.post(f"{url}/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - started
            assert r.status_code == 200, r.text
            if i >= 5:  # warm: pooled connections open
                times.append(elapsed * 1000)
    return statistics.median(times)


def _over_link(ours: SiteKey, theirs: SiteKey, port: int, head: bytes, body: bytes = b"") -> bytes:
    """One request to a gateway's federation port as a gateway of site ``ours`` would send it
    (TLS with our site certificate, ALPN fabric-http/1); the start of the answer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.load_cert_chain(ours.cert_path, ours.key_path)
    ctx.load_verify_locations(cadata=theirs.cert.pem.decode())
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.set_alpn_protocols(["fabric-http/1"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with ctx.wrap_socket(raw) as tls:
        tls.sendall(head + b"\r\nhost: x\r\nconnection: close\r\n\r\n" + body)
        out = b""
        while len(out) < 65536:
            data = tls.recv(65536)
            if not data:
                break
            out += data
        return out


def _carrying(*gateways: AgentProcess) -> AgentProcess:
    """The C gateway A's requests go through now (the one with request connections in)."""
    for gw in gateways:
        page = httpx.get(f"{gw.http_url}/metrics", timeout=5).text
        for line in page.splitlines():
            in_line = line.startswith('fabric_federation_http_connections{direction="in"}')
            if in_line and float(line.split()[-1]) > 0:
                return gw
    return gateways[0]
