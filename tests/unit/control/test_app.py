"""The admin API (ASGI, in process) over a MeshCore holding a few merged entries."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabricnode.control.app import AdminApp
from fabricnode.control.views import models_view
from fabricnode.mesh.assignment import AssignmentBody
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity, OperatorKey
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import Hardware, ModelInfo, State
from fabricnode.mesh.service import TransportStatistics
from fabricnode.mesh.servicedoc import ServicesBody
from fabricnode.mesh.wire import DEAD, SUSPECT, Accusation, Load
from fabricnode.requestlog.format import TraceRecord
from fabricnode.requestlog.writer import RequestLog
from fabricnode.testing.simnet import make_body
from tests.support.meshview import ENTRY_KEYS

NOW = 1_750_000_000.0


@dataclass
class Mesh:
    core: MeshCore
    ids: dict[str, Identity] = field(default_factory=dict)

    def sid(self, name: str) -> str:
        return self.ids[name].session_id


def add_entry(mesh: Mesh, name: str, index: int, **kw: Any) -> str:
    identity = Identity.from_seed(f"admin-test-{name}".encode())
    addr = f"10.0.0.{index}:7946"
    entry = make_body(identity, addr, NOW, **kw).sign(identity)
    core = mesh.core
    assert core.registry.merge(entry, NOW).changed
    if entry.body.state == State.LEFT:
        core.members.mark_left(entry.session_id, NOW)
    else:
        core.members.learn_address(entry.session_id, addr, NOW)
    mesh.ids[name] = identity
    return entry.session_id


def build_mesh() -> Mesh:
    me = Identity.from_seed(b"admin-test-self")
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "10.0.0.1:7946", NOW), NOW)
    mesh = Mesh(core, {"self": me})
    a100 = Hardware("A100-80G", 4, 80.0, "gpu-a")
    h100 = Hardware("H100", 8, 80.0, "gpu-b")
    llama = ModelInfo("llama-3-8b", 8192, None)
    qwen = ModelInfo("qwen-7b", 32768, "fp8")
    add_entry(
        mesh,
        "serving-a100",
        2,
        state=State.SERVING,
        hardware=a100,
        models=(llama,),
        labels=(("team", "nlp"),),
        provider="alice",
    )
    add_entry(
        mesh,
        "serving-h100",
        3,
        state=State.SERVING,
        hardware=h100,
        models=(llama, qwen),
        labels=(("team", "vision"),),
        provider="bob",
        site="B",
    )
    add_entry(mesh, "joining", 4, provider="carol")
    add_entry(mesh, "gone", 5, state=State.LEFT, provider="dave")
    add_entry(mesh, "crashed", 6, state=State.SERVING, hardware=a100, models=(qwen,), site="B")
    add_entry(mesh, "flaky", 7)
    accuser = mesh.ids["serving-a100"]
    core.members.apply_accusation(Accusation.make(accuser, DEAD, mesh.sid("crashed"), 0), NOW)
    core.members.apply_accusation(Accusation.make(accuser, SUSPECT, mesh.sid("flaky"), 0), NOW)
    core.loads[mesh.sid("serving-a100")] = Load(mesh.sid("serving-a100"), 1, 2, 3, 0.5, 4, NOW)
    core.loads[mesh.sid("serving-h100")] = Load(mesh.sid("serving-h100"), 1, 1, 5, 0.25, 2, NOW)
    return mesh


@dataclass
class FakeTransport:
    def statistics(self) -> TransportStatistics:
        return TransportStatistics(10, 11, 2, 3, 1, 0)


@dataclass
class FakeKeyring:
    keyring_reloads: int = 2
    keyring_errors: int = 1


def client(app: AdminApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")


@pytest.fixture
def mesh() -> Mesh:
    return build_mesh()


@pytest.fixture
def app(mesh: Mesh) -> AdminApp:
    return AdminApp(
        mesh.core,
        transport=FakeTransport(),
        keyring=FakeKeyring(),
        wall_clock=lambda: NOW + 1,
    )


async def get(app: AdminApp, path: str, **params: Any) -> httpx.Response:
    async with client(app) as c:
        return await c.get(path, params=params or None)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["code"] == code
    assert error["message"]
    return str(error["message"])


# -- health and readiness -------------------------------------------------------------------------


async def test_health_answers_ok(app: AdminApp) -> None:
    response = await get(app, "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_ready_is_503_until_the_agent_has_joined(mesh: Mesh) -> None:
    joined = False
    app = AdminApp(mesh.core, is_ready=lambda: joined)
    response = await get(app, "/ready")
    assert (response.status_code, response.json()) == (503, {"status": "joining"})
    joined = True
    response = await get(app, "/ready")
    assert (response.status_code, response.json()) == (200, {"status": "ready"})


async def test_ready_is_503_once_the_agent_has_signed_left(app: AdminApp, mesh: Mesh) -> None:
    mesh.core.leave(NOW + 1)
    response = await get(app, "/ready")
    assert (response.status_code, response.json()) == (503, {"status": "left"})
    self_view = (await get(app, "/fabric/v1/self")).json()
    assert (self_view["state"], self_view["liveness"]) == ("left", "left")


# -- registry views -------------------------------------------------------------------------------


async def test_nodes_lists_every_entry_with_the_spec_keys(app: AdminApp, mesh: Mesh) -> None:
    response = await get(app, "/fabric/v1/nodes")
    assert response.status_code == 200
    nodes = response.json()["nodes"]
    assert {n["session_id"] for n in nodes} == {i.session_id for i in mesh.ids.values()}
    assert [n["session_id"] for n in nodes] == sorted(n["session_id"] for n in nodes)
    for n in nodes:
        assert list(n) == ENTRY_KEYS
        assert list(n["addresses"]) == ["http", "gossip"]
        assert list(n["hardware"]) == ["gpu_type", "gpu_count", "gpu_memory_gb", "host"]
        assert list(n["engine"]) == ["kind", "version", "url"]
    by_id = {n["session_id"]: n for n in nodes}
    h100 = by_id[mesh.sid("serving-h100")]
    assert h100["state"] == "serving"
    assert h100["provider"] == "bob"
    assert h100["verified_provider"] is None
    assert h100["hardware"] == {
        "gpu_type": "H100",
        "gpu_count": 8,
        "gpu_memory_gb": 80.0,
        "host": "gpu-b",
    }
    assert h100["models"] == [
        {"id": "llama-3-8b", "max_model_len": 8192, "quantization": None, "parent": None},
        {"id": "qwen-7b", "max_model_len": 32768, "quantization": "fp8", "parent": None},
    ]
    assert h100["labels"] == {"team": "vision"}, "the site is no label"
    assert h100["site"] == "B"
    assert by_id[mesh.sid("serving-a100")]["site"] == "default"
    assert h100["addresses"]["gossip"] == "10.0.0.3:7946"


async def test_liveness_is_this_agents_local_view(app: AdminApp, mesh: Mesh) -> None:
    nodes = (await get(app, "/fabric/v1/nodes")).json()["nodes"]
    liveness = {n["session_id"]: n["liveness"] for n in nodes}
    assert liveness[mesh.sid("self")] == "alive"
    assert liveness[mesh.sid("serving-a100")] == "alive"
    assert liveness[mesh.sid("crashed")] == "dead"
    assert liveness[mesh.sid("flaky")] == "suspect"
    assert liveness[mesh.sid("gone")] == "left"


async def test_an_entry_no_probe_vouches_for_is_shown_unvouched_and_not_counted(
    app: AdminApp, mesh: Mesh
) -> None:
    """A cluster-key holder's SERVING entry with no gossip address: the router never sends to
    it, so the admin views neither call it alive nor count it as a node of its model."""
    liar = Identity.from_seed(b"admin-test-phantom")
    phantom = make_body(
        liar, "", NOW, state=State.SERVING, models=(ModelInfo("phantom-model", 4096, None),)
    )
    assert mesh.core.registry.merge(phantom.sign(liar), NOW).changed
    nodes = (await get(app, "/fabric/v1/nodes")).json()["nodes"]
    liveness = {n["session_id"]: n["liveness"] for n in nodes}
    assert liveness[liar.session_id] == "unvouched"
    assert liveness[mesh.sid("serving-a100")] == "alive"
    models = {m["id"]: m for m in (await get(app, "/fabric/v1/models")).json()["models"]}
    assert (models["phantom-model"]["nodes"], models["phantom-model"]["serving"]) == (0, 0)


async def test_load_is_null_without_a_report_and_shown_with_one(app: AdminApp, mesh: Mesh) -> None:
    nodes = (await get(app, "/fabric/v1/nodes")).json()["nodes"]
    load = {n["session_id"]: n["load"] for n in nodes}
    assert load[mesh.sid("joining")] is None
    assert load[mesh.sid("serving-a100")] == {
        "waiting": 2,
        "running": 3,
        "kv_usage": 0.5,
        "inflight": 4,
        "updated_at": NOW,
    }


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"state": "serving"}, {"serving-a100", "serving-h100", "crashed"}),
        ({"state": "LEFT"}, {"gone"}),
        ({"model": "qwen-7b"}, {"serving-h100", "crashed"}),
        ({"gpu": "a100-80g"}, {"serving-a100", "crashed"}),
        ({"label": "team=nlp"}, {"serving-a100"}),
        ({"state": "serving", "model": "llama-3-8b", "gpu": "H100"}, {"serving-h100"}),
        ({"model": "no-such-model"}, set()),
        ({"site": "B"}, {"serving-h100", "crashed"}),
        ({"site": "b"}, set()),  # names are compared exactly
        ({"site": "B", "model": "llama-3-8b"}, {"serving-h100"}),
        ({"site": "default", "state": "serving"}, {"serving-a100"}),
    ],
)
async def test_nodes_filters_combine(
    app: AdminApp, mesh: Mesh, params: dict[str, str], expected: set[str]
) -> None:
    response = await get(app, "/fabric/v1/nodes", **params)
    assert response.status_code == 200
    assert {n["session_id"] for n in response.json()["nodes"]} == {mesh.sid(n) for n in expected}


async def test_repeated_label_filters_must_all_match(app: AdminApp, mesh: Mesh) -> None:
    async with client(app) as c:
        both = await c.get("/fabric/v1/nodes", params=[("label", "team=nlp"), ("label", "x=y")])
        one = await c.get("/fabric/v1/nodes", params=[("label", "team=nlp")])
    assert both.json()["nodes"] == []
    assert [n["session_id"] for n in one.json()["nodes"]] == [mesh.sid("serving-a100")]


@pytest.mark.parametrize(
    "params",
    [
        {"state": "sleeping"},
        {"label": "no-equals-sign"},
        {"label": "=v"},
        {"colour": "red"},
        {"site": "a b"},
        {"site": "x" * 33},
    ],
)
async def test_bad_filters_are_400_with_an_openai_error(
    app: AdminApp, params: dict[str, str]
) -> None:
    response = await get(app, "/fabric/v1/nodes", **params)
    assert_openai_error(response, 400, "invalid_parameter")
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_node_accepts_the_full_id_or_a_unique_prefix(app: AdminApp, mesh: Mesh) -> None:
    sid = mesh.sid("serving-h100")
    others = [i.session_id for name, i in mesh.ids.items() if name != "serving-h100"]
    prefix = next(sid[:n] for n in range(1, 33) if not any(o.startswith(sid[:n]) for o in others))
    for key in (sid, prefix, sid.upper()):
        response = await get(app, f"/fabric/v1/nodes/{key}")
        assert response.status_code == 200, key
        assert response.json()["session_id"] == sid
        assert list(response.json()) == ENTRY_KEYS


async def test_unknown_node_is_404(app: AdminApp) -> None:
    response = await get(app, "/fabric/v1/nodes/zzzz")
    assert "zzzz" in assert_openai_error(response, 404, "not_found")


async def test_ambiguous_prefix_is_409() -> None:
    mesh = build_mesh()
    # Add sessions until two of them share a first hex digit (deterministic seeds).
    for i in itertools.count(10):
        add_entry(mesh, f"extra-{i}", i)
        firsts = [sid[0] for sid in mesh.core.registry.session_ids()]
        shared = next((c for c in set(firsts) if firsts.count(c) > 1), None)
        if shared is not None:
            break
    app = AdminApp(mesh.core)
    response = await get(app, f"/fabric/v1/nodes/{shared}")
    message = assert_openai_error(response, 409, "ambiguous_session_id")
    assert "ambiguous" in message


async def test_self_is_this_agents_own_entry(app: AdminApp, mesh: Mesh) -> None:
    response = await get(app, "/fabric/v1/self")
    assert response.status_code == 200
    body = response.json()
    assert body["session_id"] == mesh.sid("self")
    assert (body["state"], body["liveness"]) == ("join", "alive")
    assert list(body) == ENTRY_KEYS


async def test_models_aggregate_nodes_gpu_types_and_load(app: AdminApp) -> None:
    response = await get(app, "/fabric/v1/models")
    assert response.status_code == 200
    models = {m["id"]: m for m in response.json()["models"]}
    assert list(models) == ["llama-3-8b", "qwen-7b"]
    llama = models["llama-3-8b"]
    assert (llama["nodes"], llama["serving"]) == (2, 2)
    assert llama["gpu_types"] == ["A100-80G", "H100"]
    assert llama["gpus"] == 12
    assert llama["providers"] == ["alice", "bob"]
    assert llama["load"] == {"waiting": 3, "running": 8, "inflight": 6, "kv_usage": 0.375}
    qwen = models["qwen-7b"]
    # The crashed node still announces qwen, but a dead node is counted nowhere.
    assert (qwen["nodes"], qwen["serving"]) == (1, 1)
    assert qwen["gpu_types"] == ["H100"]
    assert qwen["quantizations"] == ["fp8"]
    assert qwen["max_model_len"] == 32768


async def test_models_break_their_counts_down_by_site(app: AdminApp) -> None:
    models = {m["id"]: m for m in (await get(app, "/fabric/v1/models")).json()["models"]}
    row = {"nodes": 1, "serving": 1, "asleep": 0}
    assert models["llama-3-8b"]["sites"] == [
        {"site": "B", **row, "gpus": 8},
        {"site": "default", **row, "gpus": 4},
    ]
    # The crashed node is of site B too, and counted nowhere.
    assert models["qwen-7b"]["sites"] == [{"site": "B", **row, "gpus": 8}]


async def test_self_shows_this_agents_site(mesh: Mesh) -> None:
    mesh.core.update_self(NOW + 1, site="C-2")
    app = AdminApp(mesh.core, wall_clock=lambda: NOW + 1)
    assert (await get(app, "/fabric/v1/self")).json()["site"] == "C-2"


def test_models_view_counts_only_serving_nodes_not_known_dead() -> None:
    mesh = build_mesh()
    core = mesh.core
    qwen = ModelInfo("qwen-7b", 32768, "fp8")
    l40s = Hardware("L40S", 2, 48.0, "gpu-c")
    add_entry(mesh, "suspect-l40s", 8, state=State.SERVING, hardware=l40s, models=(qwen,))
    add_entry(mesh, "loading", 9, hardware=Hardware("RTX-3090", 1, 24.0, "gpu-d"), models=(qwen,))
    accuser = mesh.ids["serving-a100"]
    core.members.apply_accusation(
        Accusation.make(accuser, SUSPECT, mesh.sid("suspect-l40s"), 0), NOW
    )
    for name, waiting in (("suspect-l40s", 4), ("loading", 20), ("crashed", 50)):
        core.loads[mesh.sid(name)] = Load(mesh.sid(name), 1, waiting, 1, 0.75, 0, NOW)

    row = {m["id"]: m for m in models_view(core, NOW + 1)}["qwen-7b"]

    # h100 (alive) and l40s (suspect) could take a request; the crashed A100 node (dead) and the
    # JOIN node whose engine is still loading count nowhere: not as nodes, GPUs or load.
    assert (row["nodes"], row["serving"]) == (2, 1)
    assert row["gpu_types"] == ["H100", "L40S"]
    assert row["gpus"] == 8 + 2
    assert row["load"] == {"waiting": 1 + 4, "running": 5 + 1, "inflight": 2, "kv_usage": 0.5}


# -- metrics --------------------------------------------------------------------------------------


async def test_metrics_are_prometheus_text_prefixed_fabric(app: AdminApp) -> None:
    response = await get(app, "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = response.text.splitlines()
    samples = [line for line in lines if line and not line.startswith("#")]
    assert samples
    assert all(line.startswith("fabric_") for line in samples)
    for line in samples:
        float(line.rsplit(" ", 1)[1])  # every value parses
    text = response.text
    assert 'fabric_registry_entries{state="serving"} 3' in text
    assert 'fabric_registry_entries{state="left"} 1' in text
    assert 'fabric_members{liveness="dead"} 1' in text
    assert 'fabric_members{liveness="suspect"} 1' in text
    assert "fabric_keyring_reloads_total 2" in text
    assert "fabric_transport_datagrams_in_total 10" in text
    assert "fabric_gossip_packets_out_total" in text
    families = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(families) == len(set(families)), "one TYPE header per family"


# -- HTTP behaviour -------------------------------------------------------------------------------


async def test_unknown_path_is_404_json(app: AdminApp) -> None:
    assert_openai_error(await get(app, "/nope"), 404, "not_found")
    assert_openai_error(await get(app, "/fabric/v1/nodes/"), 404, "not_found")


async def test_wrong_method_is_405_with_allow_header(app: AdminApp) -> None:
    async with client(app) as c:
        response = await c.post("/fabric/v1/nodes", content=b"{}")
        unknown = await c.delete("/nope")
    assert_openai_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "GET, HEAD"
    assert unknown.status_code == 404


async def test_head_answers_headers_without_a_body(app: AdminApp) -> None:
    async with client(app) as c:
        response = await c.head("/fabric/v1/nodes")
    assert response.status_code == 200
    assert response.content == b""
    assert int(response.headers["content-length"]) > 0


async def test_public_port_hides_agent_endpoints_when_admin_is_separate(mesh: Mesh) -> None:
    app = AdminApp(mesh.core, agent_endpoints=False)
    assert (await get(app, "/health")).status_code == 200
    assert (await get(app, "/ready")).status_code == 200
    for path in ("/fabric/v1/nodes", "/fabric/v1/self", "/metrics"):
        assert (await get(app, path)).status_code == 404


async def test_lifespan_protocol_is_completed(app: AdminApp) -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_a_bug_in_a_handler_is_a_500_json_error(app: AdminApp, mesh: Mesh) -> None:
    mesh.core.loads[mesh.sid("joining")] = "not a load"  # type: ignore[assignment]
    response = await get(app, "/fabric/v1/nodes")
    assert_openai_error(response, 500, "internal_error")
    assert response.json()["error"]["type"] == "server_error"
    json.dumps(response.json())


async def test_untrusted_assignments_are_counted_in_one_log_line(
    app: AdminApp, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who can reach the admin port can post assignments; those signed by a key the
    mesh does not trust are refused, counted in a metric, and logged once per request (3,000
    of them used to write 3,000 lines, each carrying the poster's plan id)."""
    intruder = OperatorKey(Identity.from_seed(b"intruder"))
    forged = [
        AssignmentBody(
            "ab" * 16, f"p{i}\nforged line", NOW, NOW + 600, "m", 1, 1, intruder.public_key
        ).sign(intruder)
        for i in range(3000)
    ]
    caplog.set_level("INFO", logger="fabricnode.control.app")
    async with client(app) as c:
        r = await c.post(
            "/fabric/v1/assignments", json={"assignments": [a.to_json() for a in forged]}
        )
    assert r.status_code == 200
    assert {x["result"] for x in r.json()["results"]} == {"untrusted"}
    lines = [rec.getMessage() for rec in caplog.records if "assignment" in rec.getMessage()]
    assert lines == ["assignments not taken: 3000 untrusted"]
    text = (await get(app, "/metrics")).text
    assert 'fabric_assignments_refused_total{outcome="untrusted"} 3000.0' in text


async def test_service_file_post_and_get(app: AdminApp, mesh: Mesh) -> None:
    """POST /fabric/v1/services takes an operator-signed file (trusted keys only), GET shows it
    with its text; malformed posts are 400 and refused ones are counted."""
    operator = OperatorKey(Identity.from_seed(b"operator"))
    text = '[[model]]\nname = "m"\nengine = "sim"\n'
    signed = ServicesBody(NOW, text, operator.public_key).sign(operator)
    async with client(app) as c:
        r = await c.post("/fabric/v1/services", json=signed.to_json())
        assert r.status_code == 200 and r.json()["result"] == "untrusted"
        mesh.core.services.trusted = frozenset({operator.fingerprint})
        r = await c.post("/fabric/v1/services", json=signed.to_json())
        assert r.status_code == 200 and r.json()["result"] == "new"
        assert r.json()["operator"] == operator.fingerprint
        for bad in (b"not json", b'{"signed": "%%%", "signature": ""}', b"[]"):
            r = await c.post("/fabric/v1/services", content=bad)
            assert_openai_error(r, 400, r.json()["error"]["code"])
        r = await c.put("/fabric/v1/services", content=b"{}")
        assert r.status_code == 405 and "GET or POST" in r.json()["error"]["message"]
    doc = (await get(app, "/fabric/v1/services")).json()
    assert doc["services"]["text"] == text and doc["services"]["issued_at"] == NOW
    assert doc["trusted_operators"] == [operator.fingerprint]
    text = (await get(app, "/metrics")).text
    assert 'fabric_services_refused_total{outcome="untrusted"} 1.0' in text


async def test_workload_after_a_cursor_sums_only_what_the_log_gained(
    mesh: Mesh, tmp_path: Path
) -> None:
    """``after=end`` gives a cursor; ``after=<cursor>`` only the records logged since, per
    model, and the next cursor; ``window`` still summarises the whole window."""
    log_path = tmp_path / "requests.jsonl"
    app = AdminApp(mesh.core, wall_clock=lambda: NOW + 1, request_log_path=log_path)
    log = RequestLog(log_path)
    log.append(TraceRecord(NOW - 5, "m", 100, 10, 1.0))
    log.flush()
    first = (await get(app, "/fabric/v1/workload", after="end")).json()
    assert first["models"] == {} and first["cursor"] != "end"
    log.append(TraceRecord(NOW - 1, "m", 40, 4, 1.0, ttft_s=0.3, stream=True))
    log.append(TraceRecord(NOW - 1, "other", 7, 1, 1.0))
    log.flush()
    doc = (await get(app, "/fabric/v1/workload", after=first["cursor"])).json()
    assert doc["after"] == first["cursor"]
    assert doc["models"]["m"]["requests"] == 1 and doc["models"]["m"]["prompt_tokens"] == 40
    assert (
        doc["models"]["m"]["output_tokens"] == 4 and sum(doc["models"]["m"]["ttft"].values()) == 1
    )
    assert doc["models"]["other"]["requests"] == 1
    again = (await get(app, "/fabric/v1/workload", after=doc["cursor"])).json()
    assert again["models"] == {} and again["cursor"] == doc["cursor"]
    window = (await get(app, "/fabric/v1/workload", window="60")).json()
    assert window["models"]["m"]["requests"] == 2  # the window's behaviour is unchanged
    for bad in ({"after": "x:1"}, {"after": "end", "window": "60"}):
        r = await get(app, "/fabric/v1/workload", **bad)
        assert_openai_error(r, 400, "invalid_parameter")


async def test_workload_history_gives_the_logs_past_by_bin_and_a_cursor_after_it(
    mesh: Mesh, tmp_path: Path
) -> None:
    """``history=&bin=``: the sums by bin aligned to multiples of ``bin`` over the last
    ``history`` seconds, the cursor after what was read (asking after it counts nothing
    twice), and ``covers_from`` null while the log was never rotated."""
    log_path = tmp_path / "requests.jsonl"
    app = AdminApp(mesh.core, wall_clock=lambda: NOW + 1, request_log_path=log_path)
    log = RequestLog(log_path)
    log.append(TraceRecord(NOW - 100, "m", 100, 10, 1.0))  # before the history asked for
    log.append(TraceRecord(NOW - 35, "m", 40, 4, 1.0))
    log.append(TraceRecord(NOW - 34, "m", 60, 6, 1.0))
    log.append(TraceRecord(NOW - 3, "other", 7, 1, 1.0))
    log.flush()
    doc = (await get(app, "/fabric/v1/workload", history="60", bin="10")).json()
    start = (NOW + 1 - 60) // 10 * 10
    assert doc["start"] == start and doc["bin_s"] == 10 and doc["covers_from"] is None
    bins = {b["start"]: b["models"] for b in doc["bins"]}
    assert all((t - start) % 10 == 0 for t in bins)
    m = bins[(NOW - 35 - start) // 10 * 10 + start]["m"]
    assert (m["requests"], m["prompt_tokens"], m["output_tokens"]) == (2, 100, 10)
    assert sum(row.get("m", {}).get("requests", 0) for row in bins.values()) == 2
    assert bins[(NOW - 3 - start) // 10 * 10 + start]["other"]["requests"] == 1
    after = (await get(app, "/fabric/v1/workload", after=doc["cursor"])).json()
    assert after["models"] == {}  # nothing counted twice
    log.append(TraceRecord(NOW, "m", 1, 1, 1.0))
    log.flush()
    after = (await get(app, "/fabric/v1/workload", after=doc["cursor"])).json()
    assert after["models"]["m"]["requests"] == 1  # nothing lost
    for bad in (
        {"history": "0", "bin": "10"},
        {"history": "60"},
        {"bin": "10"},
        {"history": "60", "bin": "0.5"},
        {"history": "60", "bin": "120"},
        {"history": "86400", "bin": "1"},
        {"history": "nan", "bin": "10"},
        {"history": "60", "bin": "10", "after": "end"},
    ):
        r = await get(app, "/fabric/v1/workload", **bad)
        assert_openai_error(r, 400, "invalid_parameter")


async def test_sites_are_a_gateways_view_and_404_elsewhere(mesh: Mesh) -> None:
    plain = AdminApp(mesh.core, wall_clock=lambda: NOW)
    message = assert_openai_error(await get(plain, "/fabric/v1/sites"), 404, "not_found")
    assert "not a gateway" in message
    doc = {"site": "A", "sites": [{"site": "C", "routable": False, "summary": None}]}
    gateway = AdminApp(mesh.core, wall_clock=lambda: NOW, sites=lambda: doc)
    response = await get(gateway, "/fabric/v1/sites")
    assert response.status_code == 200 and response.json() == doc
