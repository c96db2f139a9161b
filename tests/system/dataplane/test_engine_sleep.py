"""Warm capacity with real agents and simulated engines: a node started with `--sleep-after`
puts its idle engine to sleep, is shown asleep in the registry and `fabric nodes`, and is not
routed to while its model has an awake replica; once none is awake, a request through another
agent's ingress wakes it and is answered, and so is one sent straight to its own ingress. An
engine without sleep mode (the stub engine: 404 on /is_sleeping) is never put to sleep."""

from __future__ import annotations

import sys

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.mesh.schema import SLEEPING_LABEL
from tests.support import SUPPORT
from tests.support.meshview import entry, fabric, free_port, metrics, state_is

pytestmark = pytest.mark.slow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "wake up"}], "max_tokens": 4}


def asleep(watcher: AgentProcess, sid: str) -> bool:
    e = entry(watcher, sid)
    return e is not None and SLEEPING_LABEL in e["labels"]


def awake(watcher: AgentProcess, sid: str) -> bool:
    e = entry(watcher, sid)
    return e is not None and e["state"] == "serving" and SLEEPING_LABEL not in e["labels"]


def ask(agent: AgentProcess) -> httpx.Response:
    return httpx.post(agent.http_url + "/v1/chat/completions", json=CHAT, timeout=30)


def test_an_idle_node_sleeps_is_not_routed_to_and_a_request_wakes_it(mesh: LocalMesh) -> None:
    ingress = mesh.start("ingress")
    sleepy = mesh.start(
        "sleepy", args=["--sim", "m", "--sleep-after", "2", "--sim-args", "--wake-up-s 0.5"]
    )
    busy = mesh.start("busy", args=["--sim", "m"])
    sid = sleepy.session_id
    assert wait_until(lambda: awake(ingress, busy.session_id), 20)
    assert wait_until(lambda: asleep(ingress, sid), 20), entry(ingress, sid)
    assert entry(ingress, sid)["labels"][SLEEPING_LABEL] == "1"  # type: ignore[index]

    shown = fabric(mesh, ingress, "nodes", timeout_s=30)
    (row,) = [line for line in shown.stdout.splitlines() if line.startswith(sid[:12])]
    assert "serving, asleep" in row
    one = fabric(mesh, ingress, "node", sid[:12], timeout_s=30)
    assert "asleep (sleep level 1)" in one.stdout and "the next request" in one.stdout

    # an awake replica exists: every request goes there, the sleeping one stays asleep
    for _ in range(6):
        r = ask(ingress)
        assert r.status_code == 200 and r.headers["x-fabric-node"] == busy.session_id
    assert asleep(ingress, sid)
    listed = httpx.get(ingress.http_url + "/v1/models").json()["data"]
    assert [(m["id"], m["fabric_nodes"]) for m in listed] == [("m", 2)]  # asleep ones count

    # the awake replica leaves: the next request wakes the sleeping one and is answered
    busy.terminate()
    assert busy.wait(20) == 0
    assert wait_until(lambda: state_is(ingress, busy.session_id, "left"), 10)
    r = ask(ingress)
    assert r.status_code == 200, r.text
    assert r.headers["x-fabric-node"] == sid
    assert r.json()["choices"][0]["message"]["content"]
    assert wait_until(lambda: awake(ingress, sid), 10)
    assert metrics(sleepy.http_url).get('fabric_engine_wake_ups_total{outcome="woken"}') == 1

    # asleep again, then woken by a request sent straight to its own ingress (JSON and stream)
    assert wait_until(lambda: asleep(sleepy, sid), 20)
    r = ask(sleepy)
    assert r.status_code == 200 and r.headers["x-fabric-node"] == sid
    assert wait_until(lambda: asleep(sleepy, sid), 20)
    with httpx.stream(
        "POST", sleepy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True},
        timeout=30,
    ) as s:  # fmt: skip
        lines = [line for line in s.iter_lines() if line]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]"
    log = sleepy.stderr_path.read_text()
    assert log.count("engine asleep (level 1)") >= 3 and log.count("engine awake") >= 3


def test_an_engine_without_sleep_mode_is_never_put_to_sleep(mesh: LocalMesh) -> None:
    watcher = mesh.start("watcher")
    port = free_port()
    stub = [sys.executable, str(SUPPORT / "stub_engine.py"), str(port), "0.1", "0"]
    node = mesh.start(
        "stub",
        args=["--sleep-after", "1", "--engine-url", f"http://127.0.0.1:{port}", "--", *stub],
    )
    sid = node.session_id
    assert wait_until(lambda: state_is(watcher, sid, "serving"), 20)

    def said_so() -> bool:
        return "the engine has no sleep mode" in node.stderr_path.read_text()

    assert wait_until(said_so, 20), node.stderr_tail(20)
    assert "GET /is_sleeping answers 404" in node.stderr_path.read_text()
    assert awake(watcher, sid)
    assert "engine asleep" not in node.stderr_path.read_text()
    assert node.stderr_path.read_text().count("has no sleep mode") == 1  # said once
