"""Which control paths need an admin key (``fabricnode.control.access``), decided from what
the ingress puts in the ASGI scope, and the app's answers through it (in process, no sockets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from fabricnode.control import access
from fabricnode.control.app import AdminApp
from fabricnode.dataplane.apikeys import ApiKey, ApiKeyStore
from fabricnode.dataplane.asgi_call import KEY_SCOPE, KEYS_SCOPE
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.testing.simnet import make_body

NOW = 1_750_000_000.0


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, ApiKey]:
    store = ApiKeyStore.load(tmp_path / "keys.json")
    _, user = store.new_key("user")
    _, admin = store.new_key("ops", admin=True)
    return {"user": user, "admin": admin}


def scope(
    path: str, method: str = "GET", *, on: bool = True, key: ApiKey | None = None
) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        KEYS_SCOPE: on,
        KEY_SCOPE: key,
    }


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/health", "GET"),
        ("/ready", "GET"),
        ("/ping", "POST"),
        ("/version", "GET"),
        ("/fabric/v1/assignments", "POST"),
        ("/", "GET"),
        ("/favicon.ico", "GET"),
        ("/ui", "GET"),
        ("/ui/app.js", "GET"),
    ],
)
def test_probes_posted_assignments_and_the_dashboards_files_are_open(
    path: str, method: str
) -> None:
    assert access.refusal(scope(path, method)) is None


@pytest.mark.parametrize("path", ["/fabric/v1/nodes", "/metrics", "/fabric/v1/assignments"])
def test_the_registry_views_and_metrics_need_an_admin_key(
    path: str, keys: dict[str, ApiKey]
) -> None:
    assert access.refusal(scope(path)) == access.MISSING_KEY
    assert access.refusal(scope(path, key=keys["user"])) == access.NOT_ADMIN
    assert access.refusal(scope(path, key=keys["admin"])) is None


def test_without_keys_or_on_the_admin_port_nothing_is_checked() -> None:
    assert access.refusal(scope("/metrics", on=False)) is None
    assert access.refusal({"type": "http", "method": "GET", "path": "/metrics"}) is None


def test_the_decision_reads_the_raw_path_as_the_ingress_did() -> None:
    encoded = scope("/heal%74h")
    encoded["path"] = "/health"
    assert access.refusal(encoded) == access.MISSING_KEY


def test_the_ui_session_says_what_the_key_may_read(keys: dict[str, ApiKey]) -> None:
    off = {"keys_required": False, "key": None, "admin": True}
    assert access.ui_session(scope("/ui/session", on=False)) == off
    assert access.ui_session({"type": "http"}) == off
    assert access.ui_session(scope("/ui/session")) == {
        "keys_required": True,
        "key": None,
        "admin": False,
    }
    assert access.ui_session(scope("/ui/session", key=keys["user"])) == {
        "keys_required": True,
        "key": "user",
        "admin": False,
    }
    assert access.ui_session(scope("/ui/session", key=keys["admin"]))["admin"] is True


async def call(app: AdminApp, sc: dict[str, Any]) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({**sc, "query_string": b"", "headers": []}, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


async def test_the_app_refuses_through_the_ingress_before_it_routes(
    keys: dict[str, ApiKey],
) -> None:
    me = Identity.from_seed(b"access")
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "127.0.0.1:1", NOW), NOW)
    app = AdminApp(core, wall_clock=lambda: NOW)
    status, headers, body = await call(app, scope("/fabric/v1/nodes", "DELETE"))
    assert status == 401 and b"invalid_api_key" in body  # before the 405 of a wrong method
    assert headers == {b"content-type": b"application/json", b"content-length": b"%d" % len(body)}
    status, _, body = await call(app, scope("/fabric/v1/nodes", key=keys["user"]))
    assert status == 403 and b"insufficient_permissions" in body
    status, _, _ = await call(app, scope("/fabric/v1/nodes", key=keys["admin"]))
    assert status == 200
    status, headers, body = await call(app, scope("/ui/session", key=keys["user"]))
    assert (status, body) == (200, b'{"keys_required":true,"key":"user","admin":false}')
    assert b"cache-control" not in headers
    assert app.requests == 1  # only the one the app answered itself, as before
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:  # the --admin port: no keys scope, the session says so
        r = await client.get("/ui/session")
        assert r.json() == {"keys_required": False, "key": None, "admin": True}


@pytest.mark.parametrize("raw_path", [b"/ui/session", b"/ui/%73ession", b"/%75i/session"])
async def test_any_spelling_of_the_session_path_tells_the_truth_with_the_pages_headers(
    keys: dict[str, ApiKey], raw_path: bytes
) -> None:
    """The ingress decodes the path it hands the app (``asgi_call``): every spelling of
    ``/ui/session`` is the session question, answered with keys on, and like every answer
    under the dashboard's paths it carries the page's CSP and nosniff."""
    me = Identity.from_seed(b"access")
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "127.0.0.1:1", NOW), NOW)
    app = AdminApp(core, wall_clock=lambda: NOW)
    status, headers, body = await call(app, {**scope("/ui/session"), "raw_path": raw_path})
    assert (status, body) == (200, b'{"keys_required":true,"key":null,"admin":false}')
    assert b"default-src 'none'" in headers[b"content-security-policy"]
    assert headers[b"x-content-type-options"] == b"nosniff"
    for path in ("/ui/no-such-file", "/ui/session/x"):
        status, headers, _ = await call(app, scope(path))
        assert status == 404
        assert headers[b"x-content-type-options"] == b"nosniff"
        assert b"content-security-policy" in headers
    status, headers, _ = await call(app, scope("/fabric/v1/nodes", key=keys["admin"]))
    assert status == 200 and b"content-security-policy" not in headers  # an API, not the page
