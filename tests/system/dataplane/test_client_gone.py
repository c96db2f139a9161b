"""A client that goes away stops its generation: the ingress aborts the upstream request, so the
engine frees the sequence, whether the answer is streamed or not and whether the engine is the
ingress's own (one hop) or another agent's (two hops). Real agents, the simulated engine.

``a`` serves m1; ``c`` has no engine. Each request asks for thousands of tokens (tens of seconds
of generation), and the client closes its connection once the engine runs the request.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from tests.support.meshview import entry, metrics

pytestmark = pytest.mark.slow

RUNNING = 'vllm:num_requests_running{model_name="m1"}'


class Mesh:
    def __init__(self, local: LocalMesh, a: AgentProcess, c: AgentProcess, engine_url: str):
        self.local, self.a, self.c, self.engine_url = local, a, c, engine_url

    def running(self) -> float:
        return metrics(self.engine_url).get(RUNNING, 0.0)


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    local = LocalMesh(tmp_path_factory.mktemp("client-gone") / "mesh")
    try:
        a = local.start("a", args=["--sim", "m1", "--sim-gpu", "H100"])
        c = local.start("c")

        def serving() -> bool:
            e = entry(c, a.session_id)
            return e is not None and e["state"] == "serving"

        assert wait_until(serving, 30), "a never served m1 in c's view"
        seen = entry(a, a.session_id)
        assert seen is not None
        yield Mesh(local, a, c, seen["engine"]["url"])
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} ---\n{agent.stderr_tail(15)}")


def open_request(agent: AgentProcess, stream: bool) -> socket.socket:
    body = json.dumps(
        {
            "model": "m1",
            "messages": [{"role": "user", "content": "write a very long story"}],
            "max_tokens": 6000,
            "stream": stream,
        }
    ).encode()
    url = urlsplit(agent.http_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def disconnects(agent: AgentProcess) -> float:
    m = metrics(agent.http_url)
    return sum(v for k, v in m.items() if k.startswith("fabric_ingress_client_disconnects_total"))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("hops", [1, 2])
def test_the_engine_stops_generating_within_a_second_of_the_client_leaving(
    fab: Mesh, hops: int, stream: bool
) -> None:
    ingress = fab.a if hops == 1 else fab.c
    assert wait_until(lambda: fab.running() == 0, 10), "the engine is busy before the test"
    before = disconnects(ingress)
    sock = open_request(ingress, stream)
    try:
        assert wait_until(lambda: fab.running() == 1, 10), "the engine never ran the request"
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the stream did not start"
    finally:
        sock.close()
    closed = time.monotonic()
    assert wait_until(lambda: fab.running() == 0, 10), "the engine kept generating for nobody"
    took = time.monotonic() - closed
    print(f"\nclient-gone: {hops} hop(s), stream={stream}: engine idle {took:.2f} s after close")
    assert took < 1.0
    assert wait_until(lambda: disconnects(ingress) == before + 1, 5)


def test_a_pipelined_client_is_still_answered(fab: Mesh) -> None:
    """Bytes waiting behind a request (HTTP/1.1 pipelining) are not a disconnect."""
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
    ).encode()
    one = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    url = urlsplit(fab.c.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(one + one)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
            more = sock.recv(65536)
            assert more, f"closed after {data.count(b'HTTP/1.1 200')} answers"
            data += more
    assert data.count(b'"finish_reason"') == 2


def test_the_ingress_still_answers_after_clients_left(fab: Mesh) -> None:
    r = httpx.post(
        fab.c.http_url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
