"""The ``/v1`` data plane's HTTP/1.1 layer over real sockets: h11 as a conformance client, every
error the layer writes, chunked bodies, ``Expect: 100-continue``, pipelining, half-closed
connections, client disconnects mid-stream, slow clients, and abuse that must not hurt the agent.

One module-scoped mesh serves most tests: ``serve`` runs a simulated engine for model ``m1``,
``edge`` has no engine and forwards to it (so requests through ``edge`` cross two hops). Both
refuse bodies over 10 KiB (``--max-body-mb 0.01``). After every test that used them, both agents
must still answer a normal request. Timeouts are tested on an in-process ``Ingress`` with short
limits, since the agent does not expose them on its command line.
"""

from __future__ import annotations

import json
import random
import re
import resource
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import h11
import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.dataplane.ingress import Ingress
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.testing.simnet import make_body
from tests.support.meshview import metrics

pytestmark = pytest.mark.slow

MODEL = "m1"
MAX_BODY = int(0.01 * 1024 * 1024)
IO_TIMEOUT_S = 10.0


@dataclass
class Agents:
    mesh: LocalMesh
    serve: AgentProcess  # runs the simulated engine
    edge: AgentProcess  # no engine: forwards to ``serve``

    def engine_url(self) -> str:
        nodes = httpx.get(f"{self.serve.http_url}/fabric/v1/nodes", timeout=2.0).json()["nodes"]
        (own,) = [n for n in nodes if n["session_id"] == self.serve.session_id]
        return str(own["engine"]["url"])


def lists_model(agent: AgentProcess) -> bool:
    try:
        data = httpx.get(f"{agent.http_url}/v1/models", timeout=2.0).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return any(m["id"] == MODEL for m in data)


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    local = LocalMesh(tmp_path_factory.mktemp("dataplane") / "mesh")
    try:
        limit = ["--max-body-mb", "0.01"]
        serve = local.start("serve", args=["--sim", MODEL, "--sim-gpu", "H100", *limit])
        edge = local.start("edge", args=limit)
        for agent in (serve, edge):
            assert wait_until(partial(lists_model, agent), 30, interval_s=0.1), agent.name
        yield Agents(local, serve, edge)
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(20)}")


@pytest.fixture(autouse=True)
def still_serving(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a test sent, both agents still answer a normal request afterwards."""
    yield
    if "agents" not in request.fixturenames:
        return
    mesh: Agents = request.getfixturevalue("agents")
    for agent in (mesh.serve, mesh.edge):
        assert agent.running, f"{agent.name} died:\n{agent.stderr_tail()}"
        assert lists_model(agent), f"{agent.name} no longer lists {MODEL}"
        assert "Traceback" not in agent.stderr_tail(200)
    # Through edge, so both agents' data planes take part.
    answer = httpx.post(
        f"{mesh.edge.http_url}/v1/chat/completions", json=chat_doc(max_tokens=1), timeout=10.0
    )
    assert answer.status_code == 200, answer.text


# == helpers =================================================================================


def chat_doc(*, max_tokens: int = 2, stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def chat_body(**kw: Any) -> bytes:
    return json.dumps(chat_doc(**kw)).encode()


def http_request(
    method: str,
    target: str,
    body: bytes | None = None,
    headers: tuple[str, ...] = (),
    version: str = "HTTP/1.1",
) -> bytes:
    lines = [f"{method} {target} {version}", "Host: fabric", *headers]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def connect(agent: AgentProcess) -> socket.socket:
    host, _, port = agent.http_url.removeprefix("http://").rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_tolerant(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes: it may answer and close before reading everything."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Reader:
    """A strict, independent HTTP/1.1 response reader (no code shared with the server)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            if not self.fill():
                raise EOFError(f"connection closed; unparsed {self.buf[:200]!r}")
        part, _, self.buf = self.buf.partition(sep)
        return part

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self.fill():
                raise EOFError("connection closed inside a body")
        part, self.buf = self.buf[:n], self.buf[n:]
        return part

    def at_eof(self) -> bool:
        """True if the server closed the connection with nothing more to read."""
        return not self.buf and not self.fill()

    def head(self) -> Response:
        status_line, *lines = self._until(b"\r\n\r\n").split(b"\r\n")
        match = re.fullmatch(rb"HTTP/1\.1 (\d{3}) [^\r\n]*", status_line)
        assert match, status_line
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(b":")
            assert sep and re.fullmatch(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name), line
            headers[name.decode().lower()] = value.strip().decode("latin-1")
        return Response(int(match.group(1)), headers, b"")

    def response(self) -> Response:
        resp = self.head()
        if 100 <= resp.status < 200:
            return resp
        if "chunked" in resp.headers.get("transfer-encoding", ""):
            assert "content-length" not in resp.headers
            pieces = []
            while True:
                size = int(self._until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    while self._until(b"\r\n"):  # trailers
                        pass
                    break
                pieces.append(self._exact(size))
                assert self._exact(2) == b"\r\n"
            resp.body = b"".join(pieces)
        elif "content-length" in resp.headers:
            resp.body = self._exact(int(resp.headers["content-length"]))
        else:
            while self.fill():
                pass
            resp.body, self.buf = self.buf, b""
        return resp


def exchange(agent: AgentProcess, data: bytes) -> tuple[Response, bool]:
    """Send ``data`` on a new connection; the first response, and whether the server closed."""
    with connect(agent) as sock:
        send_tolerant(sock, data)
        reader = Reader(sock)
        resp = reader.response()
        closed = resp.headers.get("connection") == "close" and reader.at_eof()
        return resp, closed


def assert_openai_error(resp: Response, status: int, code: str | None = None) -> None:
    assert resp.status == status, (resp.status, resp.body)
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["code"], str) and error["code"]
    if code is not None:
        assert error["code"] == code, error


def sse_events(body: bytes) -> list[str]:
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


# == conformance: h11 as the client ==========================================================


class H11Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT)

    def send(self, *events: h11.Event) -> None:
        self.sock.sendall(b"".join(self.conn.send(e) or b"" for e in events))

    def next_event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(self.sock.recv(65536))

    def response(self) -> tuple[h11.Response, bytes]:
        head = self.next_event()
        assert isinstance(head, h11.Response), head
        body = []
        while True:
            event = self.next_event()
            if isinstance(event, h11.EndOfMessage):
                break
            assert isinstance(event, h11.Data), event
            body.append(event.data)
        # Both sides DONE: the server kept the connection open for the next request.
        assert (self.conn.our_state, self.conn.their_state) == (h11.DONE, h11.DONE)
        self.conn.start_next_cycle()
        return head, b"".join(body)

    def post(self, target: str, body: bytes, *, chunks: int = 0) -> tuple[h11.Response, bytes]:
        headers = [("Host", "fabric"), ("Content-Type", "application/json")]
        if chunks:
            headers.append(("Transfer-Encoding", "chunked"))
            step = max(1, len(body) // chunks)
            pieces = [body[i : i + step] for i in range(0, len(body), step)]
        else:
            headers.append(("Content-Length", str(len(body))))
            pieces = [body]
        self.send(h11.Request(method="POST", target=target, headers=headers))
        for piece in pieces:
            self.send(h11.Data(data=piece))
        self.send(h11.EndOfMessage())
        return self.response()

    def get(self, target: str) -> tuple[h11.Response, bytes]:
        self.send(h11.Request(method="GET", target=target, headers=[("Host", "fabric")]))
        self.send(h11.EndOfMessage())
        return self.response()


@pytest.mark.parametrize("via", ["serve", "edge"])
def test_h11_client_parses_every_answer_on_one_kept_alive_connection(
    agents: Agents, via: str
) -> None:
    agent = agents.serve if via == "serve" else agents.edge
    with connect(agent) as sock:
        client = H11Client(sock)

        head, body = client.get("/v1/models")
        assert head.status_code == 200
        assert MODEL in [m["id"] for m in json.loads(body)["data"]]

        head, body = client.post("/v1/chat/completions", chat_body(max_tokens=3))
        assert head.status_code == 200
        doc = json.loads(body)
        assert doc["usage"]["completion_tokens"] == 3
        assert dict(head.headers)[b"x-fabric-node"] == agents.serve.session_id.encode()

        head, body = client.post("/v1/chat/completions", chat_body(max_tokens=4, stream=True))
        assert head.status_code == 200
        headers = dict(head.headers)
        assert headers[b"content-type"].startswith(b"text/event-stream")
        assert headers[b"transfer-encoding"] == b"chunked"
        events = sse_events(body)
        assert events[-1] == "[DONE]"
        assert sum(1 for e in events[:-1] if json.loads(e)["choices"]) >= 4

        # A chunked request body, sent by h11 in several chunks.
        head, body = client.post("/v1/chat/completions", chat_body(max_tokens=1), chunks=5)
        assert head.status_code == 200 and json.loads(body)["choices"]

        head, body = client.post("/v1/chat/completions", chat_body(model="no-such-model"))
        assert head.status_code == 404
        assert json.loads(body)["error"]["code"] == "model_not_found"

        head, body = client.get("/v1/models")
        assert head.status_code == 200


# == errors written by the layer =============================================================

BIG_HEADERS = tuple(f"X-Filler-{i}: {'v' * 500}" for i in range(70))  # ≈ 36 KB > 32 KiB
MANY_HEADERS = tuple(f"X-H-{i}: v" for i in range(101))
CHAT_PATH = "/v1/chat/completions"
HEAD_OVER_LIMIT = "/v1/models?q=" + "a" * 40_000

# (id, request bytes, status, code, whether the server closes the connection)
ERROR_CASES: list[tuple[str, bytes, int, str | None, bool]] = [
    ("bad-json", http_request("POST", CHAT_PATH, b"{not json"), 400, "invalid_json", False),
    ("json-array", http_request("POST", CHAT_PATH, b"[1, 2]"), 400, "invalid_json", False),
    ("no-model", http_request("POST", CHAT_PATH, b'{"messages": []}'), 400, "invalid_model", False),
    ("model-number", http_request("POST", CHAT_PATH, b'{"model": 7}'), 400, "invalid_model", False),
    ("unknown-path", http_request("GET", "/v1/nope"), 404, "not_found", False),
    (
        "unknown-model",
        http_request("POST", CHAT_PATH, chat_body(model="no-such-model")),
        404,
        "model_not_found",
        False,
    ),
    ("get-chat", http_request("GET", CHAT_PATH), 405, "method_not_allowed", False),
    ("post-models", http_request("POST", "/v1/models", b"{}"), 405, "method_not_allowed", False),
    (  # a control path answered by the agent's ASGI app inline: its Allow header comes through
        "post-nodes",
        http_request("POST", "/fabric/v1/nodes", b"{}"),
        405,
        "method_not_allowed",
        False,
    ),
    (
        "big-body",
        http_request("POST", CHAT_PATH, b"x" * (MAX_BODY + 1)),
        413,
        "request_too_large",
        True,
    ),
    (
        "big-body-announced",  # refused on the head: the megabyte is never read
        http_request("POST", CHAT_PATH).replace(
            b"\r\n\r\n", b"\r\nContent-Length: 1000000\r\n\r\n"
        ),
        413,
        "request_too_large",
        True,
    ),
    (
        "big-chunked-body",
        http_request("POST", CHAT_PATH, headers=("Transfer-Encoding: chunked",))
        + b"".join(b"1000\r\n" + b"x" * 4096 + b"\r\n" for _ in range(3))
        + b"0\r\n\r\n",
        413,
        "request_too_large",
        True,
    ),
    ("big-headers", http_request("GET", "/v1/models", headers=BIG_HEADERS), 431, None, True),
    ("many-headers", http_request("GET", "/v1/models", headers=MANY_HEADERS), 431, None, True),
    ("long-target", http_request("GET", HEAD_OVER_LIMIT), 414, "uri_too_long", True),
    ("garbage", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64, 400, None, True),
    ("no-colon", b"GET /v1/models HTTP/1.1\r\nHost fabric\r\n\r\n", 400, None, True),
    (
        "smuggling",
        http_request(
            "POST", CHAT_PATH, b"0\r\n\r\n", headers=("Transfer-Encoding: chunked",)
        ),  # Content-Length and Transfer-Encoding together
        400,
        None,
        True,
    ),
    (
        "upgrade",
        http_request("GET", "/v1/models", headers=("Connection: Upgrade", "Upgrade: websocket")),
        400,
        None,
        True,
    ),
    ("h2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, None, True),
    ("http2-line", http_request("GET", "/v1/models", version="HTTP/2.0"), 505, None, True),
]


@pytest.mark.parametrize(
    ("data", "status", "code", "closes"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_the_layer_answers_bad_requests_with_an_openai_shaped_error(
    agents: Agents, data: bytes, status: int, code: str | None, closes: bool
) -> None:
    with connect(agents.edge) as sock:
        send_tolerant(sock, data)
        reader = Reader(sock)
        resp = reader.response()
        assert_openai_error(resp, status, code)
        if status == 405:
            assert resp.headers["allow"] in ("POST", "GET, HEAD")
        if closes:
            # The framing cannot be trusted any more: the server says so and closes.
            assert resp.headers["connection"] == "close"
            assert reader.at_eof()
        else:
            # A well-framed request that was refused keeps the connection usable.
            assert "connection" not in resp.headers
            sock.sendall(http_request("GET", "/v1/models"))
            assert reader.response().status == 200


def test_malformed_requests_are_counted_in_the_metrics(agents: Agents) -> None:
    before = metrics(agents.edge.http_url).get('fabric_ingress_malformed_total{status="400"}', 0)
    resp, closed = exchange(agents.edge, b"NOT HTTP AT ALL\r\n\r\n")
    assert_openai_error(resp, 400)
    assert closed
    after = metrics(agents.edge.http_url)['fabric_ingress_malformed_total{status="400"}']
    assert after == before + 1


# == request bodies ==========================================================================


def test_chunked_request_body_is_accepted(agents: Agents) -> None:
    body = chat_body(max_tokens=2)
    chunked = b"".join(
        b"%x;ext=1\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7])
        for i in range(0, len(body), 7)
    )
    data = http_request("POST", CHAT_PATH, headers=("Transfer-Encoding: chunked",))
    with connect(agents.edge) as sock:
        sock.sendall(data + chunked + b"0\r\nX-Trailer: yes\r\n\r\n")
        reader = Reader(sock)
        resp = reader.response()
        assert resp.status == 200, resp.body
        assert resp.json()["usage"]["completion_tokens"] == 2
        sock.sendall(http_request("GET", "/v1/models"))  # the framing ended where it should
        assert reader.response().status == 200


def test_expect_continue_gets_100_continue_then_the_answer(agents: Agents) -> None:
    body = chat_body(max_tokens=2)
    head = http_request("POST", CHAT_PATH, body, headers=("Expect: 100-continue",))
    head = head[: -len(body)]
    with connect(agents.edge) as sock:
        sock.sendall(head)
        reader = Reader(sock)
        interim = reader.response()  # before we send a single body byte
        assert interim.status == 100 and not interim.headers
        sock.sendall(body)
        resp = reader.response()
        assert resp.status == 200 and resp.json()["choices"]
        # The next request on the connection gets no stray 100.
        sock.sendall(http_request("GET", "/v1/models"))
        assert reader.response().status == 200


def test_expect_continue_with_an_oversized_body_gets_413_without_sending_it(
    agents: Agents,
) -> None:
    head = http_request("POST", CHAT_PATH, headers=("Expect: 100-continue",)).replace(
        b"\r\n\r\n", b"\r\nContent-Length: 1000000\r\n\r\n"
    )
    with connect(agents.edge) as sock:
        sock.sendall(head)
        reader = Reader(sock)
        resp = reader.response()
        assert_openai_error(resp, 413, "request_too_large")
        assert reader.at_eof()


@pytest.mark.parametrize("via", ["serve", "edge"])
def test_a_client_still_uploading_a_64_mb_body_reads_the_413_answer(
    agents: Agents, via: str
) -> None:
    """urllib sends the whole body before it reads: the agent must keep reading (and dropping)
    after its early 413, or the client gets a reset instead of the answer (lingering close)."""
    agent = agents.serve if via == "serve" else agents.edge
    request = urllib.request.Request(
        agent.http_url + CHAT_PATH,
        data=b"x" * (64 * 1024 * 1024),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=30)
    assert answer.value.code == 413
    error = json.loads(answer.value.read())["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"


# == connection handling =====================================================================


def ask_from(agent: AgentProcess, source: str) -> int:
    """The status of one small chat request sent from the local address ``source``; 0 when the
    agent closed the connection without an answer (refused at accept)."""
    host, _, port = agent.http_url.removeprefix("http://").rpartition(":")
    with socket.create_connection((host, int(port)), IO_TIMEOUT_S, (source, 0)) as sock:
        try:
            sock.sendall(http_request("POST", CHAT_PATH, chat_body(max_tokens=2)))
            return Reader(sock).response().status
        except (EOFError, ConnectionError):
            return 0


def test_one_client_address_cannot_take_every_connection(agents: Agents) -> None:
    """Idle connections from one address beyond ``max_connections_per_client`` (1024) are
    closed at accept and counted; another address is served meanwhile, and the address gets
    its share back once it closes its connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    agent = agents.serve
    host, _, port = agent.http_url.removeprefix("http://").rpartition(":")
    hog = "127.0.0.2"  # any 127/8 address is loopback on Linux
    refused = 'fabric_ingress_connections_refused_total{reason="per_client"}'
    before = metrics(agent.http_url).get(refused, 0.0)
    held: list[socket.socket] = []
    try:
        for _ in range(1024 + 40):
            held.append(socket.create_connection((host, int(port)), IO_TIMEOUT_S, (hog, 0)))
        assert wait_until(
            lambda: metrics(agent.http_url).get(refused, 0.0) >= before + 40, IO_TIMEOUT_S
        ), metrics(agent.http_url)
        assert ask_from(agent, "127.0.0.1") == 200
    finally:
        for sock in held:
            sock.close()
    # The agent notices the closes as they come: the address is served again.
    assert wait_until(lambda: ask_from(agent, hog) == 200, IO_TIMEOUT_S)
    assert metrics(agent.http_url)[refused] == before + 40


def test_pipelined_requests_get_their_answers_in_order(agents: Agents) -> None:
    requests = [
        http_request("POST", CHAT_PATH, chat_body(max_tokens=3)),
        http_request("GET", "/v1/models"),
        http_request("POST", CHAT_PATH, b"{broken"),
        http_request("POST", CHAT_PATH, chat_body(max_tokens=2, stream=True)),
        http_request("GET", "/v1/models", headers=("Connection: close",)),
    ]
    with connect(agents.edge) as sock:
        sock.sendall(b"".join(requests))  # all of them in one send
        reader = Reader(sock)
        answers = [reader.response() for _ in requests]
        assert reader.at_eof()
    assert answers[0].json()["usage"]["completion_tokens"] == 3
    assert answers[1].json()["object"] == "list"
    assert_openai_error(answers[2], 400, "invalid_json")
    assert sse_events(answers[3].body)[-1] == "[DONE]"
    assert answers[4].status == 200  # and the server closed after it, as asked


@pytest.mark.parametrize("via", ["serve", "edge"])
def test_a_half_closed_client_counts_as_gone_and_its_request_is_aborted(
    agents: Agents, via: str
) -> None:
    """Closing the sending side looks exactly like hanging up (a FIN either way), and nginx,
    uvicorn and the engines treat it so: the generation stops and the connection closes."""
    agent = agents.serve if via == "serve" else agents.edge
    with connect(agent) as sock:
        sock.sendall(http_request("POST", CHAT_PATH, chat_body(max_tokens=4000)))
        sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        assert Reader(sock).at_eof(), "a long answer was sent to a client that hung up"
        assert time.monotonic() - started < 5.0


def test_half_closed_client_with_an_unfinished_request_is_closed_at_once(
    agents: Agents,
) -> None:
    with connect(agents.edge) as sock:
        sock.sendall(http_request("POST", CHAT_PATH, chat_body())[:-10])
        sock.shutdown(socket.SHUT_WR)
        started = time.monotonic()
        assert Reader(sock).at_eof()  # no answer to half a request, and no 30 s wait
        assert time.monotonic() - started < 2.0


def test_http10_client_gets_a_stream_without_chunked_framing(agents: Agents) -> None:
    # HTTP/1.0 has no chunked coding (RFC 9112 §6.1): the stream must end by the server closing.
    body = chat_body(max_tokens=3, stream=True)
    data = http_request("POST", CHAT_PATH, body, ("Connection: keep-alive",), "HTTP/1.0")
    with connect(agents.edge) as sock:
        sock.sendall(data)
        resp = Reader(sock).response()  # no length, no chunks: read until the server closes
    assert resp.status == 200
    assert "transfer-encoding" not in resp.headers and "content-length" not in resp.headers
    assert resp.headers["connection"] == "close"
    assert sse_events(resp.body)[-1] == "[DONE]"

    data = http_request("POST", CHAT_PATH, chat_body(max_tokens=2), version="HTTP/1.0")
    resp, _ = exchange(agents.edge, data)
    assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("via", ["serve", "edge"])
def test_client_disconnect_mid_stream_cancels_the_upstream_request(
    agents: Agents, via: str
) -> None:
    agent = agents.serve if via == "serve" else agents.edge
    engine = agents.engine_url()
    running = 'vllm:num_requests_running{model_name="m1"}'
    local = 'fabric_ingress_inflight{side="local"}'
    forwarded = 'fabric_ingress_inflight{side="ingress"}'

    def counts() -> tuple[float, float, float]:
        return (
            metrics(engine)[running],
            metrics(agents.serve.http_url)[local],
            metrics(agents.edge.http_url)[forwarded],
        )

    assert wait_until(lambda: counts() == (0, 0, 0), 5), counts()
    # 8000 tokens take the simulated H100 about half a minute.
    request = http_request("POST", CHAT_PATH, chat_body(max_tokens=8000, stream=True))
    sock = connect(agent)
    try:
        sock.sendall(request)
        reader = Reader(sock)
        assert reader.head().status == 200
        while reader.buf.count(b"data: ") < 5:
            assert reader.fill()
        assert counts() == (1, 1, 1 if via == "edge" else 0)
    finally:
        sock.close()  # unread bytes pending: the kernel resets the connection
    gone = wait_until(lambda: counts() == (0, 0, 0), 5, interval_s=0.05)
    assert gone, f"(engine running, serving inflight, forwarded inflight) = {counts()}"


# == abuse ===================================================================================


def test_a_request_that_never_ends_its_head_is_refused_without_buffering(
    agents: Agents,
) -> None:
    with connect(agents.edge) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nX-Endless: ")
        refused = None
        for _ in range(400):  # up to 4 MB, 10 KB at a time; the head limit is 32 KiB
            try:
                sock.sendall(b"a" * 10_000)
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.0)
            try:
                refused = sock.recv(65536)
            except BlockingIOError:
                continue
            finally:
                sock.settimeout(IO_TIMEOUT_S)
            break
        reader = Reader(sock)
        reader.buf = refused or b""
        assert_openai_error(reader.response(), 431)


def test_many_connections_opened_and_dropped_do_not_hurt_the_agent(agents: Agents) -> None:
    socks = [connect(agents.edge) for _ in range(50)]
    for i, sock in enumerate(socks):
        if i % 3 == 0:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        elif i % 3 == 1:
            linger_0 = struct.pack("ii", 1, 0)  # close() resets the connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_0)
    for sock in socks:
        sock.close()
    assert wait_until(lambda: metrics(agents.edge.http_url)["fabric_ingress_connections"] <= 1, 5)


def test_overlapping_requests_through_both_hops_are_batched_and_answered_whole(
    agents: Agents,
) -> None:
    """Many requests at once (pipelined pairs, streams and JSON): both agents wait through their
    reactors (sockio.Reactor batches only under load), and every answer comes back whole."""

    def waits() -> list[float]:
        return [
            metrics(a.http_url).get("fabric_ingress_reactor_waits_total", 0.0)
            for a in (agents.edge, agents.serve)
        ]

    before = waits()

    def client(i: int) -> list[tuple[int, bool, bytes]]:
        answers = []
        with connect(agents.edge) as sock:
            reader = Reader(sock)
            for turn in range(3):
                # Two pipelined requests per turn: one streamed, one not.
                stream_first = (i + turn) % 2 == 0
                sock.sendall(
                    http_request("POST", CHAT_PATH, chat_body(max_tokens=6, stream=stream_first))
                    + http_request(
                        "POST", CHAT_PATH, chat_body(max_tokens=6, stream=not stream_first)
                    )
                )
                for stream in (stream_first, not stream_first):
                    resp = reader.response()
                    answers.append((resp.status, stream, resp.body))
        return answers

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = [a for answers in pool.map(client, range(16)) for a in answers]
    assert len(results) == 16 * 3 * 2
    for status, stream, body in results:
        assert status == 200, body[:200]
        if stream:
            events = [e for e in body.split(b"\n\n") if e.strip()]
            assert events[-1] == b"data: [DONE]", body[-200:]
            assert all(e.startswith(b"data: ") for e in events)
            assert not any(b'"error"' in e for e in events)
        else:
            assert json.loads(body)["object"] == "chat.completion"
    after = waits()
    assert after[0] > before[0], "the ingress never batched a wait"
    assert after[1] > before[1], "the serving agent never batched a wait"


BASE_REQUESTS = [
    http_request("GET", "/v1/models"),
    http_request("POST", CHAT_PATH, chat_body(max_tokens=1)),
    http_request("POST", CHAT_PATH, chat_body(model="nope"), headers=("Expect: 100-continue",)),
    http_request("POST", "/v1/completions", headers=("Transfer-Encoding: chunked",))
    + b'a\r\n{"model":\r\n9\r\n"m1","max\r\nf\r\n_tokens":1,"pro\r\nb\r\nmpt":"hi"}\r\n0\r\n\r\n',
]


@st.composite
def mutated_stream(draw: st.DrawFn) -> bytes:
    data = bytearray(b"".join(draw(st.permutations(BASE_REQUESTS))))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            data[at] = draw(st.integers(min_value=0, max_value=255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=6))
        else:
            del data[at : at + draw(st.integers(min_value=1, max_value=6))]
    return bytes(data)


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=mutated_stream())
def test_mutated_request_streams_get_well_formed_answers(agents: Agents, data: bytes) -> None:
    with connect(agents.edge) as sock:
        send_tolerant(sock, data)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        reader = Reader(sock)
        try:
            while not reader.at_eof():
                resp = reader.response()
                if resp.status >= 400:
                    assert_openai_error(resp, resp.status)
                else:
                    assert resp.status in (100, 200), resp
        except ConnectionResetError:
            pass  # the server answered an error and closed before reading all we sent
        except EOFError:
            # Our half-close is a hang-up: an answer still being generated when the agent's
            # watchdog sees it is aborted, and its connection closes mid-body.
            pass
    assert agents.edge.running


# == timeouts (in process: the agent's command line does not expose them) ==================

TIMEOUTS = IngressConfig(request_timeout_s=0.4, keepalive_timeout_s=1.2, watchdog_interval_s=0.05)


async def start_ingress(nursery: trio.Nursery, config: IngressConfig) -> tuple[Ingress, int]:
    me = Identity.from_seed(b"dataplane-http-timeouts")
    now = time.time()
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "127.0.0.1:1", now), now)
    ingress = Ingress(core, config=config, wall_clock=time.time)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    await nursery.start(ingress.serve, listener, trio.Event(), 0.1)
    return ingress, port


async def wait_closed(stream: trio.SocketStream, limit_s: float) -> tuple[bytes, float]:
    """Everything received until the server closes, and how long that took."""
    started = trio.current_time()
    got = b""
    with trio.fail_after(limit_s):
        while chunk := await stream.receive_some():
            got += chunk
    return got, trio.current_time() - started


async def test_slow_clients_are_disconnected_after_the_request_timeout() -> None:
    async with trio.open_nursery() as nursery:
        ingress, port = await start_ingress(nursery, TIMEOUTS)
        models = http_request("GET", "/v1/models")

        # Half a request head, then nothing.
        stalled = await trio.open_tcp_stream("127.0.0.1", port)
        await stalled.send_all(models[:20])
        got, took = await wait_closed(stalled, 3)
        assert got == b"" and 0.35 <= took < 1.5

        # A complete head, then half the body.
        body = chat_body()
        stalled = await trio.open_tcp_stream("127.0.0.1", port)
        await stalled.send_all(http_request("POST", CHAT_PATH, body)[: -len(body) // 2])
        got, took = await wait_closed(stalled, 3)
        assert got == b"" and 0.35 <= took < 1.5

        # A head trickled a byte at a time: the deadline is for the whole request, not a read.
        trickle = await trio.open_tcp_stream("127.0.0.1", port)
        started = trio.current_time()
        with trio.fail_after(3):
            try:
                for i in range(100):
                    await trickle.send_all(
                        b"GET /v1/models HTTP/1.1\r\nX-Slow: "[i : i + 1] or b"a"
                    )
                    await trio.sleep(0.05)
            except trio.BrokenResourceError:
                pass
        assert trio.current_time() - started < 1.5
        assert ingress.statistics().watchdog_expired >= 3

        # An idle kept-alive connection outlives the request timeout, then the keep-alive one.
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.sleep(0.7)
        await idle.send_all(models)
        with trio.fail_after(3):
            first = await idle.receive_some()
        assert first.startswith(b"HTTP/1.1 200 ")
        got, took = await wait_closed(idle, 3)
        assert 0.9 <= took < 2.0

        # None of that hurt: a normal request is answered.
        fresh = await trio.open_tcp_stream("127.0.0.1", port)
        await fresh.send_all(http_request("GET", "/v1/models", headers=("Connection: close",)))
        answer, _ = await wait_closed(fresh, 3)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert ingress.connections == 0
        nursery.cancel_scope.cancel()


# == failover past addresses that refuse (in process: a mesh built from signed records) ======

ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}}
).encode()


async def answer_everything(listener: trio.SocketListener) -> None:
    """A node's HTTP port that answers every request with one small JSON body."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while True:
                data = await stream.receive_some()
                if not data:
                    return
                buf += data
                head, sep, rest = buf.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
                if len(rest) < length:
                    continue
                buf = rest[length:]
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % len(ANSWER) + ANSWER
                )

    await trio.serve_listeners(handle, [listener])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed


@pytest.mark.parametrize("seed", range(8))
async def test_addresses_that_refuse_do_not_use_up_a_requests_attempts(seed: int) -> None:
    """Five nodes whose HTTP port refuses connections and one that answers: whatever order the
    policy tries them in (eight seeds), the request is answered. A refused connection sent
    nothing, so it does not count as one of the three attempts (entries of nodes that just died,
    or that a key holder published, used to exhaust them)."""
    from dataclasses import replace

    from fabricnode.mesh.registry import Addresses, ModelInfo, State
    from fabricnode.mesh.wire import Alive, EntryMsg

    now = time.time()
    me = Identity.from_seed(b"refusing-ingress")
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "127.0.0.1:1", now), now)
    async with trio.open_nursery() as nursery:
        (good,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(answer_everything, good)
        ports = [closed_port() for _ in range(5)] + [good.socket.getsockname()[1]]
        records = []
        for i, port in enumerate(ports):
            node = Identity.from_seed(b"refusing-%d" % i)
            gossip = f"127.0.0.1:{40000 + i}"
            body = replace(
                make_body(node, gossip, now),
                state=State.SERVING,
                models=(ModelInfo("m1", 4096),),
                addresses=Addresses(http=f"http://127.0.0.1:{port}", gossip=gossip),
            )
            records += [EntryMsg(body.sign(node)), Alive.make(node, 1, gossip)]
        core.ingest(records, now)
        ingress = Ingress(core, wall_clock=time.time, rng=random.Random(seed))
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        await nursery.start(ingress.serve, listener, trio.Event(), 0.1)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(url, json={"model": "m1", "messages": []})
        assert r.status_code == 200, r.text
        nursery.cancel_scope.cancel()
