"""The dashboard's HTTP surface on real agents: its files are open while API keys are on, the
data behind it is not, ``/ui/session`` tells the page what its key may read, and the mesh-wide
stats add up what every agent answered (asked over HTTP, with the page's key passed on)."""

from __future__ import annotations

import httpx
import pytest

from cli.localmesh import LocalMesh, wait_until
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
