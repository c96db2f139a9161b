"""Every model-addressed endpoint through the data plane, on real agents, against stub engines
this test controls (``tests.support.api_engine``: canned answers in each endpoint's format,
mid-stream failures on demand, a record of what each engine received).

One mesh for the module: ``a1`` and ``a2`` supervise placeholder processes and point at stub
engines ``e1`` and ``e2`` (both serve ``m1`` and ``w1``); ``c`` and ``d`` are ingresses without
an engine, with API keys on (the same keys file) and a 1 MiB body limit; ``c`` keeps a request
log. Requests through ``c`` cross two data planes (``c``, then the serving agent's relay).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.dataplane.endpoints import node_of_response
from tests.support.api_engine import TOKENS, ApiEngine
from tests.support.meshview import metrics

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
PLACEHOLDER = [sys.executable, "-c", "import time; time.sleep(3600)"]


@dataclass
class Mesh:
    local: LocalMesh
    engines: dict[str, ApiEngine]  # by the session id of the agent in front of each
    agents: dict[str, AgentProcess]  # serving agents by session id
    c: AgentProcess
    d: AgentProcess
    keys: dict[str, str]
    request_log: Path

    def headers(self, key: str = "alice", **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[key]}", **extra}

    def post(
        self, path: str, body: bytes | dict[str, Any], via: AgentProcess | None = None, **kw: Any
    ) -> httpx.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = kw.pop("headers", None) or self.headers()
        headers.setdefault("content-type", "application/json")
        url = (via or self.c).http_url + path
        return httpx.post(url, content=data, headers=headers, timeout=20, **kw)

    def engine_of(self, r: httpx.Response) -> ApiEngine:
        return self.engines[r.headers["x-fabric-node"]]

    def openai(self, via: AgentProcess | None = None, key: str = "alice") -> openai.OpenAI:
        url = (via or self.c).http_url + "/v1"
        return openai.OpenAI(base_url=url, api_key=self.keys.get(key, key), max_retries=0)

    def anthropic(self, key: str = "alice") -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.c.http_url, api_key=self.keys.get(key, key), max_retries=0, timeout=20
        )

    def admin_metrics(self, agent: AgentProcess | None = None) -> dict[str, float]:
        return metrics((agent or self.c).http_url, self.keys["ops"])

    def log_lines(self) -> list[dict[str, Any]]:
        if not self.request_log.exists():
            return []
        return [json.loads(line) for line in self.request_log.read_text().splitlines()]


# The model list needs a key where keys are on (the ingresses c and d): the tests ask as ops.
LIST_KEY: dict[str, str] = {}


def serves(agent: AgentProcess, model: str, nodes: int) -> bool:
    try:
        data = httpx.get(agent.http_url + "/v1/models", headers=LIST_KEY, timeout=2).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return any(m["id"] == model and m["fabric_nodes"] == nodes for m in data)


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("endpoints")
    local = LocalMesh(work / "mesh")
    stubs = [ApiEngine("e1", ("m1", "w1")), ApiEngine("e2", ("m1", "w1"))]
    try:
        store = ApiKeyStore(work / "api-keys.json", enabled=True)
        keys = {
            "alice": store.new_key("alice")[0],
            "bob": store.new_key("bob", rate_per_s=0.1, burst=1)[0],
            "ops": store.new_key("ops", admin=True)[0],
        }
        store.save()
        LIST_KEY["authorization"] = f"Bearer {keys['ops']}"
        agents = {}
        engines = {}
        for i, stub in enumerate(stubs, 1):
            agent = local.start(f"a{i}", args=["--engine-url", stub.url, "--", *PLACEHOLDER])
            agents[agent.session_id] = agent
            engines[agent.session_id] = stub
        keyed = ["--api-keys", str(work / "api-keys.json"), "--max-body-mb", "1"]
        log = work / "requests.jsonl"
        c = local.start("c", args=[*keyed, "--request-log", str(log)])
        d = local.start("d", args=keyed)
        for agent in (c, d):
            assert wait_until(lambda a=agent: serves(a, "m1", 2), 30), agent.name
        yield Mesh(local, engines, agents, c, d, keys, log)
    finally:
        local.close()
        for stub in stubs:
            stub.close()
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(20)}")


# == routed by model =========================================================================

JSON_ENDPOINTS = {
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
    "/rerank": {"query": "q", "documents": ["a"]},
    "/v2/rerank": {"query": "q", "documents": ["a"]},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/score": {"text_1": "a", "text_2": "b"},
    "/pooling": {"input": "x"},
    "/classify": {"input": "x"},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/completions": {"prompt": "once"},
    "/v1/embeddings": {"input": "x"},
    "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("path", list(JSON_ENDPOINTS))
def test_each_json_endpoint_is_routed_by_model_with_its_body_untouched(
    fab: Mesh, path: str
) -> None:
    # Odd spacing and key order: the engine must receive these very bytes.
    body = json.dumps({**JSON_ENDPOINTS[path], "model": "m1"}, indent=1).encode()
    r = fab.post(path, body)
    assert r.status_code == 200, r.text
    engine = fab.engine_of(r)
    got = engine.requests(path)[-1]
    assert got.method == "POST" and got.body == body
    assert "authorization" not in got.headers and "x-api-key" not in got.headers


def test_a_chat_request_reaches_the_engine_byte_for_byte_as_before(fab: Mesh) -> None:
    """The chat path is unchanged: the body as sent, and the head every engine got before."""
    body = b'{ "messages":[{"role":"user","content":"hi \\u00e9"}],\n "model" : "m1"}'
    r = fab.post("/v1/chat/completions", body, headers=fab.headers(**{"x-request-id": "r-1"}))
    assert r.status_code == 200, r.text
    got = fab.engine_of(r).requests("/v1/chat/completions")[-1]
    assert got.body == body
    port = fab.engine_of(r).port
    assert got.head == (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\naccept: */*\r\n"
        b"x-request-id: r-1" % (port, len(body))
    )


def test_paths_outside_v1_still_reach_the_control_app(fab: Mesh) -> None:
    assert httpx.get(fab.c.http_url + "/health", timeout=5).status_code == 200
    r = httpx.get(fab.c.http_url + "/fabric/v1/self", headers=fab.headers("ops"), timeout=5)
    assert r.status_code == 200 and r.json()["session_id"] == fab.c.session_id
    r = httpx.get(fab.c.http_url + "/no/such/path", headers=fab.headers("ops"), timeout=5)
    assert r.status_code == 404


def test_a_model_routed_path_outside_v1_wants_post(fab: Mesh) -> None:
    r = httpx.get(fab.c.http_url + "/tokenize", headers=fab.headers(), timeout=5)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_unknown_v1_paths_name_where_the_endpoints_are_listed(fab: Mesh) -> None:
    r = fab.post("/v1/no/such/thing", {"model": "m1"})
    assert r.status_code == 404
    assert "docs/user-guide.md" in r.json()["error"]["message"]


def test_version_and_ping_are_answered_by_the_agent(fab: Mesh) -> None:
    version = httpx.get(fab.c.http_url + "/version", timeout=5)  # open, as /health
    assert version.status_code == 200
    doc = version.json()
    assert doc["version"] and doc["engines"][0]["nodes"] == 2
    for method in ("GET", "POST"):
        ping = httpx.request(method, fab.c.http_url + "/ping", timeout=5)
        assert ping.status_code == 200 and ping.json()["status"] == "ready"


# == multipart ===============================================================================


def form(parts: list[tuple[str, bytes, str | None]], boundary: str = "b0und4ry") -> bytes:
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"'
        if filename:
            disposition += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename:
            out += b"Content-Type: audio/wav\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_audio_forms_are_routed_by_their_model_field_after_a_large_file(
    fab: Mesh, path: str
) -> None:
    audio = bytes(range(256)) * (600 * 1024 // 256)  # 600 KiB: many socket reads
    body = form([("file", audio, "a.wav"), ("language", b"en", None), ("model", b"w1", None)])
    content_type = 'multipart/form-data; boundary="b0und4ry"'
    r = fab.post(path, body, headers=fab.headers(**{"content-type": content_type}))
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "hello"
    got = fab.engine_of(r).requests(path)[-1]
    assert got.body == body and got.headers["content-type"] == content_type
    # The engine reports the audio's duration as its usage: counted per model.
    assert wait_until(
        lambda: fab.admin_metrics().get('fabric_ingress_audio_seconds_total{model="w1"}', 0) > 0,
        10,
    )


def test_a_form_without_a_model_field_is_400(fab: Mesh) -> None:
    body = form([("file", b"RIFF", "a.wav")])
    headers = fab.headers(**{"content-type": "multipart/form-data; boundary=b0und4ry"})
    r = fab.post("/v1/audio/transcriptions", body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_model"
    r = fab.post("/v1/audio/transcriptions", body, headers=fab.headers())  # JSON content type
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_form"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_oversize_upload_is_413_while_it_arrives_without_growing_the_agent(
    fab: Mesh,
) -> None:
    """A chunked 64 MiB upload (no length to refuse it by): refused once past the 1 MiB limit,
    the rest read and dropped, never held."""
    host, port = fab.c.http_url.removeprefix("http://").rsplit(":", 1)
    before = rss(fab.c.pid)
    head = (
        "POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {fab.keys['alice']}\r\n"
        "content-type: multipart/form-data; boundary=b0und4ry\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"x" * MIB
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        start = b"--b0und4ry\r\nContent-Disposition: form-data; name=file\r\n\r\n"
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(start), start))
        try:
            for _ in range(64):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the agent may close once it has dropped what it lingers for
        got = b""
        while data := sock.recv(65536):
            got += data
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert b"request_too_large" in got
    assert rss(fab.c.pid) - before < 24 * MIB


# == streams =================================================================================


def stream_bytes(fab: Mesh, path: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    with httpx.stream(
        "POST", fab.c.http_url + path, json=body, headers=fab.headers(), timeout=20
    ) as r:
        data = r.read()  # raises if the chunked body is not terminated
    return r, data


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_responses_and_messages_streams_are_relayed_untouched(
    fab: Mesh, path: str, body: dict[str, Any]
) -> None:
    r, data = stream_bytes(fab, path, {**body, "model": "m1", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = fab.engine_of(r).requests(path)[-1]
    assert data == got.sent, "the client gets exactly the engine's events"


def events_of(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in data.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


def test_a_responses_stream_that_breaks_ends_with_its_own_error_events(fab: Mesh) -> None:
    body = {"model": "m1", "input": "hi", "stream": True, "stub_break_after": 3}
    _, data = stream_bytes(fab, "/v1/responses", body)
    events = events_of(data)
    assert [e for e, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    error, failed = events[-2][1], events[-1][1]
    assert error["type"] == "error" and error["code"] == "upstream_broken"
    assert error["sequence_number"] == 3 and failed["sequence_number"] == 4
    created = events[0][1]["response"]
    assert failed["response"]["id"] == created["id"] and failed["response"]["status"] == "failed"
    # The official client reads them as the Responses API's own event types.
    stream = fab.openai().responses.create(
        model="m1", input="hi", stream=True, extra_body={"stub_break_after": 3}
    )
    types = [event.type for event in stream]
    assert types[-2:] == ["error", "response.failed"]
    assert wait_until(
        lambda: (
            fab.admin_metrics().get(
                'fabric_ingress_stream_resumes_total{outcome="not_resumable"}', 0
            )
            >= 2
        ),
        10,
    )


def test_a_messages_stream_that_breaks_ends_with_anthropics_error_event(fab: Mesh) -> None:
    body = {
        "model": "m1",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "stub_break_after": 3,
    }
    _, data = stream_bytes(fab, "/v1/messages", body)
    events = events_of(data)
    assert events[-1][0] == "error"
    assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"
    with (
        pytest.raises(anthropic.APIStatusError) as raised,
        fab.anthropic().messages.stream(
            model="m1",
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"stub_break_after": 3},
        ) as stream,
    ):
        for _ in stream:
            pass
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["error"]["type"] == "api_error"


def test_a_broken_chat_stream_still_resumes_on_the_other_node(fab: Mesh) -> None:
    before = fab.admin_metrics().get('fabric_ingress_stream_resumes_total{outcome="resumed"}', 0)
    body = {
        "model": "m1",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "stub_break_after": 3,
    }
    _, data = stream_bytes(fab, "/v1/chat/completions", body)
    # The continuation also breaks after 3 events, but its role chunk is dropped: the client
    # gets more content each time, until no node is left to try and the error event ends it.
    assert b"upstream_broken" in data and data.count(b'"content": "Hello"') >= 1
    after = fab.admin_metrics().get('fabric_ingress_stream_resumes_total{outcome="resumed"}', 0)
    assert after > before


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_a_stream_broken_before_its_first_event_is_answered_whole_by_another_node(
    fab: Mesh, path: str, body: dict[str, Any]
) -> None:
    """The first node sends its 200 head and dies: the client has nothing of the answer yet, so
    the request goes whole to the other node, whose stream the client gets as it came."""
    before = fab.admin_metrics().get('fabric_ingress_stream_resumes_total{outcome="resumed"}', 0)
    body = {**body, "model": "m1", "stream": True, "stub_break_after": 0,
            "stub_break_first": f"head-only-{time.monotonic_ns()}"}  # fmt: skip
    _, data = stream_bytes(fab, path, body)
    assert b"upstream_broken" not in data and b'"error"' not in data, data
    payloads = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    if path == "/v1/chat/completions":
        assert payloads[-1] == b"[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")) == 1
    else:
        last = json.loads(payloads[-1])["type"]
        assert last == ("response.completed" if path == "/v1/responses" else "message_stop")
    after = fab.admin_metrics().get('fabric_ingress_stream_resumes_total{outcome="resumed"}', 0)
    assert after == before + 1


# == usage ===================================================================================


def test_usage_is_accounted_per_endpoint_in_metrics_and_the_request_log(fab: Mesh) -> None:
    client = fab.openai()
    client.responses.create(model="m1", input="hi")
    list(client.responses.create(model="m1", input="hi", stream=True))
    messages = fab.anthropic()
    messages.messages.create(model="m1", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    with messages.messages.stream(
        model="m1", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    ) as stream:
        assert stream.get_final_message().usage.output_tokens == len(TOKENS)
    assert fab.post("/v1/rerank", {"model": "m1", "query": "q", "documents": []}).is_success

    def logged() -> dict[str, list[tuple[int | None, int | None, bool]]]:
        out: dict[str, list[tuple[int | None, int | None, bool]]] = {}
        for line in fab.log_lines():
            out.setdefault(line.get("endpoint"), []).append((line["I"], line["O"], line["stream"]))
        return out

    def complete() -> bool:
        seen = logged()
        return (
            (7, 4, False) in seen.get("responses", [])
            and (7, 4, True) in seen.get("responses", [])
            and (9, 4, False) in seen.get("messages", [])
            and (9, 4, True) in seen.get("messages", [])
            and (11, 0, False) in seen.get("rerank", [])
        )

    assert wait_until(complete, 10), logged()
    m = fab.admin_metrics()
    for endpoint, prompt in (("responses", 14), ("messages", 18), ("rerank", 11)):
        series = f'fabric_ingress_endpoint_tokens_total{{endpoint="{endpoint}",kind="prompt"}}'
        assert m.get(series, 0) >= prompt, (series, m.get(series))
    assert m.get('fabric_ingress_endpoint_requests_total{endpoint="messages",status="200"}', 0) >= 2


# == Anthropic's dialect =====================================================================

ASK = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def test_anthropic_sdk_gets_typed_errors_from_the_ingress(fab: Mesh) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        fab.anthropic().messages.create(model="no-such-model", **ASK)  # type: ignore[arg-type]
    assert not_found.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "model 'no-such-model' is not served by any node",
        },
    }
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        fab.anthropic("fab-00000000-not-a-real-key").messages.create(model="m1", **ASK)  # type: ignore[arg-type]
    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bob = fab.anthropic("bob")
    bob.messages.create(model="m1", **ASK)  # type: ignore[arg-type]  (its burst of one)
    with pytest.raises(anthropic.RateLimitError) as limited:
        bob.messages.create(model="m1", **ASK)  # type: ignore[arg-type]
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(anthropic.InternalServerError) as nobody:
        fab.anthropic().messages.create(
            model="m1",
            extra_headers={"x-fabric-require": "gpu=NO-SUCH-GPU"},
            **ASK,  # type: ignore[arg-type]
        )
    assert nobody.value.status_code == 503
    assert nobody.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (b"{not json", 400, "invalid_request_error"),
        (b'{"messages": []}', 400, "invalid_request_error"),
        (b"x" * (2 * MIB), 413, "request_too_large"),
    ],
)
def test_malformed_anthropic_requests_get_anthropic_shaped_errors(
    fab: Mesh, body: bytes, status: int, kind: str
) -> None:
    r = fab.post("/v1/messages", body)
    assert r.status_code == status
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == kind and "message" in doc["error"]


def test_anthropic_key_header_is_accepted_everywhere(fab: Mesh) -> None:
    key = {"x-api-key": fab.keys["alice"]}
    r = fab.post("/v1/chat/completions", {"model": "m1", "messages": []}, headers=key)
    assert r.status_code == 200, r.text
    answer = fab.anthropic().messages.create(model="m1", **ASK)  # type: ignore[arg-type]
    assert answer.content[0].text == "".join(TOKENS)  # type: ignore[union-attr]
    wrong = fab.post("/v1/chat/completions", {"model": "m1"}, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


# == stateful Responses ======================================================================


def test_a_stored_response_is_reached_from_another_ingress(fab: Mesh) -> None:
    created = fab.openai(fab.c).responses.with_raw_response.create(model="m1", input="hi")
    response = created.parse()
    node = created.headers["x-fabric-node"]
    assert node_of_response(response.id) == node, "the id names the node that stored it"
    engine = fab.engines[node]
    assert json.loads(engine.requests("/v1/responses")[-1].body)["request_id"] == response.id

    other = fab.openai(fab.d)
    for _ in range(4):  # whatever the policy would pick: always the storing node
        assert other.responses.retrieve(response.id).id == response.id
    assert len(engine.requests(f"/v1/responses/{response.id}")) == 4
    follow = other.responses.with_raw_response.create(
        model="m1", input="and then?", previous_response_id=response.id
    )
    assert follow.headers["x-fabric-node"] == node
    assert node_of_response(follow.parse().id) == node
    cancelled = httpx.post(
        f"{fab.d.http_url}/v1/responses/{response.id}/cancel", headers=fab.headers(), timeout=10
    )
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert engine.requests(f"/v1/responses/{response.id}/cancel")


def test_a_stored_response_belongs_to_the_key_that_created_it_on_every_ingress(
    fab: Mesh,
) -> None:
    """With keys on, another key can neither read, continue nor cancel alice's stored
    response, through either ingress, and learns only what an unknown id would tell it; alice
    still can, through the other ingress too."""
    rid = fab.openai(fab.c).responses.create(model="m1", input="hi").id
    engine = fab.engines[node_of_response(rid) or ""]
    reads = len(engine.requests(f"/v1/responses/{rid}"))
    for via in (fab.c, fab.d):
        other = fab.openai(via, key="ops")
        with pytest.raises(openai.NotFoundError) as raised:
            other.responses.retrieve(rid)
        assert raised.value.body["code"] == "response_not_found"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model="m1", input="more", previous_response_id=rid)
        cancel = httpx.post(
            f"{via.http_url}/v1/responses/{rid}/cancel", headers=fab.headers("ops"), timeout=10
        )
        assert cancel.status_code == 404 and cancel.json()["error"]["code"] == "response_not_found"
    assert len(engine.requests(f"/v1/responses/{rid}")) == reads, "nothing reached the engine"
    assert not engine.requests(f"/v1/responses/{rid}/cancel")
    assert fab.openai(fab.d).responses.retrieve(rid).id == rid


def test_a_retrieve_with_a_query_keeps_it(fab: Mesh) -> None:
    rid = fab.openai().responses.create(model="m1", input="hi").id
    r = httpx.get(
        f"{fab.d.http_url}/v1/responses/{rid}?starting_after=2", headers=fab.headers(), timeout=10
    )
    assert r.status_code == 200
    got = fab.engines[node_of_response(rid) or ""].requests(f"/v1/responses/{rid}")[-1]
    assert got.target == f"/v1/responses/{rid}?starting_after=2"


def test_response_ids_that_name_no_node_are_404(fab: Mesh) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        fab.openai().responses.retrieve("resp_0123")
    assert raised.value.body["code"] == "response_not_found"  # type: ignore[index]
    r = httpx.get(fab.c.http_url + "/v1/responses/resp_0123", timeout=10)
    assert r.status_code == 401, "the key is checked first"


def test_once_the_storing_node_left_its_responses_are_a_clear_404(fab: Mesh) -> None:
    solo = ApiEngine("e3", ("m-solo",))
    try:
        agent = fab.local.start("a3", args=["--engine-url", solo.url, "--", *PLACEHOLDER])
        assert wait_until(lambda: serves(fab.c, "m-solo", 1) and serves(fab.d, "m-solo", 1), 30)
        rid = fab.openai(fab.c).responses.create(model="m-solo", input="hi").id
        assert node_of_response(rid) == agent.session_id
        agent.terminate()  # a graceful leave: LEFT is signed and spread
        assert agent.wait(20) == 0
        assert wait_until(lambda: not serves(fab.d, "m-solo", 1), 20)
        with pytest.raises(openai.NotFoundError) as raised:
            fab.openai(fab.d).responses.retrieve(rid)
        body = raised.value.body
        assert body["code"] == "response_node_gone"  # type: ignore[index]
        assert "left the mesh" in body["message"]  # type: ignore[index]
        r = fab.post("/v1/responses", {"model": "m1", "input": "x", "previous_response_id": rid})
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_node_gone"
    finally:
        solo.close()


def test_a_response_that_fails_over_is_named_after_the_node_that_answered(fab: Mesh) -> None:
    """Each attempt names its own node: the id the client gets names the node that stored it,
    not the one tried first. (Last in the module: the failed node is ejected a while.)"""
    body = {"model": "m1", "input": "x", "stub_fail_first": "failover-1"}
    r = fab.post("/v1/responses", body)
    assert r.status_code == 200, r.text
    served = r.headers["x-fabric-node"]
    assert node_of_response(r.json()["id"]) == served
    (failed,) = [
        sid
        for sid, engine in fab.engines.items()
        for seen in engine.requests("/v1/responses")
        if b"failover-1" in seen.body and sid != served
    ]
    (attempt,) = fab.engines[failed].requests("/v1/responses")[-1:]
    assert node_of_response(json.loads(attempt.body)["request_id"]) == failed != served
