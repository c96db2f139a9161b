"""The OpenAI API on every agent, through the official ``openai`` client, on real agents.

One mesh for the module: ``a`` serves m1 on an H100 under a certified provider key (lab-a);
``b`` serves m1 on an A100-80G and only *claims* to be lab-a; ``c`` has no engine and is the
ingress the clients talk to, with API keys on and a small body limit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.mesh.identity import ProviderKey
from tests.support.meshview import metrics

pytestmark = pytest.mark.slow


class Mesh:
    def __init__(self, local: LocalMesh, a: AgentProcess, b: AgentProcess, c: AgentProcess):
        self.local, self.a, self.b, self.c = local, a, b, c
        self.keys: dict[str, str] = {}
        self.request_log = local.workdir / "requests.jsonl"

    def client(self, key: str = "alice", **kw: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.c.http_url + "/v1", api_key=self.keys.get(key, key), max_retries=0, **kw
        )

    @property
    def admin(self) -> dict[str, str]:
        """Headers with the admin key: the agent's registry views and /metrics need it."""
        return {"authorization": f"Bearer {self.keys['ops']}"}

    def post(self, path: str, body: bytes | dict[str, object], **headers: str) -> httpx.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"authorization": f"Bearer {self.keys['alice']}", **headers}
        return httpx.post(self.c.http_url + path, content=data, headers=hdrs, timeout=10)


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("ingress")
    local = LocalMesh(work / "mesh")
    try:
        pkey_path = work / "lab-a.key"
        ProviderKey.generate("lab-a").save(pkey_path)
        store = ApiKeyStore(work / "api-keys.json", enabled=True)
        tokens = {
            "alice": store.new_key("alice")[0],
            "bob": store.new_key("bob", rate_per_s=0.2, burst=1)[0],
            "carol": store.new_key("carol", providers=["lab-a"])[0],
            "ops": store.new_key("ops", admin=True)[0],
        }
        store.save()
        a = local.start(
            "a", args=["--sim", "m1", "--sim-gpu", "H100", "--provider-key", str(pkey_path)]
        )
        b = local.start("b", args=["--sim", "m1", "--sim-gpu", "A100-80G", "--provider", "lab-a"])
        c = local.start(
            "c",
            args=[
                "--api-keys",
                str(work / "api-keys.json"),
                "--max-body-mb",
                "1",
                "--request-log",
                str(local.workdir / "requests.jsonl"),
            ],
        )
        mesh = Mesh(local, a, b, c)
        mesh.keys = tokens

        def both_serving() -> bool:
            try:
                r = httpx.get(
                    c.http_url + "/v1/models",
                    headers={"authorization": f"Bearer {tokens['alice']}"},
                    timeout=2,
                )
                return any(m["fabric_nodes"] == 2 for m in r.json()["data"])
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        assert wait_until(both_serving, 30), "m1 never listed with two nodes"
        yield mesh
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} ---\n{agent.stderr_tail(15)}")


def test_models_lists_the_union_of_serving_models(fab: Mesh) -> None:
    models = fab.client().models.list()
    assert [m.id for m in models.data] == ["m1"]


def test_chat_completion_is_answered_by_a_serving_node_through_another_agent(fab: Mesh) -> None:
    raw = fab.client().chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    chat = raw.parse()
    assert raw.headers["x-fabric-node"] in (fab.a.session_id, fab.b.session_id)
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 5


def test_streaming_chat_arrives_chunk_by_chunk_and_ends_cleanly(fab: Mesh) -> None:
    stream = fab.client().chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_async_client_completions_and_embeddings(fab: Mesh) -> None:
    client = openai.AsyncOpenAI(
        base_url=fab.c.http_url + "/v1", api_key=fab.keys["alice"], max_retries=0
    )
    completion = await client.completions.create(model="m1", prompt="once upon", max_tokens=4)
    assert completion.choices[0].text
    emb = await client.embeddings.create(model="m1", input="a sentence")
    assert len(emb.data[0].embedding) > 0
    await client.close()


def test_unknown_model_is_404_in_openai_shape(fab: Mesh) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        fab.client().chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_bad_json_and_missing_model_are_400(fab: Mesh) -> None:
    r = fab.post("/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = fab.post("/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]


def test_body_over_the_limit_is_413(fab: Mesh) -> None:
    big = {"model": "m1", "prompt": "x" * (2 * 1024 * 1024)}
    r = fab.post("/v1/completions", big)
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_missing_or_wrong_api_key_is_401(fab: Mesh) -> None:
    with pytest.raises(openai.AuthenticationError):
        fab.client("fab-00000000-not-a-real-key").models  # noqa: B018 (models is open)
        fab.client("fab-00000000-not-a-real-key").chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "x"}]
        )
    r = httpx.post(fab.c.http_url + "/v1/completions", json={"model": "m1", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("auth", ["", "Authorization: Bearer fab-00000000-not-a-real-key\r\n"])
def test_a_request_without_a_valid_key_gets_401_from_its_head(fab: Mesh, auth: str) -> None:
    """The key is checked once the head is in: a client without one gets its 401 before it
    sends a byte of the body it announced (and nobody can make the agent buffer bodies with no
    key; with keys on, the body limit here is 1 MiB)."""
    host, port = fab.c.http_url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"{auth}content-length: 1000000\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)  # and no body
        got = b""
        while data := sock.recv(65536):  # the agent answers, then ends its side
            got += data
    assert got.startswith(b"HTTP/1.1 401 "), got
    assert b'"code":"invalid_api_key"' in got.replace(b" ", b""), got


@pytest.mark.parametrize(
    "path", ["/metrics", "/fabric/v1/nodes", "/fabric/v1/models", "/fabric/v1/self"]
)
def test_with_keys_on_the_registry_views_and_metrics_need_an_admin_key(
    fab: Mesh, path: str
) -> None:
    """They name every node and its engine's address: readable by an admin key only, or the
    engines could be used around the keys."""
    url = fab.c.http_url + path
    r = httpx.get(url, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url, headers={"authorization": f"Bearer {fab.keys['alice']}"}, timeout=10)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["type"] == "permission_error" and "--admin" in r.text
    r = httpx.get(url, headers=fab.admin, timeout=10)
    assert r.status_code == 200


def test_with_keys_on_the_model_list_needs_a_key_as_openais_and_vllms_do(fab: Mesh) -> None:
    url = fab.c.http_url + "/v1/models"
    for headers in ({}, {"authorization": "Bearer fab-00000000-not-a-real-key"}):
        r = httpx.get(url, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.head(url, timeout=10).status_code == 401
    r = httpx.get(url, headers={"x-api-key": fab.keys["alice"]}, timeout=10)  # any key will do
    assert r.status_code == 200 and any(m["id"] == "m1" for m in r.json()["data"])


def test_with_keys_on_probes_and_signed_assignments_stay_open(fab: Mesh) -> None:
    for path in ("/health", "/ready"):
        assert httpx.get(fab.c.http_url + path, timeout=10).status_code == 200
    # Assignments carry operator signatures: the body is judged, not the caller.
    r = httpx.post(fab.c.http_url + "/fabric/v1/assignments", json={"assignments": []})
    assert r.status_code == 400, r.text


def test_the_cli_reads_the_registry_with_an_admin_key(fab: Mesh) -> None:
    base = [sys.executable, "-m", "cli.main", "--agent", fab.c.http_url]
    denied = subprocess.run([*base, "nodes"], capture_output=True, text=True, timeout=30)
    assert denied.returncode == 1 and "FABRIC_API_KEY" in denied.stderr, denied.stderr
    env = {**os.environ, "FABRIC_API_KEY": fab.keys["ops"]}
    ok = subprocess.run(
        [*base, "nodes", "--json"], capture_output=True, text=True, timeout=30, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["nodes"]) == 3


def test_rate_limited_key_gets_429_with_retry_after(fab: Mesh) -> None:
    client = fab.client("bob")
    client.completions.create(model="m1", prompt="x", max_tokens=1)  # the burst of one
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="m1", prompt="x", max_tokens=1)
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_gpu_constraint_routes_only_to_matching_nodes(fab: Mesh) -> None:
    for _ in range(6):
        r = fab.post(
            "/v1/completions",
            {"model": "m1", "prompt": f"p{time.monotonic()}", "max_tokens": 1},
            **{"x-fabric-require": "gpu=H100"},
        )
        assert r.status_code == 200 and r.headers["x-fabric-node"] == fab.a.session_id


def test_unsatisfiable_constraint_is_503_with_retry_after(fab: Mesh) -> None:
    r = fab.post(
        "/v1/completions",
        {"model": "m1", "prompt": "x", "max_tokens": 1},
        **{"x-fabric-require": "gpu=V100"},
    )
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_eligible_node"


def test_malformed_constraint_header_is_400(fab: Mesh) -> None:
    r = fab.post(
        "/v1/completions",
        {"model": "m1", "prompt": "x"},
        **{"x-fabric-require": "colour=blue"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_header"


def test_provider_allowlist_trusts_only_the_certified_provider(fab: Mesh) -> None:
    # b claims the name lab-a without a certificate: it must never satisfy the allowlist.
    for i in range(6):
        r = fab.post(
            "/v1/completions",
            {"model": "m1", "prompt": f"q{i}", "max_tokens": 1},
            **{"x-fabric-providers": "lab-a"},
        )
        assert r.status_code == 200 and r.headers["x-fabric-node"] == fab.a.session_id


def test_api_key_provider_allowlist_applies_without_any_header(fab: Mesh) -> None:
    client = fab.client("carol")
    for i in range(4):
        raw = client.completions.with_raw_response.create(model="m1", prompt=f"c{i}", max_tokens=1)
        assert raw.headers["x-fabric-node"] == fab.a.session_id


def test_forward_without_the_cluster_key_is_refused(fab: Mesh) -> None:
    forged = f"1 00000000 {int(time.time() * 1000)} abcd {'0' * 32} {'00' * 32}"
    r = httpx.post(
        fab.a.http_url + "/v1/completions",
        json={"model": "m1", "prompt": "x"},
        headers={"x-fabric-forward": forged},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "forward_refused"


@pytest.mark.parametrize(
    "value",
    [
        f"1 00000000 {'9' * 400} abcd {'0' * 32} {'00' * 32}",  # made the agent exit (rc 1)
        f"1 zz {'1' * 13} abcd {'0' * 32} {'00' * 32}",
        "1 " + "x" * 4000,
        "\u00ff\u00fe garbage",
    ],
)
def test_a_malformed_forward_header_is_403_and_the_agent_serves_on(fab: Mesh, value: str) -> None:
    for agent in (fab.a, fab.c):  # a serving agent, and an ingress with keys on
        r = httpx.post(
            agent.http_url + "/v1/completions",
            json={"model": "m1", "prompt": "x"},
            headers={"x-fabric-forward": value.encode("latin-1")},
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "forward_refused", r.text
        assert agent.running
    assert fab.client().completions.create(model="m1", prompt="x", max_tokens=2).choices


def test_metrics_count_requests_and_the_request_log_has_no_prompt_text(fab: Mesh) -> None:
    secret = "the-prompt-text-must-not-be-logged"
    fab.client().completions.create(model="m1", prompt=secret, max_tokens=2)
    text = httpx.get(fab.c.http_url + "/metrics", headers=fab.admin).text
    assert 'fabric_ingress_requests_total{model="m1",status="200"}' in text
    assert "fabric_ingress_request_seconds_bucket" in text
    log_path: Path = fab.request_log

    def records() -> list[dict[str, object]]:
        if not log_path.exists():
            return []
        return [json.loads(line) for line in log_path.read_text().splitlines()]

    # Records are flushed once a second; ours is the only one with two output tokens.
    assert wait_until(lambda: any(r["O"] == 2 for r in records()), 5)
    assert secret not in log_path.read_text()
    mine = next(r for r in records() if r["O"] == 2)
    assert mine["M"] == "m1" and mine["key"] == "alice" and mine["status"] == 200
    assert mine["node"] in (fab.a.session_id, fab.b.session_id)


def test_bookkeeping_is_settled_before_it_is_read(fab: Mesh) -> None:
    """Usage, metrics and the request log are kept off the client's path (Ingress.settle), but
    whoever reads them right after an answer sees it counted, with its own start time."""
    completion = 'fabric_ingress_tokens_total{kind="completion",model="m1"}'
    prompt = 'fabric_ingress_tokens_total{kind="prompt",model="m1"}'
    before = metrics(fab.c.http_url, fab.keys["ops"])
    started = time.time()
    reply = fab.client().chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "count me"}], max_tokens=3
    )
    answered = time.time()
    assert reply.usage is not None
    # Read at once: no other request has come through since, and no timer had to fire.
    after = metrics(fab.c.http_url, fab.keys["ops"])
    assert after[completion] - before.get(completion, 0) == reply.usage.completion_tokens == 3
    assert after[prompt] - before.get(prompt, 0) == reply.usage.prompt_tokens

    def mine() -> dict[str, object] | None:
        if not fab.request_log.exists():
            return None
        for line in fab.request_log.read_text().splitlines():
            record = json.loads(line)
            if record["O"] == 3 and started - 0.5 <= record["T"] <= answered:
                return record
        return None

    assert wait_until(lambda: mine() is not None, 5)
    record = mine()
    assert record is not None and record["I"] == reply.usage.prompt_tokens
    assert 0 < float(record["latency_s"]) <= answered - started  # type: ignore[arg-type]
