"""An engine that answers the data plane with what no engine should send.

Real agents, real sockets: ``bad`` supervises a placeholder process and points at a hostile
HTTP server run by this test (it owns its listening socket from the start, so no port can be
taken between choosing it and binding it); the server answers /health, /v1/models and /metrics
like an engine, and each POST with the raw bytes named by the prompt (``case:<name>``).
``serve`` runs a simulated engine for ``m1``, ``edge`` has no engine. A request for ``hostile``
through ``edge`` crosses two data planes (edge, then bad's relay to its engine); sent to
``bad`` it crosses one. Whatever the engine sends, both agents must stay up, answer the client
well-framed, never hand one client's answer to another, and serve ``m1`` afterwards.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until

pytestmark = pytest.mark.slow

HOSTILE = "hostile"
IO_TIMEOUT_S = 20.0


def _json_answer(content: str) -> bytes:
    body = json.dumps(
        {
            "id": "chatcmpl-hostile",
            "object": "chat.completion",
            "model": HOSTILE,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(body)
        + body
    )


# What the engine sends for each case, and whether it closes the connection afterwards.
CASES: dict[str, bytes] = {
    "ok": _json_answer("plain answer"),
    "early_hints": b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
    + _json_answer("answer after hints"),
    "continue_flood": b"HTTP/1.1 100 Continue\r\n\r\n" * 100 + _json_answer("never"),
    "switching": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
    b"connection: upgrade\r\n\r\n\x81\x05hello",
    "switching_bare": b"HTTP/1.1 101 Switching Protocols\r\n\r\nhello",
    "no_content": b"HTTP/1.1 204 No Content\r\nx-engine: hostile\r\n\r\n",
    "huge_head": b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 1000 + b"\r\n",  # repeated
    "many_headers": b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"x-h%d: v\r\n" % i for i in range(500))
    + b"content-length: 2\r\n\r\n{}",
    "cl_te": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n",
    "garbage": b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
}
HUGE_HEAD_BYTES = 32 * 1024 * 1024


class HostileEngine:
    """A thread-per-connection HTTP/1.1 server with scripted answers to POSTs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answered: list[str] = []  # the cases it answered, in order
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    lines = head.decode("latin-1").split("\r\n")
                    method, path, _ = lines[0].split(" ", 2)
                    length = 0
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        if name.strip().lower() == "content-length":
                            length = int(value)
                    while len(buf) < length:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    body, buf = buf[:length], buf[length:]
                    if not self._answer(conn, method, path, body):
                        return
            except OSError:
                return  # the agent closed on us: expected for the refused cases

    def _answer(self, conn: socket.socket, method: str, path: str, body: bytes) -> bool:
        if method == "GET":
            if path == "/v1/models":
                payload = json.dumps(
                    {
                        "object": "list",
                        "data": [{"id": HOSTILE, "object": "model", "max_model_len": 512}],
                    }
                ).encode()
            elif path == "/version":
                payload = b'{"version": "0-hostile"}'
            elif path in ("/health", "/metrics"):
                payload = b""
            else:
                conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                return True
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload)
            return True
        prompt = json.loads(body)["messages"][-1]["content"]
        case = prompt.removeprefix("case:")
        self.answered.append(case)
        if case == "huge_head":
            piece = CASES[case]
            for _ in range(HUGE_HEAD_BYTES // len(piece)):
                conn.sendall(piece)
            return False
        conn.sendall(CASES[case])
        return case in ("ok", "early_hints", "no_content")

    def close(self) -> None:
        self.sock.close()


@dataclass
class Mesh:
    engine: HostileEngine
    bad: AgentProcess  # its engine is the hostile server
    serve: AgentProcess  # a simulated engine for m1
    edge: AgentProcess  # no engine: routes hostile requests to bad

    def agents(self) -> tuple[AgentProcess, ...]:
        return (self.bad, self.serve, self.edge)


def lists(agent: AgentProcess, *models: str) -> bool:
    try:
        data = httpx.get(f"{agent.http_url}/v1/models", timeout=2.0).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return set(models) <= {m["id"] for m in data}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    engine = HostileEngine()
    local = LocalMesh(tmp_path_factory.mktemp("hostile") / "mesh")
    try:
        # The supervised child only holds the engine's place: the hostile server is this test's.
        placeholder = [sys.executable, "-c", "import time; time.sleep(3600)"]
        url = f"http://127.0.0.1:{engine.port}"
        bad = local.start("bad", args=["--engine-url", url, "--", *placeholder])
        serve = local.start("serve", args=["--sim", "m1", "--sim-gpu", "H100"])
        edge = local.start("edge")
        for agent in (bad, serve, edge):
            assert wait_until(partial(lists, agent, HOSTILE, "m1"), 30, interval_s=0.1)
        yield Mesh(engine, bad, serve, edge)
    finally:
        local.close()
        engine.close()
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(30)}")


def ask(
    client: httpx.Client, agent: AgentProcess, case: str, model: str = HOSTILE
) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"case:{case}"}]}
    return client.post(f"{agent.http_url}/v1/chat/completions", json=body)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def assert_unhurt(mesh: Mesh) -> None:
    """Every agent runs and serves a legitimate request, from both entry points."""
    for agent in mesh.agents():
        assert agent.running, f"{agent.name} exited: {agent.stderr_tail(30)}"
    with httpx.Client(timeout=IO_TIMEOUT_S) as client:
        for agent in (mesh.edge, mesh.bad):
            r = ask(client, agent, "ok", model="m1")
            assert r.status_code == 200, (agent.name, r.text)


@pytest.fixture(params=["edge", "bad"])
def entry(request: pytest.FixtureRequest, mesh: Mesh) -> Iterator[AgentProcess]:
    """The agent the client talks to: ``edge`` (two data planes) or ``bad`` (one)."""
    yield mesh.edge if request.param == "edge" else mesh.bad
    assert_unhurt(mesh)


def test_interim_responses_are_consumed_and_never_reach_another_client(
    mesh: Mesh, entry: AgentProcess
) -> None:
    with httpx.Client(timeout=IO_TIMEOUT_S) as client:
        first = ask(client, entry, "early_hints")
        assert content(first) == "answer after hints"
        # The next request on the same pooled connections gets its own answer, not the one
        # a 1xx relayed as final would have left unread.
        for _ in range(3):
            assert content(ask(client, entry, "ok")) == "plain answer"


@pytest.mark.parametrize(
    "case",
    [
        "switching",
        "switching_bare",
        "continue_flood",
        "huge_head",
        "many_headers",
        "cl_te",
        "garbage",
    ],
)
def test_refused_answers_end_in_a_clean_error_and_the_agents_serve_on(
    mesh: Mesh, entry: AgentProcess, case: str
) -> None:
    with httpx.Client(timeout=IO_TIMEOUT_S) as client:
        r = ask(client, entry, case)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_eligible_node"
        # The same client connection is still usable.
        assert content(ask(client, entry, "ok")) == "plain answer"


def test_no_content_is_relayed_without_a_body(mesh: Mesh, entry: AgentProcess) -> None:
    """204 ends with its head: a chunked framing and a last chunk would be read as the start
    of the next response on the client's connection."""
    request = json.dumps(
        {"model": HOSTILE, "messages": [{"role": "user", "content": "case:no_content"}]}
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(request)
    )
    port = int(entry.http_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as s:
        s.sendall(head + request)
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        status_line, _, rest = got.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 204"), got
        headers = rest.split(b"\r\n\r\n", 1)[0].lower()
        assert b"transfer-encoding" not in headers and b"content-length" not in headers, got
        assert got.endswith(b"\r\n\r\n"), f"bytes after the 204 head: {got!r}"
        # The connection goes on: the next answer starts right where the 204 ended.
        ok = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(ok) + ok
        )
        nxt = s.recv(65536)
        assert nxt.startswith(b"HTTP/1.1 200"), nxt
