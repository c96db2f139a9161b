"""The dashboard's HTTP surface on real agents: its files are open while API keys are on, the
data behind it is not, ``/ui/session`` tells the page what its key may read, and the mesh-wide
stats add up what every agent answered (asked over HTTP, with the page's key passed on)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from cli.localmesh import LocalMesh, wait_until
from fabricnode.addr import split_hostport
from fabricnode.dataplane.apikeys import ApiKeyStore

pytestmark = pytest.mark.slow

MODEL = "llama-3-8b"


def chat(url: str, key: str, n: int) -> None:
    with httpx.Client(base_url=url, timeout=30.0) as client:
        for i in range(n):
            r = client.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"hello {i}"}],
                    "max_tokens": 4,
                    "stream": True,
                },
            )
            assert r.status_code == 200, r.text


def test_files_open_data_guarded_and_stats_add_up_across_agents(mesh: LocalMesh) -> None:
    store = ApiKeyStore(mesh.workdir / "api-keys.json", enabled=True)
    admin = store.new_key("ops", admin=True)[0]
    user = store.new_key("alice")[0]
    store.save()
    a = mesh.start("a", args=["--sim", MODEL])
    b = mesh.start("b", args=["--sim", MODEL])
    as_admin = {"authorization": f"Bearer {admin}"}

    # The page and its files need no key; the registry does, and says so in OpenAI's shape.
    page = httpx.get(f"{a.http_url}/ui", timeout=5)
    assert (
        page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    )
    assert httpx.get(f"{a.http_url}/ui/app.js", timeout=5).status_code == 200
    refused = httpx.get(f"{a.http_url}/fabric/v1/stats", timeout=5)
    assert refused.status_code == 401 and refused.json()["error"]["code"]
    assert httpx.get(f"{a.http_url}/fabric/v1/fleet", timeout=5).status_code == 401
    assert (
        httpx.get(
            f"{a.http_url}/fabric/v1/stats", headers={"authorization": f"Bearer {user}"}, timeout=5
        ).status_code
        == 403
    )

    def session(key: str | None) -> dict[str, object]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(f"{a.http_url}/ui/session", headers=headers, timeout=5)
        assert r.status_code == 200
        return dict(r.json())

    assert session(None) == {"keys_required": True, "key": None, "admin": False}
    assert session("sk-fabric-wrong") == {"keys_required": True, "key": None, "admin": False}
    assert session(user) == {"keys_required": True, "key": "alice", "admin": False}
    assert session(admin) == {"keys_required": True, "key": "ops", "admin": True}

    def both_serving() -> bool:
        r = httpx.get(f"{a.http_url}/fabric/v1/nodes", headers=as_admin, timeout=5)
        return sum(n["state"] == "serving" for n in r.json()["nodes"]) == 2

    assert wait_until(both_serving, 30.0)
    chat(a.http_url, user, 6)
    chat(b.http_url, user, 4)

    def counted() -> dict[str, object] | None:
        r = httpx.get(f"{a.http_url}/fabric/v1/stats", headers=as_admin, timeout=10)
        assert r.status_code == 200, r.text
        doc = r.json()
        row = doc["models"].get(MODEL)
        if row is None:
            return None
        requests = round(row["summary"]["requests_per_s"] * row["summary"]["window_s"])
        return doc if requests == 10 else None

    # Counted once the 10-second bucket they fell in is complete.
    assert wait_until(lambda: counted() is not None, 30.0), "the mesh's stats never reached 10"
    doc = counted()
    assert doc is not None
    assert doc["agents"] == {"asked": 2, "answered": 2}
    summary = doc["models"][MODEL]["summary"]  # type: ignore[index]
    assert summary["ttft_p95_s"] is not None and summary["e2e_p95_s"] is not None

    # Each agent's own share, as the other asks it.
    own = httpx.get(f"{b.http_url}/fabric/v1/stats?scope=self", headers=as_admin, timeout=5).json()
    assert sum(r["requests"] for r in own["rows"] if r["model"] == MODEL) == 4


class Listener:
    """A TCP server on ``host:port`` that records each request's head and answers an empty
    stats document: what a member of the mesh controls at its advertised HTTP address."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_server((host, port))
        self.heads: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                self.heads.append(head)
                body = b'{"rows": []}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
                )

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def test_an_admins_key_never_reaches_the_address_another_member_advertises(
    mesh: LocalMesh,
) -> None:
    """A live member (it answers probes) whose advertised HTTP address leads somewhere its
    owner reads: an admin opening the mesh's stats on another agent sends that agent their
    key, and the fan-out asks the member with the asking agent's own signed header, bound to
    that member, never with the admin's key. Before, the page's Authorization went along."""
    store = ApiKeyStore(mesh.workdir / "api-keys.json", enabled=True)
    admin = store.new_key("ops", admin=True)[0]
    store.save()
    a = mesh.start("a", args=["--sim", MODEL])
    # Its gossip is reachable at 127.0.0.2, so it is a probed, live member; its HTTP server
    # listens on 127.0.0.1 while its entry says 127.0.0.2, where the listener reads.
    member = mesh.start("member", args=["--gossip", "127.0.0.2:0", "--advertise", "127.0.0.2"])
    host, port = split_hostport(member.http_url.removeprefix("http://"))
    assert host == "127.0.0.2"
    listener = Listener(host, port)
    try:
        as_admin = {"authorization": f"Bearer {admin}"}

        def member_alive() -> bool:
            r = httpx.get(f"{a.http_url}/fabric/v1/nodes", headers=as_admin, timeout=5)
            return any(
                n["session_id"] == member.session_id and n["liveness"] == "alive"
                for n in r.json()["nodes"]
            )

        assert wait_until(member_alive, 30.0), "the member never became a live member"
        r = httpx.get(f"{a.http_url}/fabric/v1/stats", headers=as_admin, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["agents"]["asked"] == 2
        assert listener.heads, "the member was never asked"
        for head in listener.heads:
            lowered = head.lower()
            assert admin.encode() not in head
            assert b"authorization:" not in lowered and b"x-api-key:" not in lowered
            assert b"\r\nx-fabric-peer: 1 " in lowered
    finally:
        listener.close()
