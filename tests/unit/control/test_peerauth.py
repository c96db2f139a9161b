"""Agents ask each other with their own signed header, never a client's key (``peerauth``): the
header binds the agent asked, the path and query, the time and a nonce; where API keys are on
it opens only the read-only paths agents ask each other for."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fabricnode.control import peerauth
from fabricnode.control.app import AdminApp
from fabricnode.control.peerauth import PeerRejected, PeerVerifier, sign
from fabricnode.control.peers import PeerClient
from fabricnode.dataplane.asgi_call import KEY_SCOPE, KEYS_SCOPE
from fabricnode.dataplane.forward_auth import sign_forward
from fabricnode.mesh.keyring import Keyring
from tests.unit.control.test_app import NOW, build_mesh

RING = Keyring.with_key(b"k" * 32)
OTHER_RING = Keyring.with_key(b"x" * 32)
STATS = "/fabric/v1/stats?scope=self&window=600"


def header(path: str = STATS, *, target: str = "target", at: float = NOW) -> bytes:
    return sign(RING, sender="asker", target=target, path=path, now=at).encode()


def test_a_signed_request_verifies_once_for_its_target_path_and_time() -> None:
    verifier = PeerVerifier(RING, "target")
    value = header()
    assert verifier.verify(value, method="GET", target=STATS.encode(), now=NOW + 1) == "asker"
    with pytest.raises(PeerRejected, match="replayed"):
        verifier.verify(value, method="GET", target=STATS.encode(), now=NOW + 1)


@pytest.mark.parametrize(
    ("value", "method", "target", "now", "why"),
    [
        (header(target="someone-else"), "GET", STATS, NOW, "does not verify"),
        (header(), "GET", "/fabric/v1/stats?scope=mesh&window=600", NOW, "does not verify"),
        (header(), "GET", "/fabric/v1/nodes", NOW, "does not verify"),
        (header(), "POST", STATS, NOW, "only for reading"),
        (header(), "GET", STATS, NOW + peerauth.MAX_SKEW_S + 1, "too old"),
        (
            sign(OTHER_RING, sender="asker", target="target", path=STATS, now=NOW).encode(),
            "GET",
            STATS,
            NOW,
            "not in this agent's keyring",
        ),
        # The data plane's forward header, made with the same key for the same target and
        # path, is another domain: it never verifies as a peer request.
        (
            sign_forward(
                RING,
                sender="asker",
                target="target",
                method=b"GET",
                path=STATS.encode(),
                body=b"",
                now=NOW,
            ),
            "GET",
            STATS,
            NOW,
            "does not verify",
        ),
        (b"1 zz", "GET", STATS, NOW, "malformed"),
    ],
)
def test_what_does_not_verify_says_why(
    value: bytes, method: str, target: str, now: float, why: str
) -> None:
    with pytest.raises(PeerRejected, match=why):
        PeerVerifier(RING, "target").verify(value, method=method, target=target.encode(), now=now)


async def test_the_peer_client_sends_its_own_signed_header_and_no_client_credential() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"rows": []})

    client = PeerClient(
        RING, "asker", wall_clock=lambda: NOW, transport=httpx.MockTransport(answer)
    )
    doc = await client.get_json(
        "http://10.0.0.2:8080", "target", "/fabric/v1/stats", {"scope": "self", "window": "600"}
    )
    await client.aclose()
    assert doc == {"rows": []}
    (request,) = seen
    assert "authorization" not in request.headers and "x-api-key" not in request.headers
    raw = request.url.raw_path
    assert raw == STATS.encode()
    sender = PeerVerifier(RING, "target").verify(
        request.headers[peerauth.HEADER].encode(), method="GET", target=raw, now=NOW
    )
    assert sender == "asker"


class KeysOn:
    """The app as the ingress hands it a request with API keys on and no valid key."""

    def __init__(self, app: AdminApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, KEYS_SCOPE: True, KEY_SCOPE: None}
        await self.app(scope, receive, send)


def keys_on_client(app: AdminApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=KeysOn(app)), base_url="http://agent"
    )


async def test_with_keys_on_a_verified_peer_reads_only_the_paths_agents_ask_each_other_for() -> (
    None
):
    mesh = build_mesh()
    own = mesh.core.self_entry.session_id
    app = AdminApp(mesh.core, wall_clock=lambda: NOW)

    def signed(path: str, target: str = own) -> dict[str, str]:
        return {peerauth.HEADER: sign(RING, sender="asker", target=target, path=path, now=NOW)}

    async with keys_on_client(app) as c:
        assert (await c.get("/fabric/v1/self/engine")).status_code == 401  # no key, no header
        ok = await c.get("/fabric/v1/self/engine", headers=signed("/fabric/v1/self/engine"))
        assert ok.status_code == 200 and ok.json()["command"] is None
        # A verified peer header opens nothing else: the registry needs an admin's key.
        nodes = await c.get("/fabric/v1/nodes", headers=signed("/fabric/v1/nodes"))
        assert nodes.status_code == 403
        assert nodes.json()["error"]["code"] == "insufficient_permissions"
        # One made for another agent, or replayed, is refused with its reason.
        other = await c.get(
            "/fabric/v1/self/engine", headers=signed("/fabric/v1/self/engine", "someone")
        )
        assert other.status_code == 403
        assert other.json()["error"]["code"] == "invalid_peer_request"
        assert "does not verify" in other.json()["error"]["message"]
        headers = signed("/fabric/v1/self/engine")
        assert (await c.get("/fabric/v1/self/engine", headers=headers)).status_code == 200
        again = await c.get("/fabric/v1/self/engine", headers=headers)
        assert again.status_code == 403 and "replayed" in again.json()["error"]["message"]
