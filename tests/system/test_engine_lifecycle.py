"""`fabric start -- ENGINE_CMD` with real processes: SERVING, load, crash/hang → DOWN, leave."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.control.client import AdminClient
from fabricnode.errors import AgentApiError
from tests.support import SUPPORT
from tests.support.meshload import engine_process
from tests.support.meshview import entry, free_port, metrics, state_is

pytestmark = pytest.mark.slow

STUB_ENGINE = SUPPORT / "stub_engine.py"


def engine_args(port: int, *extra: str) -> list[str]:
    url = f"http://127.0.0.1:{port}"
    return [
        "--engine-url",
        url,
        "--",
        sys.executable,
        str(STUB_ENGINE),
        str(port),
        "0.3",
        "0",
        *extra,
    ]


def engine_pids(mesh: LocalMesh, agent: AgentProcess) -> tuple[int, int]:
    logs = list((mesh.workdir / "logs").glob(f"*-{agent.session_id[:8]}/engine.log"))
    assert logs, "no engine log under $FABRIC_HOME/logs"
    found = dict(line.split() for line in logs[0].read_text().splitlines() if line[:1] in "ew")
    return int(found["engine"]), int(found["worker"])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_engine_node_serves_reports_load_and_leaves_without_orphans(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    node = mesh.start("engine", args=["--sim-gpu", "H100:2", *engine_args(free_port())])
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20), entry(watcher, sid)
    e = entry(watcher, sid)
    assert e is not None
    assert (e["hardware"]["gpu_type"], e["hardware"]["gpu_count"]) == ("H100", 2)
    assert e["models"] == [
        {"id": "tiny-llama", "max_model_len": 512, "quantization": None, "parent": None}
    ]
    assert e["engine"]["kind"] == "openai" and e["engine"]["url"].startswith("http://127.0.0.1:")
    assert httpx.get(f"{node.http_url}/ready", timeout=2).status_code == 200

    def load_seen() -> bool:
        got = entry(watcher, sid)
        return got is not None and got["load"] is not None and got["load"]["running"] == 5

    assert wait_until(load_seen, 10), entry(watcher, sid)
    e = entry(watcher, sid)
    assert e is not None and e["load"]["waiting"] == 2 and e["load"]["kv_usage"] == 0.25

    engine, worker = engine_pids(mesh, node)
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(15) == 0
    assert state_is(watcher, sid, "left")
    assert wait_until(lambda: gone(engine) and gone(worker), 5), "engine outlived its agent"


def listed(ingress: AgentProcess) -> dict[str, Any]:
    """``/v1/models`` of an ingress: id -> its row."""
    r = httpx.get(f"{ingress.http_url}/v1/models", timeout=2)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def test_lora_adapter_loaded_at_runtime_is_listed_and_routed_everywhere_then_gone(
    mesh: LocalMesh,
) -> None:
    # The engine's model list is re-read every 2 s: an adapter loaded through the engine's API
    # (vLLM's /v1/load_lora_adapter, here the stub's) is a model on every ingress within
    # seconds, named with its parent, and requests naming it are routed to the node; unloaded,
    # it goes. A list the engine cannot give meanwhile leaves the last good one in place.
    watcher = mesh.start("watcher")
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    node = mesh.start("engine", args=engine_args(port))
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20), entry(watcher, sid)
    assert wait_until(lambda: "tiny-llama" in listed(watcher), 10)
    assert listed(watcher)["tiny-llama"]["parent"] is None

    lora = {"lora_name": "tiny-lora", "lora_path": "/adapters/tiny-lora"}
    r = httpx.post(f"{engine_url}/v1/load_lora_adapter", json=lora, timeout=2)
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    assert wait_until(lambda: "tiny-lora" in listed(watcher), 10, interval_s=0.1)
    appeared_s = time.monotonic() - t0
    print(f"adapter listed by another agent {appeared_s:.1f} s after it was loaded")
    assert appeared_s < 5.0
    row = listed(watcher)["tiny-lora"]
    assert row["parent"] == "tiny-llama" and row["fabric_nodes"] == 1
    e = entry(watcher, sid)
    assert e is not None and e["models"] == [
        {"id": "tiny-llama", "max_model_len": 512, "quantization": None, "parent": None},
        {"id": "tiny-lora", "max_model_len": None, "quantization": None, "parent": "tiny-llama"},
    ]

    chat = {"model": "tiny-lora", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{watcher.http_url}/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-lora" and r.headers["x-fabric-node"] == sid

    # The engine stops giving its list (500): the entry keeps the last good one.
    version = e["version"]
    httpx.post(f"{engine_url}/stub/models-broken", json={"broken": True}, timeout=2)
    read_errors = "fabric_engine_model_read_errors_total"
    assert wait_until(lambda: metrics(node.http_url).get(read_errors, 0) >= 2, 15)  # 2 refreshes
    e = entry(watcher, sid)
    assert e is not None and e["version"] == version and len(e["models"]) == 2, e
    httpx.post(f"{engine_url}/stub/models-broken", json={"broken": False}, timeout=2)
    counted = metrics(node.http_url)
    assert counted['fabric_engine_models_dropped{reason="too_many"}'] == 0

    r = httpx.post(f"{engine_url}/v1/unload_lora_adapter", json=lora, timeout=2)
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    assert wait_until(lambda: "tiny-lora" not in listed(watcher), 10, interval_s=0.1)
    print(f"adapter gone from another agent {time.monotonic() - t0:.1f} s after its unload")
    assert time.monotonic() - t0 < 5.0
    r = httpx.post(f"{watcher.http_url}/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert "tiny-llama" in listed(watcher)


def test_engine_crash_is_down_everywhere_within_a_second(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    node = mesh.start("engine", args=engine_args(free_port()))
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20)
    engine, worker = engine_pids(mesh, node)
    os.kill(engine, signal.SIGKILL)
    t0 = time.monotonic()
    assert wait_until(lambda: state_is(watcher, sid, "down"), 5, interval_s=0.05)
    assert time.monotonic() - t0 < 1.5
    assert node.running  # the agent stays, announcing DOWN, until it is told to leave
    assert httpx.get(f"{node.http_url}/ready", timeout=2).status_code == 503
    assert wait_until(lambda: gone(worker), 5), "the engine's worker was left behind"


def test_hung_engine_is_announced_down_and_stopped(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    node = mesh.start("engine", args=engine_args(free_port(), "2"))
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20)
    engine, _ = engine_pids(mesh, node)
    assert wait_until(lambda: state_is(watcher, sid, "down"), 20)
    assert wait_until(lambda: gone(engine), 15), "hung engine not stopped"


def test_engine_that_never_starts_is_down_and_the_agent_survives(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    args = ["--", sys.executable, "-c", "raise SystemExit(3)", "--port", str(free_port())]
    node = mesh.start("engine", args=args)
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "down"), 10)
    assert node.running


def sim_args(*faults: str) -> list[str]:
    """The built-in simulated engine with fault flags; the agent binds its port."""
    return ["--sim", "sim-llama-8b", "--sim-gpu", "H100", "--sim-args", " ".join(faults)]


def engine_url_of(watcher: AgentProcess, sid: str) -> str:
    e = entry(watcher, sid)
    assert e is not None and e["engine"]["url"], e
    return str(e["engine"]["url"])


def test_simulated_engine_crash_is_down_everywhere(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    node = mesh.start("engine", args=sim_args("--crash-after-s", "2"))
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20), entry(watcher, sid)
    e = entry(watcher, sid)
    assert e is not None and e["engine"]["version"]  # read from the engine's /version
    assert wait_until(lambda: state_is(watcher, sid, "down"), 10), entry(watcher, sid)
    assert node.running


def test_simulated_engine_hang_is_down_and_the_engine_is_stopped(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    node = mesh.start("engine", args=sim_args("--hang-after-s", "2"))
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20), entry(watcher, sid)
    engine = engine_process(node)
    assert engine is not None
    assert wait_until(lambda: state_is(watcher, sid, "down"), 20), entry(watcher, sid)
    assert wait_until(lambda: not engine.running(), 20), "hung engine still running"
    assert node.running


def test_request_queued_at_a_hung_engine_gets_an_answer_once_it_is_down(mesh: LocalMesh) -> None:
    """The agent holds its engine's listening socket (for the next engine), so the kernel keeps
    queueing connections while no engine accepts them: a request that reached the socket as the
    engine hung must be given up when the engine goes DOWN, not wait out the first-byte timeout
    (30 minutes) in the queue."""
    node = mesh.start("engine", args=sim_args())  # --restart no: no engine takes over
    sid = node.session_id
    assert wait_until(lambda: state_is(node, sid, "serving"), 20), entry(node, sid)
    engine = engine_process(node)
    assert engine is not None
    os.kill(engine.pid, signal.SIGSTOP)  # hung: accepts nothing, answers nothing
    body = {"model": "sim-llama-8b", "prompt": "hello", "max_tokens": 4}
    try:
        r = httpx.post(f"{node.http_url}/v1/completions", json=body, timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped by the agent by now
            os.kill(engine.pid, signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_eligible_node"
    assert state_is(node, sid, "down")
    assert node.running


def test_sigterm_lets_in_flight_requests_finish_then_leaves(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    node = mesh.start("engine", args=sim_args("--slowdown", "3"))
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20), entry(watcher, sid)
    url = engine_url_of(watcher, sid)
    result: dict[str, Any] = {}
    finished: list[float] = []

    def ask() -> None:
        body = {"model": "sim-llama-8b", "prompt": "hello there", "max_tokens": 200}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        result["status"] = r.status_code
        result["tokens"] = r.json()["usage"]["completion_tokens"]
        finished.append(time.monotonic())

    import threading

    asker = threading.Thread(target=ask)
    asker.start()

    def decoding() -> bool:  # the engine has the request in its running batch
        m = metrics(url)
        return sum(v for k, v in m.items() if k.startswith("vllm:num_requests_running")) >= 1

    assert wait_until(decoding, 10, interval_s=0.05)
    t0 = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    asker.join(30)
    assert result == {"status": 200, "tokens": 200}  # finished, not cut off
    assert finished and finished[0] > t0 + 0.2, "the request was not in flight at SIGTERM"
    assert node.proc.wait(20) == 0
    assert state_is(watcher, sid, "left")
    assert time.monotonic() - t0 < 15


def test_restarted_engine_is_a_new_serving_session_and_the_old_one_left(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    args = ["--restart", "on-failure", "--max-restarts", "1"]
    node = mesh.start("engine", args=args + sim_args("--crash-after-s", "2"))
    first = node.session_id
    assert wait_until(lambda: state_is(watcher, first, "serving"), 20), entry(watcher, first)

    def new_sessions() -> list[dict[str, Any]]:
        try:
            with AdminClient(watcher.http_url, timeout_s=2.0) as client:
                nodes = client.nodes()
        except AgentApiError:
            return []
        return [
            n
            for n in nodes
            if n["addresses"]["gossip"] == node.gossip_addr and n["session_id"] != first
        ]

    assert wait_until(lambda: [n["state"] for n in new_sessions()] == ["serving"], 30), (
        entry(watcher, first),
        new_sessions(),
    )
    assert state_is(watcher, first, "left")  # retired, not merely dead
    assert node.running
    # The restarted engine crashes again after 2 s; with one restart allowed it stays DOWN.
    second = new_sessions()[0]["session_id"]
    assert wait_until(lambda: state_is(watcher, second, "down"), 15)
    time.sleep(3)
    assert [n["session_id"] for n in new_sessions()] == [second]
