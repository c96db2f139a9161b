"""The poison-request guard: a request that engines fail on is not tried on every replica.

Three nodes serve one model; a request that makes each engine close its connection without an
answer (as a prompt that crashes an engine would) is tried on two nodes and then answered 502
``request_failed_on_nodes``: the third engine never sees it. A request that reaches no engine
(a refused connect) or a node that says 503 is still failed over as before.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx
import pytest

from cli.localmesh import LocalMesh, wait_until
from tests.support.api_engine import ApiEngine
from tests.support.meshview import metrics

pytestmark = pytest.mark.slow

PLACEHOLDER = [sys.executable, "-c", "import time; time.sleep(3600)"]


@pytest.fixture
def three(tmp_path: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, list[ApiEngine], str]]:
    local = LocalMesh(tmp_path / "mesh")  # type: ignore[operator]
    engines = [ApiEngine(f"e{i}", ("mp",)) for i in range(3)]
    try:
        for i, engine in enumerate(engines):
            local.start(f"n{i}", args=["--engine-url", engine.url, "--", *PLACEHOLDER])
        ingress = local.start("ingress")

        def three_serve() -> bool:
            try:
                data = httpx.get(ingress.http_url + "/v1/models", timeout=2).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return any(m["id"] == "mp" and m["fabric_nodes"] == 3 for m in data)

        assert wait_until(three_serve, 30), "mp never listed with three nodes"
        yield local, engines, ingress.http_url
    finally:
        local.close()
        for engine in engines:
            engine.close()


def chats(engine: ApiEngine) -> list[dict[str, object]]:
    return [json.loads(s.body) for s in engine.requests("/v1/chat/completions")]


def test_a_request_engines_fail_on_is_tried_on_two_nodes_not_all(
    three: tuple[LocalMesh, list[ApiEngine], str],
) -> None:
    _, engines, url = three
    body = {"model": "mp", "messages": [{"role": "user", "content": "x"}], "stub_crash": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "request_failed_on_nodes"
    assert "failed on 2 nodes" in error["message"]
    reached = [e.name for e in engines if any(d.get("stub_crash") for d in chats(e))]
    assert len(reached) == 2, reached  # the third never saw it
    assert metrics(url)["fabric_ingress_poisoned_requests_total"] == 1.0
    # An ordinary request is served as before, and one that one node refuses with 503 is
    # failed over (a 503 is a node saying it is not taking requests, not an engine failure).
    fine = {"model": "mp", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=fine, timeout=30).status_code == 200
    once = {**fine, "stub_fail_first": "poison-test-503"}
    assert httpx.post(url + "/v1/chat/completions", json=once, timeout=30).status_code == 200
